"""The per-token attribution of the training–inference mismatch (rl.attribution,
stablerl_jax/method/attribution.py): the parts add up to the total, each vanishes where its
source does, the bins partition the tokens, the per-layer split adds up with its
interaction, partial rollouts take each token's terms from its version, and a run logs,
plots, dumps and resumes it, and the notebook reads it. `slow`: packed steps and
rl.score_in_update attribute as the plain ones."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg, versions_and_rollout

from stablerl_jax.config import SamplingConfig
from stablerl_jax.method import attribution
from stablerl_jax.method.diagnostics import reduce_metrics
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import loop, probe
from stablerl_jax.rl.engine import Engine

# Rewards of 4 groups of 2: advantages ±0.5 in three groups, so the updates move θ.
REWARDS = np.array([1, 0, 0, 1, 1, 0, 0, 0], np.float32)
EPS32 = float(np.finfo(np.float32).eps)


class _Tokens:
    """A tokenizer's `decode_raw` for the dump: the tiny model's ids need no vocabulary."""

    @staticmethod
    def decode_raw(ids):
        return " ".join(f"<{i}>" for i in ids)


def _step(sampling: SamplingConfig | None = None, minibatches: int = 2,
          batch_invariant: bool = False, **rl):
    """One global step of the tiny model through the Engine, the probe on 4 rows: (the
    step's reduced metrics with `attribution.derive`, the score pass's, the dump rows)."""
    cfg = tiny_cfg(num_minibatches=minibatches, attribution=True, attribution_every=1,
                   attribution_rows=4, **rl)
    sampling = sampling or SamplingConfig(max_new_tokens=16, router_noise_std=0.5)
    cfg = cfg.replace(sampling=sampling, model=cfg.model.replace(
        batch_invariant=batch_invariant or sampling.numerics == "bitwise"))
    params = tf.init_params(jax.random.key(0), cfg.model.replace(init_std=0.1))
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    prompts = jax.random.randint(jax.random.key(1), (8, 8), 4, 60)
    ro = eng.sample(params, prompts, jnp.ones((8, 8), bool), jax.random.key(2))
    batch, score_metrics = eng.score(params, ro, REWARDS)
    probed = probe.Probe(eng, params, ro, batch, step=0)
    state = eng.init_state(params)
    updates = []
    for rows in np.arange(8).reshape(minibatches, -1):
        probed.before_update(state.params, rows)
        state, m = eng.update(state, eng.select(batch, rows))
        updates.append(jax.tree.map(np.asarray, m))
    assert int(state.skipped) == 0
    metrics = reduce_metrics(updates)
    metrics.update(attribution.derive(metrics))
    dumped, layer = probed.finish(1, _Tokens)
    return {**metrics, **layer}, reduce_metrics([jax.tree.map(np.asarray, score_metrics)]), dumped


@pytest.fixture(scope="module")
def fp8_step():
    return _step()


def test_the_parts_add_up_to_the_total_per_token_and_in_every_moment(fp8_step):
    metrics, _, dumped = fp8_step
    assert len(dumped) == 4 and sum(len(r["ids"]) for r in dumped) > 20
    for row in dumped:
        total = np.array(row["logp_theta"]) - np.array(row["logp_mu"])
        parts = sum(np.array(row[p]) for p in attribution.PARTS)
        # Each part is a float32 difference, then rounded to DUMP_DIGITS significant
        # digits in the file: the sum holds within those roundings of the log-probs.
        scale = np.maximum(np.abs(row["logp_mu"]), np.abs(row["logp_theta"]))
        np.testing.assert_allclose(parts, total, rtol=0,
                                   atol=float(4 * 10 ** (1 - probe.DUMP_DIGITS) * scale.max()))
        assert len(row["tokens"]) == len(row["ids"]) == len(row["flipped_layers"])
    # The step's moments: means add up, and Var(total) = Σ Var + 2 Σ Cov (float64 sums
    # of float32 terms: relative rounding ≈ a few float32 epsilons).
    mean = sum(metrics[f"attr/{p}_mean"] for p in attribution.PARTS)
    assert mean == pytest.approx(metrics["attr/total_mean"], rel=1e-5, abs=1e-9)
    var = sum(metrics[f"attr/{p}_var"] for p in attribution.PARTS) + 2 * sum(
        v for k, v in metrics.items() if "_cov_" in k)
    assert var == pytest.approx(metrics["attr/total_var"], rel=1e-4)
    assert sum(metrics[f"attr/{p}_share"] for p in attribution.PARTS) == pytest.approx(1.0)
    # The second mini-batch's update ran at θ moved by the first: a real staleness part.
    assert metrics["attr/staleness_sqmean"] > 0
    # Without replay the routing part is the counterfactual one.
    assert metrics["attr/routing_mean"] == metrics["attr/routing_cf_mean"]
    assert metrics["attr/routing_sqmean"] > 0


def test_at_theta_old_the_total_is_the_score_steps_mismatch_and_staleness_is_zero():
    metrics, score, dumped = _step(minibatches=1)
    # π_θ = π_old in the one update: the update's forward repeats the score pass's.
    assert metrics["attr/staleness_sqmean"] <= (4 * EPS32) ** 2 * 100
    for row in dumped:
        np.testing.assert_allclose(row["staleness"], 0.0, atol=4 * EPS32 * 10)
    # The total is log π_old − log μ: minus the score step's k1 monitor.
    assert metrics["attr/total_mean"] == pytest.approx(-score["kl/train_infer_k1"], rel=1e-4)


def test_with_the_training_numerics_in_the_sampler_the_precision_part_vanishes(fp8_step):
    exact, _, _ = _step(SamplingConfig(max_new_tokens=16, numerics="exact"))
    # The sampler's decode (KV cache, one token at a time) and the trainer's full forward
    # compute the same sums in another order: float32 rounding of log-probs of size ≈ 4
    # (|log 1/64|), a few epsilons per token, against FP8 weights' percent-level error.
    assert exact["attr/precision_sqmean"] < (100 * 4 * EPS32) ** 2
    assert fp8_step[0]["attr/precision_sqmean"] > 1e3 * exact["attr/precision_sqmean"]


@pytest.mark.integration
def test_from_zero_mismatch_each_injected_source_lands_in_its_own_part():
    """With the `bitwise` sampler (μ = π_old bit for bit) every part is exactly 0, and one
    source injected at a time shows up in its own part only: staleness (N = 2) in the
    staleness part; router noise, with its combine weights replayed (r3 +
    rl.replay_weights), nowhere; FP8 weights over per-token numerics in the precision
    part, with a routing part of exactly 0 on every row whose experts never flipped."""
    bitwise = SamplingConfig(max_new_tokens=16, numerics="bitwise")
    parts = lambda m: {p: m[f"attr/{p}_sqmean"] for p in attribution.PARTS}
    zero, _, dumped = _step(bitwise, minibatches=1)
    assert parts(zero) == {p: 0.0 for p in attribution.PARTS}
    assert zero["attr/total_sqmean"] == 0.0
    assert all(v == 0.0 for row in dumped for p in attribution.PARTS for v in row[p])
    stale, _, _ = _step(bitwise, minibatches=2)
    assert stale["attr/precision_sqmean"] == stale["attr/routing_sqmean"] == 0.0
    assert stale["attr/staleness_sqmean"] == stale["attr/total_sqmean"] > 0
    noise, _, _ = _step(bitwise.replace(router_noise_std=0.5), minibatches=1, replay="r3",
                        replay_weights=True)
    assert parts(noise) == {p: 0.0 for p in attribution.PARTS}
    fp8, _, dumped = _step(SamplingConfig(max_new_tokens=16, numerics="fp8"), minibatches=1,
                           batch_invariant=True)
    assert fp8["attr/staleness_sqmean"] == 0.0 and fp8["attr/precision_sqmean"] > 0
    unflipped = [row for row in dumped if not any(row["flipped_layers"])]
    assert unflipped and all(v == 0.0 for row in unflipped for v in row["routing"])


def test_under_r3_the_routing_part_is_zero_and_the_counterfactual_is_not():
    metrics, _, dumped = _step(replay="r3")
    assert metrics["attr/routing_sqmean"] == 0.0
    assert metrics["attr/routing_cf_sqmean"] > 0
    assert all(v == 0.0 for row in dumped for v in row["routing"])
    assert any(v != 0.0 for row in dumped for v in row["routing_cf"])
    assert any(row["flipped_layers"][t] for row in dumped for t in range(len(row["ids"])))


def test_the_bins_partition_the_scored_tokens(fp8_step):
    metrics = fp8_step[0]
    for family, _, labels in attribution.BINS:
        shares = [metrics[f"attr_bin/{family}_{label}/share"] for label in labels]
        assert sum(shares) == pytest.approx(1.0)
        # The bins' means, weighted by their shares, are the whole step's mean.
        for part in attribution.PARTS + ("total",):
            weighted = sum(s * metrics[f"attr_bin/{family}_{label}/{part}_mean"]
                           for s, label in zip(shares, labels) if s > 0)
            assert weighted == pytest.approx(metrics[f"attr/{part}_mean"], rel=1e-4, abs=1e-9)


def test_bins_by_probability_entropy_and_position():
    mask = np.array([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]],
                    np.float32)
    logp_mu = np.log(np.tile([0.05, 0.3, 0.9, 0.05, 0.3, 0.9, 0.05, 0.3, 0.9, 0.05, 0.3],
                             (2, 1)))
    entropy = np.tile([0.01, 0.5, 2.0, 0.01, 0.5, 2.0, 0.01, 0.5, 2.0, 0.01, 0.5], (2, 1))
    got = {k: np.asarray(v) for k, v in attribution.bins(logp_mu, entropy, mask).items()}
    np.testing.assert_array_equal(got["mu"][0], [0, 1, 2] * 3 + [0, 1])
    np.testing.assert_array_equal(got["entropy"][0], [0, 1, 2] * 3 + [0, 1])
    # Row 0: 9 scored tokens, three per third; row 1: one token, the first third.
    np.testing.assert_array_equal(got["pos"][0][mask[0] > 0], [0, 0, 0, 1, 1, 1, 2, 2, 2])
    assert got["pos"][1][2] == 0


def test_a_layer_whose_routes_alone_differ_carries_the_whole_routing_part():
    cfg = tiny_cfg().model.replace(init_std=0.1)
    params = tf.init_params(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (4, 12), 4, 60)
    attn = jnp.ones(tokens.shape, bool)

    def forward(replay, weights):
        logp, entropy, aux = policy_logprobs(params, tokens, attn, cfg, replay_BxTxLxK=replay,
                                             replay_weights_BxTxLxK=weights)
        return logp, entropy, aux["routes"]

    live = np.asarray(forward(None, None)[2])
    # The sampler's routes: live ones, with layer 1's experts shifted on every other token.
    routes_mu = live.copy()
    routes_mu[:, ::2, 1] = (live[:, ::2, 1] + 1) % cfg.num_experts
    routes_mu[:, ::2, 1, 1] = np.where(routes_mu[:, ::2, 1, 1] == routes_mu[:, ::2, 1, 0],
                                       (routes_mu[:, ::2, 1, 1] + 1) % cfg.num_experts,
                                       routes_mu[:, ::2, 1, 1])
    found = attribution.probe(lambda fn: fn(forward), jnp.asarray(routes_mu), "none")
    layer, cf = np.asarray(found["layer"]), np.asarray(found["routing_cf"])
    assert np.abs(cf).max() > 1e-3  # the flips move the log-probs
    # Replaying a layer's live routes changes nothing (≤ rounding of the recomputed
    # combine weights); the flipped layer's alone is the whole counterfactual part.
    np.testing.assert_allclose(layer[0], 0.0, atol=20 * EPS32 * 4)
    np.testing.assert_array_equal(layer[1], cf)
    flipped = np.asarray(found["flipped"])
    assert flipped[:, ::2, 1].all() and not flipped[:, :, 0].any()
    m = attribution.layer_metrics(layer, cf, np.ones(cf.shape))
    assert m["attr_layer/l1_share"] == pytest.approx(1.0, abs=1e-4)
    assert (m["attr_layer/l0_share"] + m["attr_layer/l1_share"]
            + m["attr_layer/interaction_share"]) == pytest.approx(1.0)


def test_the_layer_shares_and_the_interaction_add_to_one(fp8_step):
    metrics = fp8_step[0]
    layers = [v for k, v in metrics.items() if k.startswith("attr_layer/l") and
              k.endswith("_share")]
    assert len(layers) == tiny_cfg().model.num_layers
    assert sum(layers) + metrics["attr_layer/interaction_share"] == pytest.approx(1.0)


def test_attribution_settings_are_checked():
    from stablerl_jax.config import ConfigError
    with pytest.raises(ConfigError, match="attribution_rows"):
        tiny_cfg(attribution=True, attribution_rows=-1)
    with pytest.raises(ConfigError, match="attribution_rows: the probe's 8 rows"):
        tiny_cfg(attribution=True, prompts_per_step=2)
    tiny_cfg(attribution=True, attribution_every=0, prompts_per_step=2, num_minibatches=1)
    with pytest.raises(ConfigError, match="attribution_every"):
        tiny_cfg(attribution=True, attribution_every=-1)
    with pytest.raises(ConfigError, match="rl.attribution_rows: must be a multiple of "
                                          "data\\*fsdp\\*expert = 2"):
        tiny_cfg(mesh=(2, 1, 1), attribution=True, attribution_rows=3)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step tiny run with the attribution and a probe every step, stopped after step 1
    with an attribution row written after its checkpoint (a killed run's), resumed."""
    workdir = str(tmp_path_factory.mktemp("attribution") / "run")
    cfg = tiny_cfg(steps=2, attribution=True, attribution_every=1, eval_every=2,
                   checkpoint_every=1)
    loop.run(cfg.replace(rl=cfg.rl.replace(steps=1)), workdir, progress=False)
    with open(os.path.join(workdir, "attribution.jsonl"), "a") as f:
        f.write(json.dumps({"step": 2, "row": 0}) + "\n")
    loop.run(cfg, workdir, progress=False, allow_config_change=("rl.steps",))
    return workdir


@pytest.mark.integration
def test_a_run_logs_plots_and_dumps_the_attribution_and_resumes_it(run):
    rows = [json.loads(line) for line in open(os.path.join(run, "attribution.jsonl"))]
    # 8 rows a step (rl.attribution_rows=0 on one device), the killed run's row gone.
    assert [r["step"] for r in rows] == [1] * 8 + [2] * 8
    assert all("staleness" in r for r in rows)
    metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert all("attr/precision_share" in m and "attr_layer/l0_share" in m
               for m in metrics[1:])
    plots = set(os.listdir(os.path.join(run, "plots")))
    assert {"mismatch_parts_mean_square.png", "routing_part_share_by_layer.png",
            "mismatch_by_pos_mean_square_of_the_total.png"} <= plots, plots


@pytest.mark.integration
def test_the_notebook_reads_the_run_headless(run):
    from notebooks_test import NOTEBOOKS, _execute, _outputs
    # From notebooks/, as Jupyter starts it (it writes no file).
    text, images = _outputs(_execute("mismatch_attribution", NOTEBOOKS,
                                     {"STABLERL_WORKDIR": run}))
    assert "2 steps with attribution, 16 probed rows; no collapse" in text
    assert "precision" in text and "by pos:" in text and "attr_layer/l1_share" in text
    assert "the 10 largest |log π_θ − log μ|" in text
    assert images == 2  # the parts over steps, the layer shares


def test_under_partial_rollouts_each_tokens_terms_come_from_its_version():
    # rl.old_policy=behavior: the extra forward, like π_old, at each token's version.
    from stablerl_jax.rl import step_fns

    cfg = tiny_cfg(max_staleness=1, attribution=True)
    params, r, age = versions_and_rollout(cfg, (1.0, 1.1))
    comp = np.asarray(r.completion_mask_BxS)
    got, _ = step_fns.score(tuple(params), r, REWARDS, cfg=cfg, age_BxS=jnp.asarray(age))
    for a in (0, 1):
        want, _ = step_fns.score(params[a], r, REWARDS, cfg=cfg)
        mine = (age[:, 1:] == a) & comp[:, 1:]
        assert mine.any()
        # The merged program and the one-version one round the same sums apart: a few
        # float32 epsilons of log-probs of size ≈ 4.
        want_a = np.asarray(want.attr_logp_BxT)[mine]
        np.testing.assert_allclose(np.asarray(got.attr_logp_BxT)[mine], want_a, rtol=0,
                                   atol=8 * EPS32 * np.abs(want_a).max())
    # The probe of the same rows merges its forwards the same way.
    found = probe.probe_rows(tuple(params), r, got, jnp.asarray(age), cfg=cfg)
    mine = comp[:, 1:]
    want = np.asarray(got.attr_logp_BxT)[mine]
    np.testing.assert_allclose(np.asarray(found["logp_mu_routes"])[mine], want, rtol=0,
                               atol=8 * EPS32 * np.abs(want).max())
    np.testing.assert_array_equal(found["age_BxS"], age)


@pytest.mark.slow  # two more steps' programs (~40 s); packing is tested in packing_test.py
def test_packed_score_and_update_attribute_as_the_padded_ones():
    padded, _, _ = _step()
    packed, _, _ = _step(pack_tokens=32)
    for k in ("attr/precision_mean", "attr/routing_sqmean", "attr/staleness_sqmean",
              "attr/total_mean", "attr_bin/pos_last/total_sqmean"):
        # Two programs' float32 rounding of log-probs of size ≈ 4, in sums over ~100
        # tokens: relative 1e-4 of the mean square, or a few epsilons absolute.
        assert packed[k] == pytest.approx(padded[k], rel=1e-3, abs=1e-7), k


@pytest.mark.slow  # one more step's programs (~20 s)
def test_with_score_in_update_the_one_update_attributes_its_own_forward():
    metrics, score, _ = _step(minibatches=1, score_in_update=True)
    assert score == {}  # no score forward: the update's is π_old
    assert metrics["attr/staleness_sqmean"] == 0.0
    assert metrics["attr/total_mean"] == pytest.approx(-metrics["kl/train_infer_k1"], rel=1e-4)
    assert metrics["attr/precision_sqmean"] > 0


@pytest.mark.integration
def test_the_experiments_tables_read_a_sets_runs(run, tmp_path):
    from experiments import mismatch_attribution
    os.makedirs(tmp_path / "minirl")
    os.symlink(run, tmp_path / "minirl" / "seed0")
    text = mismatch_attribution.tables(str(tmp_path), ["minirl"], seeds=(0,))
    lines = text.splitlines()
    assert sum(line.startswith("| minirl (1 seed) |") for line in lines) == 3
    bins = [line for line in lines if line.startswith("| minirl | first |")]
    assert len(bins) == 9  # three families of three bins
    shares = [float(line.split("|")[4]) for line in bins]
    assert sum(shares[:3]) == pytest.approx(1.0, abs=2e-3)  # the μ bins' token shares

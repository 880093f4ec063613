"""Score / update steps through the Engine: the score step builds the update's batch with
the replay its mode asks for, R2 on-policy is a no-op, non-finite updates are skipped,
and a sharded update equals the unsharded one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_devices
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg
from step_helpers import (
    REWARDS,
    assert_same_update,
    step_engine,
    step_rollout,
    step_rollout64,
)
from tolerance import LAMBDA, assert_close, backward_chain, engine_chain

from stablerl_jax import presets
from stablerl_jax.config import SFTConfig
from stablerl_jax.data.batching import SFTBatch
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.rl.step_fns import count_skips


# Rewards of 4 groups of 2: advantages ±0.5 in two groups, 0 in the others.
def test_score_builds_the_update_batch_with_its_replay():
    cfg, params, ro = step_rollout()
    for mode in ("none", "r2", "r3"):
        batch, metrics = step_engine(tiny_cfg(replay=mode)).score(params, ro, REWARDS)
        np.testing.assert_array_equal(batch.advantages_B, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
        np.testing.assert_array_equal(batch.mask_BxT, ro.completion_mask_BxS[:, 1:])
        np.testing.assert_array_equal(batch.rollout_logp_BxT, ro.logp_mu_BxS[:, 1:])
        assert batch.old_logp_BxT.shape == batch.mask_BxT.shape
        assert {"kl/train_infer_k1", "routing/mismatch_rate", "entropy"} <= set(metrics)
        if mode == "none":
            assert batch.replay_BxTxLxK is None
        elif mode == "r3":  # the sampler's routes of the input slots
            np.testing.assert_array_equal(batch.replay_BxTxLxK, ro.routes_mu_BxSxLxK[:, :-1])
            # π_old replayed them too: no routing mismatch left between the engines.
            assert float(metrics["routing/mismatch_rate"][0]) == 0.0
        else:  # r2: the training engine's own routes, -1 on padding
            attn = np.asarray(ro.prompt_mask_BxS | ro.completion_mask_BxS)[:, :-1]
            replay = np.asarray(batch.replay_BxTxLxK)
            assert (replay[attn] >= 0).all() and (replay[~attn] == -1).all()


def test_weight_replay_carries_the_samplers_weights_into_score_and_update():
    cfg, params, ro = step_rollout()
    eng = step_engine(tiny_cfg(replay="r3", replay_weights=True))
    batch, _ = eng.score(params, ro, REWARDS)
    np.testing.assert_array_equal(batch.replay_weights_BxTxLxK,
                                  ro.route_weights_mu_BxSxLxK[:, :-1])
    # π_old is the training engine under the sampler's routes and weights.
    lp = policy_logprobs(params, batch.tokens_BxS, batch.attn_BxS, cfg.model,
                         replay_BxTxLxK=batch.replay_BxTxLxK,
                         replay_weights_BxTxLxK=batch.replay_weights_BxTxLxK)[0]
    assert_close(batch.old_logp_BxT, lp, n=engine_chain(cfg.model, ro.tokens_BxS.shape[1]),
                 lam=LAMBDA, scale="max")
    new, _ = eng.update(eng.init_state(params), batch)
    assert int(new.skipped) == 0
    # Index-only replay leaves the batch without weights.
    plain, _ = step_engine(tiny_cfg(replay="r3")).score(params, ro, REWARDS)
    assert plain.replay_weights_BxTxLxK is None


def test_learning_rates_share_one_compiled_update_and_each_takes_its_own_step():
    """The peak learning rate is optimizer state: engines that differ only in it share
    their jitted steps, each state carries its engine's rate, and Adam's first step along
    the same gradient scales with it (Δθ = -lr · u, u = g / (|g| + eps) the same bits at
    both rates; lr · u rounds by half an ulp of itself and θ + Δθ by half an ulp of the
    larger of |θ|, |θ + Δθ|, so 4 Δθ(lr / 4) and Δθ(lr) differ by at most 2.5 such ulps
    plus 2.5 ulps of Δθ)."""
    cfg, params, ro = step_rollout()
    fast = step_engine(cfg)
    slow = step_engine(tiny_cfg(learning_rate=cfg.rl.optim.learning_rate / 4))
    assert fast._jitted is slow._jitted
    batch, _ = fast.score(params, ro, REWARDS)
    theta = jax.tree.map(lambda x: np.array(x, np.float64), params)
    moved = []
    for eng in (fast, slow):
        state = eng.init_state(params)
        assert state.opt_state.hyperparams["learning_rate"] == np.float32(eng.learning_rate)
        new, _ = eng.update(state, batch)
        moved.append(jax.tree.map(lambda a, t: np.asarray(a, np.float64) - t, new.params,
                                  theta))
    ulp = lambda x: np.spacing(np.abs(x).astype(np.float32)).astype(np.float64)
    for d_fast, d_slow, t in zip(*map(jax.tree.leaves, (*moved, theta))):
        big = np.maximum(np.abs(t), np.maximum(np.abs(t + d_fast), np.abs(t + d_slow)))
        assert np.all(np.abs(4 * d_slow - d_fast) <= 2.5 * (ulp(big) + ulp(d_fast)))
    assert any(np.any(d != 0) for d in jax.tree.leaves(moved[0]))
    # A state restored at another rate takes this engine's (a resume that changes it).
    assert slow.with_learning_rate(fast.init_state(params)).opt_state.hyperparams[
        "learning_rate"] == np.float32(slow.learning_rate)


def test_r2_on_policy_first_minibatch_is_bit_identical_to_no_replay():
    cfg, params, ro = step_rollout()
    batch, _ = step_engine(tiny_cfg(replay="r2")).score(params, ro, REWARDS)
    lp = jax.jit(lambda p, r: policy_logprobs(p, batch.tokens_BxS, batch.attn_BxS, cfg.model,
                                              replay_BxTxLxK=r)[0])
    live = lp(params, None)
    np.testing.assert_array_equal(lp(params, batch.replay_BxTxLxK), live)
    # The score step's π_old is the same math in another compiled program (other fusion,
    # same float32 precision): equal up to summation order.
    assert_close(batch.old_logp_BxT, live, n=engine_chain(cfg.model, ro.tokens_BxS.shape[1]),
                 lam=LAMBDA, scale="max")


def test_update_takes_one_step_and_skips_non_finite():
    cfg, params, ro = step_rollout()
    eng = step_engine(cfg)
    batch, _ = eng.score(params, ro, REWARDS)
    state = eng.init_state(params)
    new, metrics = eng.update(state, batch)
    assert int(new.step) == 1 and int(new.skipped) == 0
    assert all(np.isfinite(float(n)) for n, _ in metrics.values())
    assert float(jnp.abs(new.params["embed"] - params["embed"]).max()) > 0
    # A NaN advantage makes the loss non-finite: nothing may change but the counters.
    bad = batch._replace(advantages_B=batch.advantages_B.at[0].set(jnp.nan))
    before = jax.tree.map(np.asarray, new.params)
    newer, m = eng.update(new, bad)
    assert int(newer.step) == 2 and int(newer.skipped) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, newer.params), before)
    assert float(m["skipped_updates"][0]) == 1.0


def test_update_ascends_the_advantage_weighted_log_likelihood():
    """The whole chain (forward, fused log-prob VJP, loss, optimizer) points uphill: a small
    step raises Σ_b Â_b Σ_t log π(y_bt) on the batch it was computed from, and lowers it
    when the advantages are negated."""
    _, params, ro = step_rollout()
    cfg = tiny_cfg(learning_rate=1e-4)
    eng = step_engine(cfg)
    batch, _ = eng.score(params, ro, REWARDS)
    lp = jax.jit(lambda p: policy_logprobs(p, batch.tokens_BxS, batch.attn_BxS, cfg.model)[0])
    objective = lambda p, adv: float(jnp.sum(adv[:, None] * lp(p) * batch.mask_BxT))
    for sign in (1.0, -1.0):
        adv = sign * batch.advantages_B
        new, _ = eng.update(eng.init_state(params), batch._replace(advantages_B=adv))
        assert objective(new.params, adv) > objective(params, adv)


# ~35 s; the sharded forward and gradient are also in tests/sharding_test.py (default).
@pytest.mark.slow
def test_sharded_update_equals_unsharded(x64):
    """Score + update on one CPU device and on a 2×2×2 mesh of CPU devices, in float64 (the
    test is about the sharded program, not float32 summation order)."""
    cfg, params, ro, model = step_rollout64()
    results = []
    for mesh in [(1, 1, 1), (2, 2, 2)]:
        # One mini-batch of 8 rows: the batch is split over all 8 devices.
        cfg = tiny_cfg(mesh=mesh, replay="r2", num_minibatches=1).replace(model=model)
        eng = step_engine(cfg, devices=cpu_devices())
        batch, _ = eng.score(params, ro, REWARDS)
        state, metrics = eng.update(eng.init_state(params), batch)
        results.append((jax.tree.map(np.asarray, state.params),
                        {k: np.asarray(v) for k, v in metrics.items()}))
        if mesh == (2, 2, 2):
            assert state.params["layers"]["w_gate"].sharding.spec[1] == "expert"
            assert batch.replay_BxTxLxK.sharding.spec[0] == ("data", "fsdp", "expert")
    tokens = int(np.asarray(batch.attn_BxS).sum())
    n = backward_chain(cfg.model, batch.tokens_BxS.shape[1], tokens) + 16  # + AdamW
    assert_same_update(*results, cfg=cfg, n=n, tokens=tokens)


def test_mesh_larger_than_devices_is_a_clear_error():
    with pytest.raises(ValueError, match="mesh="):
        cfg = tiny_cfg(prompts_per_step=8, num_minibatches=1, eval_problems=16)
        step_engine(cfg.replace(mesh=(1, 1, 16), sft=SFTConfig(steps=2, batch_size=16)),
                devices=cpu_devices())


def test_an_update_whose_result_is_not_finite_is_skipped_sft_too():
    """A finite loss and gradient can still give non-finite parameters (a learning rate
    that overflows float32): the guard checks the new params and optimizer state, for the
    SFT update as for the RL one."""
    cfg, params, _ = step_rollout()
    optim = cfg.sft.optim.replace(schedule="constant", warmup_frac=0.0)
    # The config refuses an lr that is inf in float32 (config/checks.py); set past it to
    # test the step's own guard.
    object.__setattr__(optim, "learning_rate", 1e39)
    eng = step_engine(cfg, optim=optim, total_steps=1)
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (8, 12), 4, 60), np.int32)
    batch = SFTBatch(tokens, np.ones((8, 12), bool), np.ones((8, 11), np.float32))
    state, metrics = eng.sft_update(eng.init_state(params), batch)
    assert int(state.skipped) == 1 and float(metrics["skipped_updates"][0]) == 1.0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params),
                 jax.tree.map(np.asarray, params))


def test_consecutive_skips_stop_the_run():
    assert count_skips(0, [True, False, True], 2, "rl") == 1  # a success resets the count
    with pytest.raises(FloatingPointError, match="rl.optim.learning_rate"):
        count_skips(1, [True, True], 3, "rl")


def test_used_window_covers_used_slots_in_bucket_multiples():
    from stablerl_jax.sampling.rollout import used_window
    used = np.zeros(24, bool)
    used[9:] = True
    assert used_window(used, 1) == (9, 24)
    assert used_window(used, 8) == (8, 24)    # widened to the left
    used = np.zeros(24, bool)
    used[3:12] = True
    assert used_window(used, 8) == (0, 16)    # widened right once the left edge is hit
    assert used_window(used, 64) == (0, 24)   # never wider than the rollout
    assert used_window(np.zeros(5, bool), 8) == (0, 5)


def test_trimmed_rollout_scores_and_updates_like_the_padded_one(x64):
    """A rollout with 6 all-padding slots on each side (a longer prompt budget and a
    completion budget no row reached) trims back to its used slots, and score + update on
    it equal those on the padded rollout (float64: only summation order differs)."""
    cfg, params, ro, _ = step_rollout64()
    fill = {"tokens_BxS": PAD_ID, "prompt_mask_BxS": False, "completion_mask_BxS": False,
            "logp_mu_BxS": 0.0, "routes_mu_BxSxLxK": -1, "route_weights_mu_BxSxLxK": 0.0}
    pad = lambda x, v: jnp.concatenate([jnp.full((x.shape[0], 6, *x.shape[2:]), v, x.dtype),
                                        x, jnp.full((x.shape[0], 6, *x.shape[2:]), v, x.dtype)],
                                       axis=1)
    wide = ro._replace(**{k: pad(getattr(ro, k), v) for k, v in fill.items()})
    model = cfg.model.replace(param_dtype="float64", compute_dtype="float64",
                              max_seq_len=cfg.model.max_seq_len + 12)
    cfg = tiny_cfg(replay="r2", num_minibatches=1).replace(model=model)
    eng = step_engine(cfg)
    trimmed = eng.trim(wide, 1)
    s = ro.tokens_BxS.shape[1]
    np.testing.assert_array_equal(trimmed.tokens_BxS, ro.tokens_BxS)  # bucket 1: exact window
    assert eng.trim(wide, 8).tokens_BxS.shape[1] == -(-s // 8) * 8
    results = []
    for rollout in (wide, trimmed):
        batch, score_metrics = eng.score(params, rollout, REWARDS)
        state, metrics = eng.update(eng.init_state(params), batch)
        results.append((jax.tree.map(np.asarray, state.params),
                        {k: np.asarray(v) for k, v in {**score_metrics, **metrics}.items()},
                        np.asarray(batch.old_logp_BxT) * np.asarray(batch.mask_BxT)))
    tokens = int(np.asarray(ro.prompt_mask_BxS | ro.completion_mask_BxS).sum())
    n = backward_chain(cfg.model, s + 12, tokens) + 16  # + AdamW
    # log π_old where it is used (completions), then the update.
    assert_close(results[1][2], results[0][2][:, 6:-6], n=n, dtype="float64", scale="max")
    assert_same_update(*results, cfg=cfg, n=n, tokens=tokens)


def test_sampler_with_its_own_dense_dispatch_samples_like_the_grouped_one():
    """sampling.dispatch='dense' changes the engine's kernels, not its distribution: the
    same tokens and routes, log μ within the float32 reassociation bound."""
    cfg, params, _ = step_rollout()
    prompts = jax.random.randint(jax.random.key(1), (8, 8), 4, 60)
    mask = jnp.ones((8, 8), bool).at[:2, :3].set(False)
    out = []
    for dispatch in ("", "dense"):
        c = cfg.replace(sampling=cfg.sampling.replace(numerics="exact", dispatch=dispatch))
        out.append(step_engine(c).sample(params, jnp.where(mask, prompts, 0), mask,
                                     jax.random.key(2)))
    grouped, dense = out
    np.testing.assert_array_equal(dense.tokens_BxS, grouped.tokens_BxS)
    np.testing.assert_array_equal(dense.routes_mu_BxSxLxK, grouped.routes_mu_BxSxLxK)
    assert_close(dense.logp_mu_BxS, grouped.logp_mu_BxS, lam=LAMBDA,
                 n=engine_chain(cfg.model, grouped.tokens_BxS.shape[1]), scale="max")


@pytest.mark.parametrize("replay,microbatches",
                         [("r2", 2), pytest.param("r3", 1, marks=pytest.mark.slow)])
def test_score_in_update_equals_a_separate_score_pass(x64, replay, microbatches):
    """rl.score_in_update (one mini-batch): π_old from the update's own forward gives the
    update and every monitor of a separate score pass + update (float64: the two paths
    differ only in summation order), and the score step then runs no forward."""
    cfg, params, ro, model = step_rollout64()
    results = []
    for fused in (False, True):
        c = tiny_cfg(replay=replay, num_minibatches=1, microbatches=microbatches,
                     score_in_update=fused).replace(model=model)
        eng = step_engine(c)
        batch, score_metrics = eng.score(params, ro, REWARDS)
        assert (batch.old_logp_BxT is None) == fused and (score_metrics == {}) == fused
        state, metrics = eng.update(eng.init_state(params), batch)
        results.append((jax.tree.map(np.asarray, state.params),
                        {k: np.asarray(v) for k, v in {**score_metrics, **metrics}.items()}))
    assert set(results[0][1]) == set(results[1][1])
    s = ro.tokens_BxS.shape[1]
    tokens = int(np.asarray(ro.prompt_mask_BxS | ro.completion_mask_BxS).sum())
    assert_same_update(*results, cfg=cfg, n=backward_chain(cfg.model, s, tokens) + 16,
                        tokens=tokens)
    # The monitors see the same routing: R3 replays μ's routes, R2 routes live.
    flips = results[1][1]["routing/mismatch_rate"]
    assert (flips[0] == 0) == (replay == "r3") and flips[1] > 0


def test_score_in_update_is_ignored_with_several_minibatches():
    cfg, params, ro = step_rollout()
    batch, metrics = step_engine(tiny_cfg(num_minibatches=2, score_in_update=True)).score(
        params, ro, REWARDS)
    assert batch.old_logp_BxT is not None and "kl/train_infer_k1" in metrics


def test_runs_that_differ_only_in_loop_fields_share_their_jitted_steps():
    """Engine.create builds a step from program_config(cfg): a variant's seeds (and step
    counts, eval / checkpoint cadence) reuse one set of traced and compiled steps, while
    the router-noise seed, which the sampler does read, keeps them apart. The loop-only
    fields really are unread: steps built from two configs that differ in all of them
    trace to the same programs."""
    from stablerl_jax.rl import engine as engine_lib
    cfg = tiny_cfg()
    other = cfg.replace(name="other", rl=cfg.rl.replace(
        seed=7, steps=9, eval_every=3, checkpoint_every=3,
        keep_checkpoints=5, async_checkpoints=False, max_consecutive_skips=3,
        offline_rollouts="x.jsonl", eval_k=3, eval_problems=5, eval_sets="a:/x.jsonl",
        overlong_buffer=4, overlong_penalty_factor=0.5, log_samples=2,
        log_samples_every=3, max_sampling_rounds=2))
    assert set(engine_lib.LOOP_ONLY) <= set(type(cfg.rl).__dataclass_fields__)
    for name in presets.EXPERIMENT_PRESETS:  # valid for every preset (no cross-section check trips)
        engine_lib.program_config(presets.preset(name))
    a, b = step_engine(cfg), step_engine(other, total_steps=cfg.rl.steps * 2, optim=cfg.rl.optim)
    assert a._jitted is b._jitted and a.cfg.rl.seed == 0 and b.cfg.rl.seed == 7
    # DAPO's length penalty is added on the host: its steps are those of 'keep'.
    penalty = other.replace(rl=other.rl.replace(overlong="penalty"))
    assert step_engine(penalty, total_steps=cfg.rl.steps * 2, optim=cfg.rl.optim)._jitted is a._jitted
    noisy = lambda seed: cfg.replace(sampling=cfg.sampling.replace(router_noise_std=0.5),
                                     rl=cfg.rl.replace(seed=seed))
    assert step_engine(noisy(0))._jitted is not step_engine(noisy(1))._jitted
    _, params, ro = step_rollout()
    state = a.init_state(params)
    batch, _ = a.score(params, ro, REWARDS)
    args = {"sample": (params, ro.tokens_BxS[:, :8], ro.prompt_mask_BxS[:, :8],
                       jax.random.key(0)),
            "score": (params, ro, REWARDS), "update": (state, batch)}
    built = [engine_lib._steps(c, (EOS_ID,), PAD_ID, cfg.rl.optim, 4, 0, None)[-1]
             for c in (cfg, other)]
    for name, xs in args.items():
        first, second = (str(jax.make_jaxpr(j[name][0])(*xs)) for j in built)
        assert first == second, name



def _fields_the_steps_read(cfg) -> set:
    """The RLConfig fields that building `cfg`'s steps (engine._steps) and tracing its
    sample, score, update, SFT update, partial-rollout sample and attribution probe
    read: `cfg.rl` swapped for a subclass that records each field read while they run."""
    import dataclasses

    from stablerl_jax.config import RLConfig
    from stablerl_jax.rl import engine as engine_lib
    from stablerl_jax.rl.inflight import Inflight
    seen, on = set(), [False]

    class Recording(RLConfig):
        def __getattribute__(self, name):
            if on[0] and name in RLConfig.__dataclass_fields__:
                seen.add(name)
            return super().__getattribute__(name)

    program = engine_lib.program_config(cfg)
    program = program.replace(rl=Recording(**{f.name: getattr(program.rl, f.name)
                                              for f in dataclasses.fields(RLConfig)}))
    on[0] = True
    try:
        built = engine_lib._steps(program, (EOS_ID,), PAD_ID,
                                  *engine_lib.program_optim(program.rl.optim, 4), 0, None)
        eng = engine_lib.Engine(program, 1e-3, *built)
        for name in ("sample", "score", "update", "sft_update"):
            eng.lower(name, *eng.abstract_inputs(name))
        params, rollout, rewards = eng.abstract_inputs("score")
        batch, _ = jax.eval_shape(eng._jitted["score"][0], params, rollout, rewards)
        eng.lower("probe", params, rollout, batch)
        if cfg.rl.max_staleness:
            eng.lower("sample_partial", params, Inflight.create(cfg, PAD_ID).queue,
                      np.int32(0))
    finally:
        on[0] = False
    return seen


def test_loop_only_names_every_field_no_step_reads():
    """engine.LOOP_ONLY (the fields reset before the steps are built, so runs differing in
    them share one set of programs) holds exactly the RLConfig fields that no step reads,
    under each switch that adds a step's branch (partial rollouts, packing, the
    attribution probe, the drift monitor, score in the update). A field a step starts
    reading fails here, and so does a new field no step reads that LOOP_ONLY lacks."""
    from stablerl_jax.config import RLConfig
    from stablerl_jax.rl import engine as engine_lib
    read = set().union(*(_fields_the_steps_read(c) for c in (
        tiny_cfg(), tiny_cfg(max_staleness=1), tiny_cfg(pack_tokens=64, pack_rows=2),
        tiny_cfg(attribution=True, drift_monitor=True), tiny_cfg(score_in_update=True,
                                                                  num_minibatches=1))))
    fields = set(RLConfig.__dataclass_fields__)
    assert not read & set(engine_lib.LOOP_ONLY), sorted(read & set(engine_lib.LOOP_ONLY))
    assert fields - read == set(engine_lib.LOOP_ONLY), sorted(fields - read
                                                               ^ set(engine_lib.LOOP_ONLY))

# The default suite checks the same end to end (tests/experiments/recipe_test.py, lr 1e-6 on float32
# master weights of a bfloat16 checkpoint); this one counts the weights bf16 would lose.
@pytest.mark.slow
def test_float32_master_weights_take_an_update_that_bfloat16_rounds_away():
    """One AdamW step at lr 1e-6 moves each weight by about 1e-6: below half a bfloat16
    ulp of weights of size ~0.02 (6e-5), far above a float32 one (1e-9). float32 params
    change nearly everywhere the gradient is non-zero; bfloat16 params almost nowhere."""
    cfg, params, ro = step_rollout()
    changed = {}
    for dtype in ("float32", "bfloat16"):
        c = tiny_cfg(num_minibatches=1, learning_rate=1e-6).replace(
            model=cfg.model.replace(param_dtype=dtype))
        p = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
        eng = step_engine(c)
        batch, _ = eng.score(p, ro, REWARDS)
        state, _ = eng.update(eng.init_state(p), batch)
        leaves = zip(jax.tree.leaves(p), jax.tree.leaves(state.params))
        changed[dtype] = sum(int(np.sum(np.asarray(a) != np.asarray(b))) for a, b in leaves)
    total = sum(x.size for x in jax.tree.leaves(params))
    assert changed["float32"] > 0.5 * total, (changed, total)
    assert changed["bfloat16"] < 0.05 * total, (changed, total)

"""Token-budget packing (rl.pack_tokens, stablerl_jax/packing.py): the plan is first-fit
decreasing and whole; a token's log-prob does not depend on what is packed beside it;
score and update on packed rows equal the padded ones (float64) for every loss,
aggregation and replay mode; a packed run's metrics match the padded run's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_devices
from rl_helpers import tiny_cfg
from step_helpers import REWARDS, assert_same_update, step_engine, step_rollout64
from tolerance import assert_close, backward_chain, forward_chain

from stablerl_jax.config import AGGREGATIONS, LOSS_NAMES, ConfigError, LossConfig
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import transformer as tf
from stablerl_jax import packing


def _ffd_reference(lengths, width):
    """First-fit decreasing in plain Python: rows as lists of (index, offset)."""
    rows, fill = [], []
    for b in sorted(range(len(lengths)), key=lambda b: (-lengths[b], b)):
        n = lengths[b]
        if n == 0:
            continue
        r = next((r for r, f in enumerate(fill) if f + n <= width), None)
        if r is None:
            rows.append([]), fill.append(0)
            r = len(rows) - 1
        rows[r].append((b, fill[r]))
        fill[r] += n
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_is_first_fit_decreasing_whole_and_within_its_shard(seed):
    rng = np.random.default_rng(seed)
    b, s, width, shards = 24, 30, 40, 2
    lengths = rng.integers(0, s + 1, b)
    lengths[3] = 0  # an empty row (mesh padding) takes no slot
    start = rng.integers(0, s - lengths + 1)
    attn = (np.arange(s)[None] >= start[:, None]) & (np.arange(s)[None] < (start + lengths)[:, None])
    p = jax.tree.map(np.asarray, packing.plan(jnp.asarray(attn), width, shards))
    n = b // shards
    for d in range(shards):
        rows = _ffd_reference(list(lengths[d * n:(d + 1) * n]), width)
        assert p.rows_used_D[d] == len(rows)
        for r, members in enumerate(rows):
            for seg, (i, offset) in enumerate(members, start=1):
                g = d * n + i
                assert (p.row_B[g], p.offset_B[g], p.segment_B[g]) == (r, offset, seg)
    np.testing.assert_array_equal(p.length_B, lengths)
    np.testing.assert_array_equal(p.start_B[lengths > 0], start[lengths > 0])
    assert p.segment_B[3] == 0
    # The table holds every real slot exactly once, each in its own shard's rows.
    table = np.asarray(packing.source_table(packing.plan(jnp.asarray(attn), width, shards),
                                            shards, s, width))
    for d in range(shards):
        held = np.sort(table[d][table[d] >= 0])
        want = np.flatnonzero(attn[d * n:(d + 1) * n].reshape(-1))
        np.testing.assert_array_equal(held, want)
    # A pure function of the batch: the same plan again.
    again = packing.plan(jnp.asarray(attn), width, shards)
    for x, y in zip(again, p):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("impl", ["naive", "chunked", "causal"])
def test_a_tokens_logprob_does_not_depend_on_what_is_packed_beside_it(x64, impl):
    """Three sequences packed in one row (segments 1, 2, 3) score each token as each
    sequence scored alone does, in float64, with every attention path (the causal one
    skipping the key blocks of other segments, blocks of 4 slots)."""
    cfg = tiny_cfg().model.replace(param_dtype="float64", compute_dtype="float64",
                                   attention_impl=impl, attention_chunk=4)
    params = tf.init_params(jax.random.key(0), cfg)
    lengths = (9, 5, 11)
    seqs = [np.asarray(jax.random.randint(jax.random.key(10 + i), (n,), 4, 60))
            for i, n in enumerate(lengths)]
    alone = [policy_logprobs(params, jnp.asarray(x)[None], jnp.ones((1, len(x)), bool),
                             cfg)[0][0] for x in seqs]
    row = np.concatenate(seqs + [np.zeros(3, np.int64)])  # 3 slots of padding at the end
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(3)])
    attn = seg > 0
    logp, _, aux = policy_logprobs(params, jnp.asarray(row)[None], jnp.asarray(attn)[None],
                                   cfg, segment_ids_BxS=jnp.asarray(seg, jnp.int32)[None])
    n = forward_chain(cfg, len(row))
    at = 0
    for x, want in zip(seqs, alone):
        # The segment's own next-token positions (its last token predicts the next segment).
        assert_close(logp[0, at:at + len(x) - 1], want, n=n, dtype="float64")
        at += len(x)
    # Routes are the segment's own too (a token's hidden state is unchanged).
    own = tf.forward(params, jnp.asarray(seqs[1])[None], cfg)[1]["routes"][0]
    np.testing.assert_array_equal(aux["routes"][0, 9:14], own)


@pytest.fixture(autouse=True)
def fresh_jit_caches():
    """Each test here compiles its own packed programs: the executables earlier tests left
    in this process are dropped first (a test worker holds hundreds of them by now, and
    XLA's CPU compiler aborted while compiling a packed update in a full-suite worker)."""
    jax.clear_caches()
    yield


@pytest.fixture
def no_cache_writes():
    """The float64 packed programs are compiled without writing them to the test run's
    persistent compilation cache: jaxlib's `executable.serialize()` of a float64 packed
    update crashed the process (a segfault inside the cache write) in 2 of 3 full-suite
    runs here, never when the same tests ran alone. Nothing else changes: the programs
    are compiled and run as before."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _score_and_update(cfg, params, ro):
    eng = step_engine(cfg)
    batch, score_metrics = eng.score(params, ro, REWARDS)
    state, metrics = eng.update(eng.init_state(params), batch)
    return (jax.tree.map(np.asarray, state.params),
            {k: np.asarray(v) for k, v in {**score_metrics, **metrics}.items()},
            np.asarray(0.0 if batch.old_logp_BxT is None else batch.old_logp_BxT)
            * np.asarray(batch.mask_BxT), batch)


def _check_packed_equals_padded(loss: LossConfig, replay: str, pack_rows: int = 0,
                                attention: str = "naive", num_minibatches: int = 1,
                                score_in_update: bool = False):
    cfg0, params, ro, model = step_rollout64()
    model = model.replace(attention_impl=attention, attention_chunk=8)
    base = tiny_cfg(replay=replay, num_minibatches=num_minibatches,
                    score_in_update=score_in_update).replace(model=model, loss=loss)
    padded = _score_and_update(base, params, ro)
    packed = _score_and_update(base.replace(rl=base.rl.replace(pack_tokens=40,
                                                               pack_rows=pack_rows)),
                               params, ro)
    s = ro.tokens_BxS.shape[1]
    tokens = int(np.asarray(ro.prompt_mask_BxS | ro.completion_mask_BxS).sum())
    n = backward_chain(model, s, tokens) + 16  # + AdamW
    assert_close(packed[2], padded[2], n=n, dtype="float64", scale="max")
    if replay != "none":  # the replay the updates use: R2's recorded routes, R3's μ routes
        np.testing.assert_array_equal(packed[3].replay_BxTxLxK, padded[3].replay_BxTxLxK)
    assert_same_update(padded[:2], packed[:2], cfg=base, n=n, tokens=tokens)


# pack_rows=1: the 8 sequences in several micro-batches (each loss sees the micro-batch
# view of the padded frame). MiniRL (response sums) with R2 on the causal path (the key
# blocks of other segments skipped) and two mini-batches; GSPO (sequence-level ratio)
# with R3; CISPO (token mean) without replay, π_old and the rollout's monitors taken in
# the one update (rl.score_in_update). The slow test runs the whole matrix.
_DEFAULT = [(LossConfig(), "r2", "causal", 2), (LossConfig(name="gspo"), "r3", "naive", 1),
            (LossConfig(name="cispo"), "none", "chunked", 1)]


@pytest.mark.parametrize("loss,replay,attention,minibatches", _DEFAULT,
                         ids=[f"{l.name}-{r}-{a}" for l, r, a, _ in _DEFAULT])
def test_packed_score_and_update_equal_the_padded_ones(x64, no_cache_writes, loss, replay,
                                                       attention, minibatches):
    _check_packed_equals_padded(loss, replay, pack_rows=1, attention=attention,
                                num_minibatches=minibatches,
                                score_in_update=loss.name == "cispo")


@pytest.mark.slow
@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_every_loss_aggregation_and_replay_packed_equals_padded(x64, no_cache_writes, name,
                                                                agg, replay):
    _check_packed_equals_padded(LossConfig(name=name, aggregation=agg), replay, pack_rows=1)


@pytest.mark.slow
def test_sharded_packed_update_equals_unsharded(x64, no_cache_writes):
    """A 2×2×2 mesh: each of the 8 batch shards packs its own row(s)."""
    cfg, params, ro, model = step_rollout64()
    results = []
    for mesh in [(1, 1, 1), (2, 2, 2)]:
        c = tiny_cfg(mesh=mesh, replay="r3", num_minibatches=1, pack_tokens=40).replace(
            model=model)
        eng = step_engine(c, devices=cpu_devices())
        batch, _ = eng.score(params, ro, REWARDS)
        state, metrics = eng.update(eng.init_state(params), batch)
        results.append((jax.tree.map(np.asarray, state.params),
                        {k: np.asarray(v) for k, v in metrics.items()}))
    tokens = int(np.asarray(batch.attn_BxS).sum())
    n = backward_chain(c.model, batch.tokens_BxS.shape[1], tokens) + 16
    assert_same_update(*results, cfg=c, n=n, tokens=tokens)


def test_pack_settings_are_checked():
    with pytest.raises(ConfigError, match="rl.pack_tokens.*longest possible sequence"):
        tiny_cfg(pack_tokens=20)  # 16 prompt + 16 new tokens do not fit
    with pytest.raises(ConfigError, match="microbatches"):
        tiny_cfg(pack_tokens=40, microbatches=2, num_minibatches=1)
    with pytest.raises(ConfigError, match="pack_rows"):
        tiny_cfg(pack_rows=2)
    with pytest.raises(ConfigError, match="pack_rows"):
        tiny_cfg(mesh=(2, 1, 1), pack_tokens=40, pack_rows=3)
    with pytest.raises(ConfigError, match="pack_tokens"):
        tiny_cfg(pack_tokens=-1)


@pytest.mark.integration
def test_a_packed_run_matches_the_padded_run(tmp_path):
    """Three global steps of the tiny run (float32), padded and packed into rows of 40
    tokens (and the packed run stopped after step 2 and resumed: the same run, exactly):
    the same samples (so the same rewards, lengths and eval scores, exactly), and
    every other metric within the float32 rounding of the two programs: relative error
    `rel` = tolerance.py's probabilistic bound for a forward and backward chain per step,
    of the metric or of its terms (token means of log-probs, at most log V in size, so
    rel · log V absolutely); a `*_std` (√(sqmean − mean²), which cancels) compared as its
    variance, whose terms (IS weights ≈ 1, log-ratios ≪ 1) are at most 1."""
    from tolerance import LAMBDA, bound

    from stablerl_jax.rl import loop
    from stablerl_jax.runs.metrics_io import outcome, read_metrics
    cfg = tiny_cfg(steps=3, eval_every=3, checkpoint_every=2, replay="r3")
    runs = {}
    for pack in (0, 40):
        c = cfg.replace(rl=cfg.rl.replace(pack_tokens=pack))
        loop.run(c, str(tmp_path / str(pack)), progress=False)
        runs[pack] = outcome(read_metrics(str(tmp_path / str(pack))))
    # A packed run stopped after step 2 and resumed packs and trains as the whole run.
    c = cfg.replace(rl=cfg.rl.replace(pack_tokens=40))
    loop.run(c.replace(rl=c.rl.replace(steps=2)), str(tmp_path / "part"), progress=False)
    loop.run(c, str(tmp_path / "part"), progress=False)
    # (The stopped run evaluated at its last step, 2; the whole run did not.)
    no_eval = lambda rows: [{k: v for k, v in r.items() if not k.startswith("eval/")}
                            for r in rows]
    assert no_eval(outcome(read_metrics(str(tmp_path / "part")))) == no_eval(runs[40])
    slots = cfg.task.max_prompt_len + cfg.sampling.max_new_tokens
    rel = bound(cfg.rl.steps * backward_chain(cfg.model, slots, 8 * slots), "float32",
                lam=LAMBDA)
    exact = ("reward", "eval/", "response/", "step", "time", "async/")
    for padded, packed in zip(runs[0], runs[40], strict=True):
        assert padded.keys() == packed.keys()
        for k, v in padded.items():
            if v is None or k.startswith("time") or "seconds" in k or "per_s" in k:
                continue
            if k.startswith(exact):
                assert packed[k] == v, k
            elif k.endswith("_std"):
                np.testing.assert_allclose(packed[k] ** 2, v ** 2, rtol=0, atol=2 * rel,
                                           err_msg=k)
            else:
                np.testing.assert_allclose(packed[k], v, rtol=rel,
                                           atol=rel * np.log(cfg.model.vocab_size), err_msg=k)

"""Score / update steps: R2 on-policy is a no-op, non-finite updates are skipped, and a
sharded update equals the unsharded one."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_devices
from rl_helpers import tiny_cfg
from tolerance import assert_close, backward_chain

from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import steps
from stablerl_jax.rl.engine import Engine


@functools.lru_cache(maxsize=None)
def _batch(seed=0):
    cfg = tiny_cfg()
    params = tf.init_params(jax.random.key(seed), cfg.model)
    b, p = 8, 8
    prompts = jax.random.randint(jax.random.key(1), (b, p), 4, 60)
    mask = jnp.ones((b, p), bool).at[:2, :3].set(False)
    ro = Engine.create(cfg).sample(params, jnp.where(mask, prompts, 0), mask, jax.random.key(2))
    adv = jnp.array([1.0, -1, 0.5, -0.5, 1, -1, 0.25, -0.25])
    return cfg, params, steps.train_batch(ro, adv)


def test_r2_on_policy_first_minibatch_is_bit_identical_to_no_replay():
    cfg, params, batch = _batch()
    score = jax.jit(functools.partial(steps.score, cfg=cfg.model, replay="r2", temperature=1.0,
                                      impl="chunked"))
    scored = score(params, batch)
    lp = jax.jit(steps.policy_logprobs, static_argnames=("cfg", "temperature", "impl"))
    live, _, _ = lp(params, batch, cfg=cfg.model)
    replayed, _, _ = lp(params, batch, cfg=cfg.model,
                        replay_LxBxTxK=scored["routes_old_LxBxTxK"])
    np.testing.assert_array_equal(replayed, live)
    np.testing.assert_array_equal(scored["old_logp_BxT"], live)


def test_update_takes_one_step_and_skips_non_finite():
    cfg, params, batch = _batch()
    eng = Engine.create(cfg)
    batch = dict(batch, **eng.score(params, batch))
    state = eng.init_state(params)
    new, metrics = eng.update(state, batch)
    assert int(new.step) == 1 and int(new.skipped) == 0
    assert all(np.isfinite(float(n)) for n, _ in metrics.values())
    assert float(jnp.abs(new.params["embed"] - params["embed"]).max()) > 0
    # A NaN advantage makes the loss non-finite: nothing may change but the counters.
    bad = dict(batch, advantages_B=batch["advantages_B"].at[0].set(jnp.nan))
    before = jax.tree.map(np.asarray, new.params)
    newer, m = eng.update(new, bad)
    assert int(newer.step) == 2 and int(newer.skipped) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, newer.params), before)
    assert float(m["skipped_updates"][0]) == 1.0


def test_update_ascends_the_advantage_weighted_log_likelihood():
    """The whole chain (forward, fused log-prob VJP, loss, optimizer) points uphill: a small
    step raises Σ_b Â_b Σ_t log π(y_bt) on the batch it was computed from, and lowers it
    when the advantages are negated."""
    _, params, batch = _batch()
    cfg = tiny_cfg(learning_rate=1e-4)
    eng = Engine.create(cfg)
    batch = dict(batch, **eng.score(params, batch))
    lp = jax.jit(lambda p: steps.policy_logprobs(p, batch, cfg.model)[0])
    objective = lambda p, adv: float(jnp.sum(adv[:, None] * lp(p) * batch["mask_BxT"]))
    for sign in (1.0, -1.0):
        adv = sign * batch["advantages_B"]
        new, _ = eng.update(eng.init_state(params), dict(batch, advantages_B=adv))
        assert objective(new.params, adv) > objective(params, adv)


def test_sharded_update_equals_unsharded(x64):
    """Score + update on one CPU device and on a 2×2×2 mesh of CPU devices, in float64 (the
    test is about the sharded program, not float32 summation order)."""
    cfg, params, batch = _batch()
    f64 = lambda t: jax.tree.map(
        lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, t)
    params, batch = f64(params), f64(batch)
    model = cfg.model.replace(param_dtype="float64", compute_dtype="float64")
    results = []
    for mesh in [(1, 1, 1), (2, 2, 2)]:
        cfg = dataclasses.replace(tiny_cfg(mesh=mesh), model=model)
        eng = Engine.create(cfg, devices=cpu_devices())
        b = dict(batch, **eng.score(params, batch))
        state, metrics = eng.update(eng.init_state(params), b)
        results.append((jax.tree.map(np.asarray, state.params),
                        {k: np.asarray(v) for k, v in metrics.items()}))
        if mesh == (2, 2, 2):
            assert state.params["layers"]["w_gate"].sharding.spec[1] == "expert"
    (p0, m0), (p1, m1) = results
    tokens = int(np.asarray(batch["attn_BxT"]).sum())
    n = backward_chain(cfg.model, batch["inputs_BxT"].shape[1], tokens) + 16  # + AdamW
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):
        assert_close(a, b, n=n, dtype="float64", cond=tokens, scale="max")
    # Every metric numerator sums at most `den` per-token terms, each at most
    # max_log_ratio² in size (the largest: a squared clipped log-ratio).
    term = cfg.loss.max_log_ratio ** 2
    for k in m0:
        for i in range(2):
            assert_close(m1[k][i], m0[k][i], n=n, dtype="float64",
                         scale=term * max(float(m0[k][1]), 1.0), err_msg=k)


def test_mesh_larger_than_devices_is_a_clear_error():
    with pytest.raises(ValueError, match="rl.mesh"):
        Engine.create(tiny_cfg(mesh=(1, 1, 16)))

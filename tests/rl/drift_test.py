"""The drift monitor and score centering through the Engine's score and update steps
(rl.drift_monitor, loss.center; stablerl_jax/method/centering.py): at the `bitwise`
sampler with one mini-batch the drift and each of its parts is exactly 0 and the centred
update is MiniRL's; with FP8 weights each source lands in its own part, exactly 0 where
that source is off (R3: routing; one mini-batch: staleness)."""
import jax
import jax.numpy as jnp
import numpy as np
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg
from tolerance import bound

from stablerl_jax.config import SamplingConfig
from stablerl_jax.method.diagnostics import reduce_metrics
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl.engine import Engine

REWARDS = np.array([1, 0, 0, 1, 1, 0, 0, 0], np.float32)
PARTS = ("precision", "routing", "staleness")
V = tiny_cfg().model.vocab_size


def _step(numerics: str, minibatches: int = 1, center: str = "none", **rl):
    """One global step of the tiny model with the drift monitor and attribution on:
    (reduced score and update metrics, the params after the step)."""
    cfg = tiny_cfg(num_minibatches=minibatches, attribution=True, attribution_every=0,
                   drift_monitor=True, **rl)
    cfg = cfg.replace(sampling=SamplingConfig(max_new_tokens=16, numerics=numerics),
                      loss=cfg.loss.replace(center=center),
                      model=cfg.model.replace(batch_invariant=numerics == "bitwise"))
    params = tf.init_params(jax.random.key(0), cfg.model.replace(init_std=0.1))
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    prompts = jax.random.randint(jax.random.key(1), (8, 8), 4, 60)
    ro = eng.sample(params, prompts, jnp.ones((8, 8), bool), jax.random.key(2))
    batch, score = eng.score(params, ro, REWARDS)
    state = eng.init_state(params)
    updates = []
    for rows in np.arange(8).reshape(minibatches, -1):
        state, m = eng.update(state, eng.select(batch, rows))
        updates.append(jax.tree.map(np.asarray, m))
    assert int(state.skipped) == 0
    metrics = {**reduce_metrics([jax.tree.map(np.asarray, score)]), **reduce_metrics(updates)}
    return metrics, jax.tree.map(np.asarray, state.params)


def test_at_zero_mismatch_the_drift_is_zero_and_centring_is_an_exact_no_op():
    plain, p_plain = _step("bitwise")
    centred, p_centred = _step("bitwise", center="exact")
    # μ = π_old = π_θ bit for bit: q − π is formed as π·expm1(log q − log π), exactly 0.
    for m in (plain, centred):
        assert m["drift/l1"] == m["drift/reward_weighted"] == 0.0
        assert all(m[f"attr/drift_{p}_l1"] == 0.0 for p in PARTS)
    assert centred["center/drift_l1"] == 0.0
    # The correction adds exact zeros to the logits' cotangent: the same update.
    for a, b in zip(jax.tree.leaves(p_centred), jax.tree.leaves(p_plain)):
        np.testing.assert_array_equal(a, b)


def test_with_fp8_weights_each_source_lands_in_its_own_part_and_only_there():
    m, _ = _step("fp8", minibatches=2, center="exact")
    assert all(m[f"attr/drift_{p}_l1"] > 0 for p in PARTS)
    assert m["drift/l1"] > 0 and m["center/drift_l1"] > 0
    # ‖q − π_old‖₁ is at most the sum of its parts' norms (triangle inequality), and the
    # group-mean reward is in [0, 1]; each side is a float32 sum over V entries of
    # expm1-formed differences, then a token mean (V + 4 roundings).
    slack = 1 + bound(V + 4)
    parts = m["attr/drift_precision_l1"] + m["attr/drift_routing_l1"]
    assert m["drift/l1"] <= parts * slack
    assert 0 < m["drift/reward_weighted"] <= m["drift/l1"] * slack
    # A source switched off leaves its part exactly 0.
    r3, _ = _step("fp8", minibatches=1, replay="r3")
    assert r3["attr/drift_precision_l1"] > 0
    assert r3["attr/drift_routing_l1"] == 0.0  # π_old replays the sampler's routes
    assert r3["attr/drift_staleness_l1"] == 0.0  # the one update runs at θ_old

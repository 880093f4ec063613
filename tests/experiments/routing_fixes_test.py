"""The routing fixes the field uses, each on its own: the router's precision per engine
(model.router_dtype, sampling.router_dtype), a frozen router (rl.freeze_router),
replay of the indices alone (R3 without rl.replay_weights), and the expert-load monitors
(moe/…) that say how unevenly each engine uses its experts."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg

from stablerl_jax.config import ConfigError, ExperimentConfig, apply_overrides
from stablerl_jax.method import diagnostics as dg
from stablerl_jax.method.mismatch import measure_mismatch
from stablerl_jax.model import moe
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl.engine import Engine, router_leaves
from stablerl_jax.sampling import rollout as ro


@pytest.mark.integration
def test_the_samplers_router_dtype_changes_only_the_routers_arithmetic():
    """From zero mismatch (the `bitwise` sampler, both routers float32), a bfloat16
    sampler router is the only difference left: it flips experts against the trainer and
    moves log μ, and sampling.router_dtype=float32 (or '': the model's) flips none.
    (Under the `fp8` preset the FP8 weights' error in the hidden states dominates the
    flips, and the router's precision moves them within noise: docs/records/results.md.)"""
    model = dataclasses.replace(tiny_cfg().model, init_std=0.3, compute_dtype="bfloat16",
                                batch_invariant=True, router_dtype="float32")
    params = tf.init_params(jax.random.key(0), model)
    prompts = jax.random.randint(jax.random.key(1), (32, 12), 4, model.vocab_size)
    mask = jnp.ones((32, 12), bool)
    found = {}
    for router in ("", "float32", "bfloat16"):
        sampling = dataclasses.replace(tiny_cfg().sampling, numerics="bitwise",
                                       router_dtype=router, max_new_tokens=16)
        r = ro.sample(params, prompts, mask, jax.random.key(2), model, sampling,
                      nx.of_sampling(sampling, 0), eos_id=EOS_ID, pad_id=PAD_ID)
        m = measure_mismatch(params, r, model)
        found[router] = (m["routing_mismatch"], m["abs_logp_gap_max"])
    assert found[""] == found["float32"] == (0.0, 0.0)
    assert found["bfloat16"][0] > 0 and found["bfloat16"][1] > 0, found


@pytest.mark.integration
def test_the_trainers_router_dtype_is_its_arithmetic():
    """model.router_dtype sets the trainer's router operands: bfloat16 ones change the
    router's logits (and with them the gate weights), nothing else of the forward."""
    model = dataclasses.replace(tiny_cfg().model, init_std=0.3)
    params = tf.init_params(jax.random.key(0), model)
    tokens = jax.random.randint(jax.random.key(1), (4, 10), 4, model.vocab_size)
    _, full = tf.forward(params, tokens, model)
    _, low = tf.forward(params, tokens, dataclasses.replace(model, router_dtype="bfloat16"))
    _, same = tf.forward(params, tokens, dataclasses.replace(model, router_dtype="float32"))
    assert np.array_equal(np.asarray(same["route_weights"]), np.asarray(full["route_weights"]))
    assert not np.array_equal(np.asarray(low["route_weights"]),
                              np.asarray(full["route_weights"]))


@pytest.mark.integration
def test_a_frozen_router_keeps_its_weights_and_optimizer_state_bit_for_bit():
    cfg = tiny_cfg(freeze_router=True, learning_rate=1e-2)
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    params = tf.init_params(jax.random.key(0), cfg.model)
    state = eng.init_state(params)
    before = jax.tree.map(np.asarray, state)
    prompts = jax.random.randint(jax.random.key(1), (8, 8), 4, 60)
    r = eng.sample(state.params, prompts, jnp.ones((8, 8), bool), jax.random.key(2))
    batch, _ = eng.score(state.params, r, np.array([1, 0, 0, 1, 1, 0, 0, 0], np.float32))
    for rows in np.arange(8).reshape(2, -1):
        state, _ = eng.update(state, eng.select(batch, rows))
    assert int(state.step) == 2 and int(state.skipped) == 0
    after = jax.tree.map(np.asarray, state)
    frozen = router_leaves(before.params)
    for path_frozen, a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(before.params),
                                 jax.tree.leaves(after.params)):
        assert np.array_equal(a, b) == path_frozen  # the router alone is unchanged
    # Its Adam moments never left 0; every other weight's did.
    moved = []
    for leaf_b, leaf_a in zip(jax.tree_util.tree_leaves_with_path(before.opt_state),
                              jax.tree.leaves(after.opt_state)):
        path, b = leaf_b
        if any(getattr(k, "key", None) == "router" for k in path):
            assert np.array_equal(b, leaf_a) and not np.any(leaf_a), jax.tree_util.keystr(path)
        elif np.ndim(b) >= 2:
            moved.append(not np.array_equal(b, leaf_a))
    assert moved and all(moved)


def test_indices_only_replay_takes_the_live_routers_weights():
    """R3 without rl.replay_weights (what the peers replay): the replayed experts, with
    the live softmax's probabilities on them, renormalized."""
    logits = jax.random.normal(jax.random.key(0), (6, 8)) * 2
    replay = jnp.array([[0, 1], [7, 3], [2, 5], [4, 6], [1, 0], [-1, -1]], jnp.int32)
    idx, w, probs = moe.route(logits, 2, replay)
    p = np.asarray(jax.nn.softmax(logits, axis=-1))
    want_idx = np.where(np.asarray(replay) >= 0, np.asarray(replay),
                        np.argsort(-p, axis=1)[:, :2])
    assert np.array_equal(np.asarray(idx), want_idx)
    picked = np.take_along_axis(np.asarray(probs), want_idx, axis=1)
    # (XLA may divide by multiplying with the reciprocal: two roundings, at most 2 ulps.)
    np.testing.assert_allclose(np.asarray(w), picked / picked.sum(axis=1, keepdims=True),
                               rtol=2 * np.finfo(np.float32).eps, atol=0)


def test_expert_load_monitors_by_hand():
    """Two layers, E = 4, K = 1: layer 0 sends 6 of 8 tokens to expert 2 and one each to
    0 and 1; layer 1 is uniform. Unrouted tokens (-1, or outside the mask) count nowhere."""
    l0 = [2, 2, 2, 0, 2, 1, 2, 2]
    l1 = [0, 1, 2, 3, 0, 1, 2, 3]
    routes = np.full((1, 10, 2, 1), -1, np.int32)
    routes[0, :8, 0, 0], routes[0, :8, 1, 0] = l0, l1
    routes[0, 8] = 3  # routed, but outside the mask
    routed = np.zeros((1, 10), bool)
    routed[0, :8] = True
    pairs = dg.expert_load_pairs(jnp.asarray(routes), jnp.asarray(routed), 4, "sampler")
    out = dg.reduce_metrics([jax.tree.map(np.asarray, pairs)])
    share0 = np.array([1, 1, 6, 0]) / 8
    layers = lambda name: [out[f"moe/sampler/{name}_l{i}"] for i in range(2)]
    assert layers("max_vio") == [4 * 6 / 8 - 1, 0.0]
    ent0 = -sum(s * np.log(s) for s in share0 if s) / np.log(4)
    # (float64 logs of shares that are exact in binary: a few ulps.)
    np.testing.assert_allclose(layers("entropy"), [ent0, 1.0], rtol=8 * np.finfo(float).eps)
    assert layers("top10_share") == [6 / 8, 2 / 8]
    assert all(isinstance(v, float) for k, v in out.items() if k.startswith("moe/"))
    assert out["moe/sampler/max_vio"] == (2.0 + 0.0) / 2 and out["moe/sampler/max_vio_max"] == 2
    assert "moe/sampler/load" not in out


def test_routing_settings_are_checked():
    for bad, field in [(["rl.freeze_router=true", "model.router_aux_loss_weight=0.01"],
                        "rl.freeze_router"),
                       (["model.router_dtype=float8"], "router_dtype"),
                       (["sampling.router_dtype=int32"], "router_dtype")]:
        with pytest.raises(ConfigError, match=field) as e:
            apply_overrides(ExperimentConfig(), bad)
        assert "\n" not in str(e.value)
    if not jax.config.jax_enable_x64:
        cfg = apply_overrides(tiny_cfg(), ["model.router_dtype=float64"])
        with pytest.raises(ValueError, match="model.router_dtype: 'float64' needs 64-bit JAX"):
            Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)


def test_expert_load_counts_equal_a_one_hot_count():
    """The scatter-add count against the plain one-hot count on random routes, -1 rows
    and a mask: equal (counts of whole numbers, exact in float32)."""
    rng = np.random.default_rng(0)
    routes = rng.integers(-1, 8, (3, 11, 4, 2)).astype(np.int32)
    routes[routes[..., :1].repeat(2, -1) < 0] = -1
    routed = rng.random((3, 11)) < 0.7
    num, den = dg.expert_load_pairs(jnp.asarray(routes), jnp.asarray(routed), 8, "x")["moe/x/load"]
    use = (routes >= 0) & routed[:, :, None, None]
    want = ((routes[..., None] == np.arange(8)) & use[..., None]).sum(axis=(0, 1, 3))
    assert np.array_equal(np.asarray(num), want.astype(np.float32))
    assert np.array_equal(np.asarray(den), np.broadcast_to(use.sum(axis=(0, 1, 3))[:, None],
                                                           (4, 8)).astype(np.float32))

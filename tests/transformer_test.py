"""Model invariants: replay, causality, padding, remat, KV cache, dispatch paths."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablerl_jax.config import ModelConfig
from stablerl_jax.model import transformer as tf

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_experts=8, top_k=2, expert_ffn_dim=32, max_seq_len=32,
                  moe_tile=8)
B, T = 3, 12


@functools.lru_cache(maxsize=None)
def _setup(seed=0):
    params = tf.init_params(jax.random.key(seed), CFG)
    tokens = jax.random.randint(jax.random.key(seed + 1), (B, T), 0, CFG.vocab_size)
    mask = jnp.ones((B, T), bool).at[0, :4].set(False).at[1, :1].set(False)
    return params, tokens, mask


def _probe(h_BxTxD, mask_BxT):
    """A random linear read-out of the real positions. (Σ h² would be a poor probe: h is
    RMS-normalized, so Σ h² is nearly constant and its gradient is cancellation noise.)"""
    w = jax.random.normal(jax.random.key(42), h_BxTxD.shape)
    return jnp.sum(jnp.where(mask_BxT[..., None], h_BxTxD * w, 0))


def _fwd(cfg=CFG, **kw):
    return jax.jit(functools.partial(tf.forward, cfg=cfg, **kw))


def test_shapes_and_aux():
    params, tokens, mask = _setup()
    h, aux = _fwd()(params, tokens, attention_mask_BxT=mask)
    assert h.shape == (B, T, CFG.d_model)
    assert aux["routes"].shape == (CFG.num_layers, B, T, CFG.top_k)
    assert aux["routes"].dtype == jnp.int32
    np.testing.assert_allclose(aux["expert_load"].sum(-1), 1.0, rtol=1e-6)
    assert float(aux["router_loss"]) == 0.0  # default weights are 0
    logical = tf.param_logical_axes(CFG)
    jax.tree.map(lambda ax, a: None if len(ax) == a.ndim else pytest.fail(f"{ax} vs {a.shape}"),
                 logical, params, is_leaf=lambda x: isinstance(x, tuple))


def test_router_loss_weights_apply():
    params, tokens, mask = _setup()
    cfg = CFG.replace(router_z_loss_weight=0.1, router_aux_loss_weight=0.01)
    _, aux = _fwd(cfg)(params, tokens, attention_mask_BxT=mask)
    want = 0.1 * aux["router_z_loss"].mean() + 0.01 * aux["load_balance_loss"].mean()
    np.testing.assert_allclose(aux["router_loss"], want, rtol=1e-6)


def test_replaying_own_routes_is_bit_identical_and_other_routes_differ():
    params, tokens, mask = _setup()
    h, aux = _fwd()(params, tokens, attention_mask_BxT=mask)
    h_replay, aux_r = _fwd()(params, tokens, attention_mask_BxT=mask,
                             replay_LxBxTxK=aux["routes"])
    np.testing.assert_array_equal(h_replay, h)
    np.testing.assert_array_equal(aux_r["routes"], aux["routes"])
    shifted = (aux["routes"] + 1) % CFG.num_experts  # still K distinct experts per token
    h_other, aux_o = _fwd()(params, tokens, attention_mask_BxT=mask, replay_LxBxTxK=shifted)
    np.testing.assert_array_equal(aux_o["routes"], shifted)
    assert float(jnp.abs(h_other - h).max()) > 1e-3
    # -1 rows route normally: replaying all -1 is the same as no replay.
    h_none, _ = _fwd()(params, tokens, attention_mask_BxT=mask,
                       replay_LxBxTxK=jnp.full_like(aux["routes"], -1))
    np.testing.assert_array_equal(h_none, h)


def test_causality_gradient_from_future_tokens_is_exactly_zero():
    params, _, _ = _setup()
    # Position t's output may depend on tokens ≤ t only. Tokens after t are ids that never
    # occur at or before t, so the gradient w.r.t. their embedding rows must be exactly 0.
    t = 5
    past = jnp.arange(T)[None, : t + 1] % 20
    future = 20 + jnp.arange(T - t - 1)[None]
    tokens = jnp.concatenate([past, future], axis=1)
    g = jax.grad(lambda p: jnp.sum(tf.forward(p, tokens, CFG)[0][:, t] ** 2))(params)
    assert float(jnp.abs(g["embed"][20:20 + T - t - 1]).max()) == 0.0
    assert float(jnp.abs(g["embed"][:t + 1]).max()) > 0.0


def test_padding_never_influences_real_positions():
    params, tokens, mask = _setup()
    h, _ = _fwd()(params, tokens, attention_mask_BxT=mask)
    junk = jnp.where(mask, tokens, (tokens * 7 + 3) % CFG.vocab_size)
    h_junk, _ = _fwd()(params, junk, attention_mask_BxT=mask)
    np.testing.assert_array_equal(jnp.where(mask[..., None], h_junk, 0),
                                  jnp.where(mask[..., None], h, 0))
    # A row with 4 left-pad slots equals the same real tokens without padding.
    alone, _ = _fwd()(params, tokens[:1, 4:])
    np.testing.assert_allclose(h[0, 4:], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_replay", [False, True])
def test_remat_equal_values_and_gradients(with_replay):
    params, tokens, mask = _setup()
    replay = None
    if with_replay:
        replay = (_fwd()(params, tokens, attention_mask_BxT=mask)[1]["routes"] + 3) % 8

    def loss(p, cfg):
        h, aux = tf.forward(p, tokens, cfg, attention_mask_BxT=mask, replay_LxBxTxK=replay)
        return _probe(h, mask) + aux["router_z_loss"].sum()

    v0, g0 = jax.jit(jax.value_and_grad(functools.partial(loss, cfg=CFG)))(params)
    v1, g1 = jax.jit(jax.value_and_grad(functools.partial(loss, cfg=CFG.replace(remat=True))))(
        params)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_dense_and_grouped_models_agree():
    params, tokens, mask = _setup()

    def loss(p, cfg):
        h, _ = tf.forward(p, tokens, cfg, attention_mask_BxT=mask)
        return _probe(h, mask)

    v0, g0 = jax.jit(jax.value_and_grad(functools.partial(loss, cfg=CFG)))(params)
    dense = CFG.replace(dispatch="dense")
    v1, g1 = jax.jit(jax.value_and_grad(functools.partial(loss, cfg=dense)))(params)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


def test_kv_cache_prefill_then_decode_equals_full_forward():
    params, tokens, mask = _setup()
    h_full, aux_full = _fwd()(params, tokens, attention_mask_BxT=mask)
    cache = tf.init_cache(CFG, B, T)
    step = jax.jit(lambda p, t, m, c: tf.forward(p, t, CFG, attention_mask_BxT=m, cache=c))
    h, aux = step(params, tokens[:, :7], mask[:, :7], cache)
    hs, routes = [h], [aux["routes"]]
    for i in range(7, T):
        h, aux = step(params, tokens[:, i:i + 1], mask[:, i:i + 1], aux["cache"])
        hs.append(h)
        routes.append(aux["routes"])
    m = mask[..., None]
    np.testing.assert_allclose(jnp.where(m, jnp.concatenate(hs, 1), 0),
                               jnp.where(m, h_full, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(jnp.where(mask[None, ..., None], jnp.concatenate(routes, 2), -1),
                                  jnp.where(mask[None, ..., None], aux_full["routes"], -1))
    assert int(aux["cache"]["index"]) == T


def test_logits_and_tied_embeddings():
    cfg = CFG.replace(tie_embeddings=True)
    params = tf.init_params(jax.random.key(3), cfg)
    assert "unembed" not in params
    h, _ = tf.forward(params, jnp.zeros((1, 3), jnp.int32), cfg)
    np.testing.assert_allclose(tf.logits(params, h, cfg), h @ params["embed"].T, rtol=1e-5,
                               atol=1e-6)


def test_input_errors():
    params, tokens, mask = _setup()
    with pytest.raises(ValueError, match="vocab_size=64"):
        tf.forward(params, tokens.at[0, 0].set(64), CFG)
    with pytest.raises(ValueError, match=r"integer \[B, T\]"):
        tf.forward(params, tokens.astype(jnp.float32), CFG)
    with pytest.raises(ValueError, match="attention_mask"):
        tf.forward(params, tokens, CFG, attention_mask_BxT=mask[:, :3])
    with pytest.raises(ValueError, match="replay: shape"):
        tf.forward(params, tokens, CFG, replay_LxBxTxK=jnp.zeros((1, B, T, 2), jnp.int32))
    with pytest.raises(ValueError, match="max_seq_len=32"):
        tf.init_cache(CFG, 1, 33)

"""Model invariants: replay, causality, padding, remat policies, chunked attention, KV
cache, dispatch paths and grouped-matmul implementations. The forward's shapes, replay and
causality run jitted and op by op (chex.variants).

Tests that compare two algorithms for one function (remat, dispatch paths, KV cache,
padding) run in float64 (`x64` fixture); tolerances from tests/tolerance.py."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close, backward_chain, forward_chain

from stablerl_jax.config import KV_CACHE_LAYOUTS, ModelConfig
from stablerl_jax.model import moe
from stablerl_jax.model import transformer as tf

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_experts=8, top_k=2, expert_ffn_dim=32, max_seq_len=32,
                  moe_tile=8)
CFG64 = CFG.replace(param_dtype="float64", compute_dtype="float64")
B, T = 3, 12


@functools.lru_cache(maxsize=None)
def _setup(seed=0, cfg=CFG):
    params = tf.init_params(jax.random.key(seed), cfg)
    tokens = jax.random.randint(jax.random.key(seed + 1), (B, T), 0, cfg.vocab_size)
    mask = jnp.ones((B, T), bool).at[0, :4].set(False).at[1, :1].set(False)
    return params, tokens, mask


def _probe_weights(shape):
    return jax.random.normal(jax.random.key(42), shape, jnp.float64)


def _probe(h_BxTxD, mask_BxT):
    """A random linear read-out of the real positions. (Σ h² would be a poor probe: h is
    RMS-normalized, so Σ h² is nearly constant and its gradient is cancellation noise.)"""
    w = _probe_weights(h_BxTxD.shape).astype(h_BxTxD.dtype)
    return jnp.sum(jnp.where(mask_BxT[..., None], h_BxTxD * w, 0))


def _probe_cond(h_BxTxD, mask_BxT):
    """Σ|terms| / |Σ terms| of the probe: its random signs cancel, so its value is
    compared relative to the size of its terms, not to itself."""
    terms = np.where(np.asarray(mask_BxT)[..., None],
                     np.asarray(h_BxTxD) * np.asarray(_probe_weights(h_BxTxD.shape)), 0)
    return float(np.abs(terms).sum() / abs(terms.sum()))


def _assert_values_and_grads_close(v1, g1, v0, g0, cond_v):
    """Two float64 algorithms for one loss: the value to 2γ_n·cond, each gradient leaf
    norm-wise. A weight gradient sums over the B·T tokens, which may cancel down to one
    token's term: cond ≤ B·T."""
    assert_close(v1, v0, n=forward_chain(CFG, T) + B * T * CFG.d_model, dtype="float64",
                 cond=cond_v)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert_close(a, b, n=backward_chain(CFG, T, B * T), dtype="float64", cond=B * T,
                     scale="max")


def _fwd(cfg=CFG, **kw):
    return jax.jit(functools.partial(tf.forward, cfg=cfg, **kw))


class ForwardTest(chex.TestCase):
    """The forward's shapes, replay and causality, each run jitted and op by op
    (chex.variants)."""

    def forward(self, params, tokens, **kw):
        return self.variant(functools.partial(tf.forward, cfg=CFG, **kw))(params, tokens)

    @chex.variants(with_jit=True, without_jit=True)
    def test_shapes_and_aux(self):
        params, tokens, mask = _setup()
        h, aux = self.forward(params, tokens, attention_mask_BxT=mask)
        assert h.shape == (B, T, CFG.d_model)
        assert aux["routes"].shape == (B, T, CFG.num_layers, CFG.top_k)  # batch-major
        assert aux["routes"].dtype == jnp.int32
        # Σ_e load_e: E fractions of one float32 count each (n = E + 2 roundings).
        assert_close(aux["expert_load"].sum(-1), 1.0, n=CFG.num_experts + 2)
        assert float(aux["router_loss"]) == 0.0  # default weights are 0
        logical = tf.param_logical_axes(CFG)
        jax.tree.map(
            lambda ax, a: None if len(ax) == a.ndim else pytest.fail(f"{ax} vs {a.shape}"),
            logical, params, is_leaf=lambda x: isinstance(x, tuple))

    @chex.variants(with_jit=True, without_jit=True)
    def test_replaying_own_routes_is_bit_identical_and_other_routes_differ(self):
        params, tokens, mask = _setup()
        fwd = functools.partial(self.forward, params, tokens, attention_mask_BxT=mask)
        h, aux = fwd()
        h_replay, aux_r = fwd(replay_BxTxLxK=aux["routes"])
        np.testing.assert_array_equal(h_replay, h)
        np.testing.assert_array_equal(aux_r["routes"], aux["routes"])
        shifted = (aux["routes"] + 1) % CFG.num_experts  # still K distinct experts per token
        h_other, aux_o = fwd(replay_BxTxLxK=shifted)
        np.testing.assert_array_equal(aux_o["routes"], shifted)
        assert float(jnp.abs(h_other - h).max()) > 1e-3
        # -1 rows route normally: replaying all -1 is the same as no replay.
        h_none, _ = fwd(replay_BxTxLxK=jnp.full_like(aux["routes"], -1))
        np.testing.assert_array_equal(h_none, h)
        # Replaying the forward's own weights too (weight replay) reproduces it bit for bit;
        # other weights on the same experts change it.
        h_w, aux_w = fwd(replay_BxTxLxK=aux["routes"],
                         replay_weights_BxTxLxK=aux["route_weights"])
        np.testing.assert_array_equal(h_w, h)
        np.testing.assert_array_equal(aux_w["route_weights"], aux["route_weights"])
        flat = jnp.full_like(aux["route_weights"], 1.0 / CFG.top_k)
        h_flat, _ = fwd(replay_BxTxLxK=aux["routes"], replay_weights_BxTxLxK=flat)
        assert float(jnp.abs(h_flat - h).max()) > 1e-4

    @chex.variants(with_jit=True)  # the masking is the same traced or eager
    def test_causality_gradient_from_future_tokens_is_exactly_zero(self):
        params, _, _ = _setup()
        # Position t's output may depend on tokens ≤ t only. Tokens after t are ids that
        # never occur at or before t, so the gradient w.r.t. their embedding rows must be
        # exactly 0.
        t = 5
        past = jnp.arange(T)[None, : t + 1] % 20
        future = 20 + jnp.arange(T - t - 1)[None]
        tokens = jnp.concatenate([past, future], axis=1)
        g = jax.grad(lambda p: jnp.sum(self.forward(p, tokens)[0][:, t] ** 2))(params)
        assert float(jnp.abs(g["embed"][20:20 + T - t - 1]).max()) == 0.0
        assert float(jnp.abs(g["embed"][:t + 1]).max()) > 0.0


def test_router_loss_weights_apply():
    params, tokens, mask = _setup()
    cfg = CFG.replace(router_z_loss_weight=0.1, router_aux_loss_weight=0.01)
    _, aux = _fwd(cfg)(params, tokens, attention_mask_BxT=mask)
    want = 0.1 * aux["router_z_loss"].mean() + 0.01 * aux["load_balance_loss"].mean()
    # Two means over L layers, two products, one sum.
    assert_close(aux["router_loss"], want, n=2 * CFG.num_layers + 3)


def test_padding_never_influences_real_positions(x64):
    params, tokens, mask = _setup(cfg=CFG64)
    h, _ = _fwd(CFG64)(params, tokens, attention_mask_BxT=mask)
    junk = jnp.where(mask, tokens, (tokens * 7 + 3) % CFG.vocab_size)
    h_junk, _ = _fwd(CFG64)(params, junk, attention_mask_BxT=mask)
    np.testing.assert_array_equal(jnp.where(mask[..., None], h_junk, 0),
                                  jnp.where(mask[..., None], h, 0))
    # A row with 4 left-pad slots equals the same real tokens without padding (attention
    # sums over 12 vs 8 key slots: same math, other summation order).
    alone, _ = _fwd(CFG64)(params, tokens[:1, 4:])
    assert_close(h[0, 4:], alone[0], n=forward_chain(CFG, T), dtype="float64", scale="max")


@pytest.mark.parametrize("with_replay,remat", [
    pytest.param(False, "full", marks=pytest.mark.slow),  # (True, "full") covers "full"
    (True, "full"), (True, "dots")])
def test_remat_equal_values_and_gradients(x64, with_replay, remat):
    params, tokens, mask = _setup(cfg=CFG64)
    replay = None
    if with_replay:
        replay = (_fwd(CFG64)(params, tokens, attention_mask_BxT=mask)[1]["routes"] + 3) % 8

    def loss(p, cfg):
        h, aux = tf.forward(p, tokens, cfg, attention_mask_BxT=mask, replay_BxTxLxK=replay)
        return _probe(h, mask) + aux["router_z_loss"].sum(), h

    step = lambda cfg: jax.jit(jax.value_and_grad(functools.partial(loss, cfg=cfg),
                                                  has_aux=True))
    (v0, h0), g0 = step(CFG64)(params)
    (v1, _), g1 = step(CFG64.replace(remat=remat))(params)
    _assert_values_and_grads_close(v1, g1, v0, g0, _probe_cond(h0, mask))


# T = 12: a ragged last chunk, and an even split (slow: the ragged case has the even
# chunks too, only the last one differs).
@pytest.mark.parametrize("impl,chunk", [
    ("chunked", 5), pytest.param("chunked", 4, marks=pytest.mark.slow), ("causal", 5)])
def test_chunked_attention_equals_naive(x64, impl, chunk):
    """Query chunks (padded, rematerialized) and causal blocks (each against its key
    prefix) compute every real row like the naive path, in value and gradient; with a KV
    cache (prefill into S > T slots, either layout) as well."""
    params, tokens, mask = _setup(cfg=CFG64)
    chunked = CFG64.replace(attention_impl=impl, attention_chunk=chunk, remat="full")
    step = _probe_step(tokens, mask)
    (v0, h0), g0 = step(CFG64)(params)
    (v1, _), g1 = step(chunked)(params)
    _assert_values_and_grads_close(v1, g1, v0, g0, _probe_cond(h0, mask))
    prefill = lambda cfg: tf.forward(params, tokens, cfg, attention_mask_BxT=mask,
                                     cache=tf.init_cache(cfg, B, T + 6, jnp.float64))[0]
    m = mask[..., None]
    for layout in KV_CACHE_LAYOUTS:
        assert_close(jnp.where(m, prefill(chunked.replace(kv_cache_layout=layout)), 0),
                     jnp.where(m, prefill(CFG64), 0), n=forward_chain(CFG, T + 6),
                     dtype="float64", scale="max")


@pytest.mark.parametrize("impl", ["tiles", "ragged_dot", "pallas_tpu", "pallas_gpu"])
def test_grouped_matmul_implementations_agree_in_the_model(x64, impl):
    """The model with each grouped matmul (the Pallas kernels interpreted, on CPU devices
    whatever the default backend: float64 has no Triton lowering; the compiled kernels
    are tests/kernels/gmm_pallas_test.py's) equals the pure-JAX loop, in value and gradient."""
    with jax.default_device(jax.devices("cpu")[0]):
        _grouped_matmul_agrees(impl)


def _grouped_matmul_agrees(impl):
    params, tokens, mask = _setup(cfg=CFG64)
    gmm = moe.gmm_of(impl)
    if impl.startswith("pallas"):
        gmm = functools.partial(gmm, interpret=True)

    def loss(p, gmm_):
        h, _ = tf.forward(p, tokens, CFG64, attention_mask_BxT=mask, gmm=gmm_)
        return _probe(h, mask), h

    step = lambda g: jax.jit(jax.value_and_grad(functools.partial(loss, gmm_=g),
                                                has_aux=True))
    (v0, h0), g0 = step(None)(params)
    (v1, _), g1 = step(gmm)(params)
    _assert_values_and_grads_close(v1, g1, v0, g0, _probe_cond(h0, mask))


def _probe_step(tokens, mask):
    """cfg → jitted value_and_grad of the probe loss of the model under cfg (aux: h)."""
    def loss(p, cfg):
        h, _ = tf.forward(p, tokens, cfg, attention_mask_BxT=mask)
        return _probe(h, mask), h

    return lambda cfg: jax.jit(jax.value_and_grad(functools.partial(loss, cfg=cfg),
                                                  has_aux=True))


@pytest.mark.parametrize("variant", [{"dispatch": "dense"}, {"unroll_layers": True}])
def test_dense_dispatch_and_unrolled_layers_agree_with_the_scan(x64, variant):
    params, tokens, mask = _setup(cfg=CFG64)
    step = _probe_step(tokens, mask)
    (v0, h0), g0 = step(CFG64)(params)
    (v1, _), g1 = step(CFG64.replace(**variant))(params)
    _assert_values_and_grads_close(v1, g1, v0, g0, _probe_cond(h0, mask))


# (cache layout, unrolled layers, decode_block): every layout with the stacked and the
# per-layer buffers; the blocked decode attention (5 slots: blocks [0, 5), [5, 10), and
# a last one clamped to [7, 12) whose first slots are masked) on both buffer kinds (the
# stacked one sliced block by block in its layer, attend_blocks' `layer`).
# bksd with the layer scan (~17 s) runs under -m slow: bksd is checked unrolled (with and
# without blocks) and the scan with bskd.
KV_CASES = [pytest.param(lay, unroll, 0,
                         marks=pytest.mark.slow if (lay, unroll) == ("bksd", False) else ())
            for lay in KV_CACHE_LAYOUTS for unroll in (False, True)] + [
    ("bksd", False, 5), ("bskd", True, 5)]


@pytest.mark.parametrize("layout,unroll,decode_block", KV_CASES)
def test_kv_cache_prefill_then_decode_equals_full_forward(x64, layout, unroll, decode_block):
    cfg = CFG64.replace(kv_cache_layout=layout, unroll_layers=unroll, decode_block=decode_block)
    params, tokens, mask = _setup(cfg=CFG64)
    h_full, aux_full = _fwd(CFG64)(params, tokens, attention_mask_BxT=mask)
    cache = tf.init_cache(cfg, B, T, jnp.float64)
    layer = {"bskd": (B, T, 2, 8), "bksd": (B, 2, T, 8)}[layout]
    # Unrolled layers: one buffer per layer; scanned: the two layers stacked.
    want = (layer, layer) if unroll else (2, *layer)
    assert jax.tree.map(jnp.shape, cache["k"]) == jax.tree.map(jnp.shape, cache["v"]) == want
    step = jax.jit(lambda p, t, m, c: tf.forward(p, t, cfg, attention_mask_BxT=m, cache=c))
    h, aux = step(params, tokens[:, :7], mask[:, :7], cache)
    hs, routes = [h], [aux["routes"]]
    for i in range(7, T):
        h, aux = step(params, tokens[:, i:i + 1], mask[:, i:i + 1], aux["cache"])
        hs.append(h)
        routes.append(aux["routes"])
    m = mask[..., None]
    assert_close(jnp.where(m, jnp.concatenate(hs, 1), 0), jnp.where(m, h_full, 0),
                 n=forward_chain(CFG, T), dtype="float64", scale="max")
    real = mask[..., None, None]
    np.testing.assert_array_equal(jnp.where(real, jnp.concatenate(routes, 1), -1),
                                  jnp.where(real, aux_full["routes"], -1))
    assert int(aux["cache"]["index"]) == T


def test_logits_and_tied_embeddings():
    cfg = CFG.replace(tie_embeddings=True)
    params = tf.init_params(jax.random.key(3), cfg)
    assert "unembed" not in params
    h, _ = tf.forward(params, jnp.zeros((1, 3), jnp.int32), cfg)
    # Both sides are one float32 dot of length D: the same result up to summation order.
    want = jnp.dot(h, params["embed"].T, precision="highest")  # no TF32 on a GPU
    assert_close(tf.logits(params, h, cfg), want, n=cfg.d_model, scale="max")


def test_input_errors():
    params, tokens, mask = _setup()
    # Values of device arrays only under checks=True (no device sync otherwise).
    with pytest.raises(ValueError, match="vocab_size=64"):
        tf.forward(params, tokens.at[0, 0].set(64), CFG, checks=True)
    with pytest.raises(ValueError, match=r"integer \[B, T\]"):
        tf.forward(params, tokens.astype(jnp.float32), CFG)
    with pytest.raises(ValueError, match="attention_mask"):
        tf.forward(params, tokens, CFG, attention_mask_BxT=mask[:, :3])
    with pytest.raises(ValueError, match="replay: shape"):
        tf.forward(params, tokens, CFG, replay_BxTxLxK=jnp.zeros((B, T, 1, 2), jnp.int32))
    with pytest.raises(ValueError, match="max_seq_len=32"):
        tf.init_cache(CFG, 1, 33)

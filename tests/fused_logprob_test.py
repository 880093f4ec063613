"""The fused log-prob / entropy op against a float64 reference, in value and VJP.

Letters: T tokens, D model, V vocab.

On CPU the Pallas implementation runs in interpret mode; on a GPU/TPU backend the same
tests run it compiled.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from kernels.fused_logprob import IMPLS, BlockSizes, fused_logprob, reference

# Small blocks so every test shape spans several tiles and ragged edges; each is at least
# 16 because Triton dots need 16-wide operands when the suite runs compiled on a GPU.
# float32 runs use several forward vocab splits per token block and a D loop of 16-wide
# slices (D = 40 is padded to the slices); bfloat16 runs one split and one dot over all
# of D, so both combine paths and both logit paths of the Pallas kernels are covered.
BLOCKS = {
    jnp.float32: BlockSizes(chunk=32, tokens=16, vocab=16, vocab_tiles=2, dim=16,
                            bwd_chunk=32, bwd_tokens=16, bwd_vocab=16),
    jnp.bfloat16: BlockSizes(chunk=64, tokens=32, vocab=16, vocab_tiles=64, dim=64,
                             bwd_chunk=64, bwd_tokens=32, bwd_vocab=32),
}
# (T, D, V): block multiples; T, D and V ragged; D below Triton's 16 and V ragged.
SHAPES = [(16, 16, 64), (37, 40, 101), (64, 8, 200)]


def tolerance(dtype):
    """One rule for every comparison. f32: the op reassociates sums over V (chunked
    log-sum-exp), so errors are a few ulps × log V: 2e-5 relative. bf16 inputs: values are
    rounded to 8 mantissa bits before the float32 matmul, on both sides identically, so
    the gap is again f32 reassociation, but gradients are cast back to bf16 (and the Pallas
    backward rounds dz to bf16 for its matmuls): 1e-2, relative to the largest entry."""
    return {"rtol": 2e-5, "atol": 2e-5} if dtype == jnp.float32 else {"rtol": 1e-2, "atol": 1e-2}


def _inputs(t, d, v, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (t, d)).astype(dtype)
    w = (jax.random.normal(k[1], (d, v)) / np.sqrt(d) * 3).astype(dtype)
    y = jax.random.randint(k[2], (t,), 0, v)
    g_logp = jax.random.normal(k[3], (t,))
    g_ent = jax.random.normal(k[4], (t,))
    return h, w, y, g_logp, g_ent


def _ref64(h, w, y):
    h64 = np.asarray(h, np.float64)
    w64 = np.asarray(w, np.float64)
    z = h64 @ w64
    z = z - z.max(-1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logp_all)
    return logp_all[np.arange(len(y)), np.asarray(y)], -(p * logp_all).sum(-1), p, z


def _ref64_vjp(h, w, y, g_logp, g_ent):
    _, _, p, z = _ref64(h, w, y)
    onehot = np.eye(w.shape[1])[np.asarray(y)]
    ez = (p * z).sum(-1, keepdims=True)
    dz = np.asarray(g_logp, np.float64)[:, None] * (onehot - p) + \
        np.asarray(g_ent, np.float64)[:, None] * p * (ez - z)
    return dz @ np.asarray(w, np.float64).T, np.asarray(h, np.float64).T @ dz


# "naive" is checked by value below; its VJP is JAX's own autodiff of log_softmax.
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "naive"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_value_and_vjp_match_float64_reference(impl, dtype, shape):
    h, w, y, g_logp, g_ent = _inputs(*shape, dtype)
    op = jax.jit(functools.partial(fused_logprob, block=BLOCKS[dtype], impl=impl))
    (logp, ent), vjp = jax.vjp(lambda h, w: op(h, w, y), h, w)
    want_logp, want_ent, _, _ = _ref64(h, w, y)
    tol = tolerance(dtype)
    np.testing.assert_allclose(logp, want_logp, **tol)
    np.testing.assert_allclose(ent, want_ent, **tol)
    dh, dw = vjp((g_logp, g_ent))
    want_dh, want_dw = _ref64_vjp(h, w, y, g_logp, g_ent)
    for got, want in ((dh, want_dh), (dw, want_dw)):
        scale = np.abs(want).max()
        np.testing.assert_allclose(np.asarray(got, np.float64) / scale, want / scale, **tol)


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
@settings(max_examples=6, deadline=None, derandomize=True)
@given(t=st.integers(1, 40), d=st.integers(1, 40), v=st.integers(2, 150),
       seed=st.integers(0, 2**16))
def test_random_shapes_match_float64_reference(impl, t, d, v, seed):
    """Shapes drawn at random (fixed examples: derandomized), float32, the f32 blocks."""
    h, w, y, g_logp, g_ent = _inputs(t, d, v, jnp.float32, seed)
    f = jax.jit(functools.partial(fused_logprob, block=BLOCKS[jnp.float32], impl=impl))
    (logp, ent), vjp = jax.vjp(lambda h, w: f(h, w, y), h, w)
    want_logp, want_ent, _, _ = _ref64(h, w, y)
    tol = tolerance(jnp.float32)
    np.testing.assert_allclose(logp, want_logp, **tol)
    np.testing.assert_allclose(ent, want_ent, **tol)
    for got, want in zip(vjp((g_logp, g_ent)), _ref64_vjp(h, w, y, g_logp, g_ent)):
        scale = np.abs(want).max()
        np.testing.assert_allclose(np.asarray(got, np.float64) / scale, want / scale, **tol)


def test_chunked_check_grads_x64():
    with jax.enable_x64(True):
        h, w, y, _, _ = _inputs(9, 8, 37, jnp.float64)
        f = jax.jit(lambda h, w: fused_logprob(h, w, y, block=BlockSizes(chunk=16),
                                               impl="chunked"))
        check_grads(f, (h, w), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def _temp_bytes(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_temp_memory_grows_with_tokens_not_vocab():
    c = 512
    fwd = lambda h, w, y: fused_logprob(h, w, y, block=BlockSizes(chunk=c), impl="chunked")
    tmp = lambda t, v: _temp_bytes(fwd, ((t, 64), jnp.float32), ((64, v), jnp.float32),
                                   ((t,), jnp.int32))
    t = 256
    small_v, big_v = tmp(t, 8 * c), tmp(t, 64 * c)
    # 8× the vocabulary adds at most one chunk's worth of logits (plus the padded copy of
    # W the scan reads), never a [T, V] tensor.
    assert big_v - small_v < 4 * t * c + 4 * 64 * 64 * c
    assert big_v < 4 * t * 64 * c / 8  # far below the naive [T, V] float32 logits
    assert tmp(4 * t, 8 * c) > small_v  # and it does grow with T


def test_chunked_backward_holds_no_TxV_buffer():
    t, d, c = 1024, 64, 512
    loss = lambda h, w, y: sum(jnp.sum(o) for o in
                               fused_logprob(h, w, y, block=BlockSizes(chunk=c)))
    tmp = lambda v: _temp_bytes(jax.grad(loss, argnums=(0, 1)), ((t, d), jnp.float32),
                                ((d, v), jnp.float32), ((t,), jnp.int32))
    v = 32 * c
    # Doubling V adds V more columns of dW-sized buffers ([D, V] float32, a few copies at
    # most), never another float32 [T, V] of logits (what the naive backward holds).
    assert tmp(2 * v) - tmp(v) < 4 * t * v / 4


def test_shape_errors_name_values():
    h, w, y, _, _ = _inputs(8, 16, 40, jnp.float32)
    with pytest.raises(ValueError, match="unembed D=8"):
        fused_logprob(h, w[:8], y)
    with pytest.raises(ValueError, match="targets T=7"):
        fused_logprob(h, w, y[:7])
    with pytest.raises(ValueError, match="impl='fast'"):
        fused_logprob(h, w, y, impl="fast")
    with pytest.raises(ValueError, match="BlockSizes.chunk=0"):
        BlockSizes(chunk=0)


def test_naive_reference_is_the_float32_formula():
    h, w, y, _, _ = _inputs(4, 8, 10, jnp.float32)
    logp, ent = reference(h, w, y)
    want_logp, want_ent, _, _ = _ref64(h, w, y)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5)
    np.testing.assert_allclose(ent, want_ent, rtol=1e-5)

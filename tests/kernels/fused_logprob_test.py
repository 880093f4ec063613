"""The fused log-prob / entropy op against a float64 reference, in value and VJP.

Letters: T tokens, D model, V vocab.

On CPU the Pallas implementation runs in the (checking) interpreter; on a GPU/TPU
backend the same tests run it compiled for that target. The test chooses: the op never
looks at the platform.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads
from kernel_cases import INTERPRET, impl_params
from tolerance import assert_close, bound

from stablerl_jax.kernels.fused_logprob import fused_logprob, naive
from stablerl_jax.kernels.fused_logprob_impls import LOGPROB_IMPLS, LogprobBlocks

run = functools.partial(fused_logprob, interpret=INTERPRET)

# Small blocks so every test shape spans several tiles and ragged edges; each is at least
# 16 because Triton dots need 16-wide operands when the suite runs compiled on a GPU.
# float32 runs use several forward vocab splits per token block and a D loop of 16-wide
# slices (D = 40 is padded to the slices); bfloat16 runs one split and one dot over all
# of D, so both combine paths and both logit paths of the Pallas kernels are covered.
BLOCKS = {
    jnp.float32: LogprobBlocks(chunk=32, tokens=16, vocab=16, vocab_tiles=2, dim=16,
                            bwd_chunk=32, bwd_tokens=16, bwd_vocab=16),
    jnp.bfloat16: LogprobBlocks(chunk=64, tokens=32, vocab=16, vocab_tiles=64, dim=64,
                             bwd_chunk=64, bwd_tokens=32, bwd_vocab=32),
}
# (T, D, V): block multiples; T, D and V ragged; D below Triton's 16 and V ragged.
SHAPES = [(16, 16, 64), (37, 40, 101), (64, 8, 200)]


def _bounds(h, w, dtype, dz=None):
    """assert_close arguments (tests/tolerance.py) for logp / entropy and for dh / dW
    against the float64 reference, from the inputs themselves.

    The op computes in float32 (bfloat16 inputs are exact in it). A logit z = h·W[:, v] is
    a dot over D, off by ≤ γ_D·Z with Z = max Σ_d |h_d W_dv|; lse and E_p[z] add a sum
    over V plus a rescale per vocab tile (≤ 2V roundings) and ~8 exp/log/divides.
    - logp = z_y − lse and entropy = lse − E_p[z] cancel: compared absolutely, scale
      Z + log V (≥ |lse|), the factor 2 of the rule covering the two logit errors (z_y's,
      lse's); a logit error moves the entropy by up to max_t Σ_v p_v |z_v − E_p[z]|
      times itself: 1 + that is its cond.
    - Gradients, norm-wise: p = exp(z − lse) turns the absolute error of its argument
      (z and lse: ≤ 2·γ_{D+2}·Z) into a relative one, so those D + 2 roundings count 2Z
      times (c·γ_a ≤ γ_{c·a}); then dh sums dz·W over V and dW sums h·dz over T, with
      cond Σ|terms| / |Σ| of those sums. bfloat16: the gradients are rounded to bf16 (and
      dz too, for the Pallas matmuls): 2 bf16 roundings, plus the float32 error above
      expressed in bf16 roundings (a small fraction of one here).
    """
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
    d, v = w64.shape
    t = h64.shape[0]
    z = h64 @ w64
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    big_z = (np.abs(h64) @ np.abs(w64)).max()
    spread = (p * np.abs(z - (p * z).sum(-1, keepdims=True))).sum(-1).max()
    n_val = d + 2 * v + 8
    value = dict(n=n_val, scale=big_z + np.log(v))
    n_grad = int(np.ceil(2 * big_z)) * (d + 2) + 3 * v + t + 8
    if dtype == jnp.bfloat16:
        n_grad, gdtype = 2 + int(np.ceil(n_grad * 2.0**-24 / 2.0**-8)), "bfloat16"
    else:
        gdtype = "float32"
    conds = [] if dz is None else [
        (np.abs(dz) @ np.abs(w64).T).max() / np.abs(dz @ w64.T).max(),
        (np.abs(h64).T @ np.abs(dz)).max() / np.abs(h64.T @ dz).max()]
    grads = [dict(n=n_grad, dtype=gdtype, cond=c, scale="max") for c in conds]
    return value, dict(value, cond=1 + spread), grads


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
    """(dh, dW) and the logit cotangent dz they are made of."""
    _, _, p, z = _ref64(h, w, y)
    onehot = np.eye(w.shape[1])[np.asarray(y)]
    ez = (p * z).sum(-1, keepdims=True)
    dz = np.asarray(g_logp, np.float64)[:, None] * (onehot - p) + \
        np.asarray(g_ent, np.float64)[:, None] * p * (ez - z)
    return dz @ np.asarray(w, np.float64).T, np.asarray(h, np.float64).T @ dz, dz


# "naive" is checked by value below; its VJP is JAX's own autodiff of log_softmax.
@pytest.mark.parametrize("impl", impl_params(LOGPROB_IMPLS, lambda name, _: name != "naive"))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_value_and_vjp_match_float64_reference(impl, dtype, shape):
    h, w, y, g_logp, g_ent = _inputs(*shape, dtype)
    op = jax.jit(functools.partial(run, block=BLOCKS[dtype], impl=impl))
    (logp, ent), vjp = jax.vjp(lambda h, w: op(h, w, y), h, w)
    want_logp, want_ent, _, _ = _ref64(h, w, y)
    *want_grads, dz = _ref64_vjp(h, w, y, g_logp, g_ent)
    tol_logp, tol_ent, tol_grads = _bounds(h, w, dtype, dz)
    assert_close(logp, want_logp, **tol_logp)
    assert_close(ent, want_ent, **tol_ent)
    for got, want, tol in zip(vjp((g_logp, g_ent)), want_grads, tol_grads):
        assert_close(got, want, **tol)


@pytest.mark.parametrize("impl", impl_params(LOGPROB_IMPLS, lambda name, _: name != "naive"))
@settings(max_examples=4, deadline=None, derandomize=True)
@given(t=st.integers(1, 40), d=st.integers(1, 40), v=st.integers(2, 150),
       seed=st.integers(0, 2**16))
def test_random_shapes_match_float64_reference(impl, t, d, v, seed):
    """Shapes drawn at random (fixed examples: derandomized), float32, the f32 blocks."""
    h, w, y, g_logp, g_ent = _inputs(t, d, v, jnp.float32, seed)
    f = jax.jit(functools.partial(run, block=BLOCKS[jnp.float32], impl=impl))
    (logp, ent), vjp = jax.vjp(lambda h, w: f(h, w, y), h, w)
    want_logp, want_ent, _, _ = _ref64(h, w, y)
    *want_grads, dz = _ref64_vjp(h, w, y, g_logp, g_ent)
    tol_logp, tol_ent, tol_grads = _bounds(h, w, jnp.float32, dz)
    assert_close(logp, want_logp, **tol_logp)
    assert_close(ent, want_ent, **tol_ent)
    for got, want, tol in zip(vjp((g_logp, g_ent)), want_grads, tol_grads):
        assert_close(got, want, **tol)


def test_chunked_check_grads_x64():
    with jax.enable_x64(True):
        h, w, y, _, _ = _inputs(9, 8, 37, jnp.float64)
        f = jax.jit(lambda h, w: fused_logprob(h, w, y, block=LogprobBlocks(chunk=16),
                                               impl="chunked"))
        # A central difference of step eps is off by O(eps²) (truncation, ~1e-10 here) and
        # by its float64 rounding, γ_n·|f| / eps, which dominates: n = D + V + 8 roundings
        # of the op (a dot over D = 8, a log-sum-exp over V = 37).
        eps = 2.0**-20
        tol = bound(8 + 37 + 8, "float64") / eps
        check_grads(f, (h, w), order=1, modes=("rev",), atol=tol, rtol=tol, eps=eps)


def _temp_bytes(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_temp_memory_grows_with_tokens_not_vocab():
    c = 512
    fwd = lambda h, w, y: fused_logprob(h, w, y, block=LogprobBlocks(chunk=c), impl="chunked")
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
                               fused_logprob(h, w, y, block=LogprobBlocks(chunk=c)))
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
    with pytest.raises(ValueError, match="LogprobBlocks.chunk=0"):
        LogprobBlocks(chunk=0)


def test_naive_reference_is_the_float32_formula():
    h, w, y, _, _ = _inputs(4, 8, 10, jnp.float32)
    logp, ent = naive(h, w, y)
    want_logp, want_ent, _, _ = _ref64(h, w, y)
    tol_logp, tol_ent, _ = _bounds(h, w, jnp.float32)
    assert_close(logp, want_logp, **tol_logp)
    assert_close(ent, want_ent, **tol_ent)


@pytest.mark.parametrize("impl", impl_params(LOGPROB_IMPLS, lambda _, row: row.invariant))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_invariant_row_scores_a_token_as_its_distribution_does_in_any_batch(impl, dtype):
    """A batch-invariant row (what the `bitwise` sampler and trainer both run): a token's
    logp is the same bits whichever rows share the call (3, 37 or 100 rows, the row at
    another offset of its token block, other rows' values changed), and equals the entry
    at the target of the row's whole distribution (targets None), which a sampler draws
    from and records. Both block sets: several vocab splits with a D loop (float32), and
    one split over all of D (bfloat16); V = 101 is ragged."""
    h, w, y, _, _ = _inputs(100, 40, 101, dtype, seed=5)
    fn = LOGPROB_IMPLS[impl].load(block=BLOCKS[dtype], interpret=INTERPRET)
    logp, ent = jax.jit(fn)(h, w, y)
    dist = jax.jit(lambda h, w: fn(h, w, None))
    logp_V = np.asarray(dist(h, w))
    assert logp_V.shape == (100, 101) and logp_V.dtype == np.float32
    np.testing.assert_array_equal(logp_V[np.arange(100), np.asarray(y)], np.asarray(logp))
    others = h.at[:50].set(-h[:50])
    for rows in (slice(0, 3), slice(5, 42), slice(63, 100)):
        sub_logp, sub_ent = jax.jit(fn)(h[rows], w, y[rows])
        np.testing.assert_array_equal(np.asarray(sub_logp), np.asarray(logp[rows]))
        np.testing.assert_array_equal(np.asarray(sub_ent), np.asarray(ent[rows]))
        np.testing.assert_array_equal(np.asarray(dist(h[rows], w)), logp_V[rows])
    moved, _ = jax.jit(fn)(others, w, y)
    np.testing.assert_array_equal(np.asarray(moved[50:]), np.asarray(logp[50:]))
    # And it is the log-softmax: each row's distribution sums to 1 (float32 rounding of a
    # V-term sum of p ≤ 1 and of lse's error, as _bounds derives for logp).
    value, _, _ = _bounds(h, w, dtype)
    mass = np.exp(logp_V.astype(np.float64)).sum(-1)
    assert_close(np.log(mass), np.zeros(100), **value)

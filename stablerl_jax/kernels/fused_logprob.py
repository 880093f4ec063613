"""Fused token log-prob + full-vocabulary entropy without [T, V] logits: the dispatcher
`fused_logprob(..., impl=name)` and `naive`, `chunked`, `pallas`, named after their rows
of fused_logprob_impls.LOGPROB_IMPLS (`pallas`'s kernels are in fused_logprob_pallas.py).

Letters: T tokens, D model, V vocab, W vocab columns of one chunk, J = ⌈V / W⌉ chunks.
U is the unembedding matrix (unembed_DxV).

    z = h U  (per token, over the vocabulary; float32 accumulation)
    lse = log Σ_v exp z_v,   E_p[z] = Σ_v p_v z_v,   p = softmax(z)
    logp = z_y − lse,        entropy = lse − E_p[z]
    dz = g_logp · (onehot_y − p) + g_ent · p · (E_p[z] − z)
    dh += dz Uᵀ,   dU[:, chunk] = hᵀ dz

`naive`, the reference, materializes the float32 logits: O(T·V) memory. `chunked` (pure
JAX, a `lax.scan` over chunks of W = `block.chunk` columns: O(T·W) forward memory) and
`pallas` (Pallas kernels for `target`, "gpu" Triton or "tpu" Mosaic, or with
`interpret=True` the checking interpreter) stream vocab chunks through an online
log-sum-exp (running max m, Σ e^{z−m}, Σ e^{z−m}·z), save only lse and E_p[z] per
token, and recompute each chunk's logits for the backward (custom VJP, dz above).
`chunked` takes z_y = h · U[:, y] as a [T, D] gather and a row-wise dot, not a compare
over every logit; `pallas` takes it from the logit tile its kernel computes anyway. No
gradient is filtered or approximated: IS ratios amplify tiny log-prob errors.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from stablerl_jax.kernels import fused_logprob_pallas as _pallas
from stablerl_jax.kernels import lookup
from stablerl_jax.kernels.dtypes import MASK_VALUE, accum_dtype
from stablerl_jax.kernels.fused_logprob_impls import LOGPROB_IMPLS, LogprobBlocks

# Full float32 matmuls for float32 inputs: GPUs otherwise default to TF32 (~1e-3 relative
# error in the logits), which IS ratios would amplify. A no-op on CPU and for bf16 inputs.
_HI = jax.lax.Precision.HIGHEST


def _check(hidden_TxD, unembed_DxV, targets_T):
    if hidden_TxD.ndim != 2 or unembed_DxV.ndim != 2 or targets_T.ndim != 1:
        raise ValueError(f"fused_logprob: need hidden [T, D], unembed [D, V], targets [T]; got "
                         f"{hidden_TxD.shape=}, {unembed_DxV.shape=}, {targets_T.shape=}")
    t, d = hidden_TxD.shape
    if unembed_DxV.shape[0] != d:
        raise ValueError(f"fused_logprob: hidden D={d} != unembed D={unembed_DxV.shape[0]}")
    if targets_T.shape[0] != t:
        raise ValueError(f"fused_logprob: targets T={targets_T.shape[0]} != hidden T={t}")
    if not jnp.issubdtype(targets_T.dtype, jnp.integer):
        raise ValueError(f"fused_logprob: targets dtype {targets_T.dtype} must be integer")


def naive(hidden_TxD, unembed_DxV, targets_T):
    """The reference: full float32 logits, log_softmax, gather."""
    _check(hidden_TxD, unembed_DxV, targets_T)
    z = jnp.dot(hidden_TxD, unembed_DxV, preferred_element_type=jnp.float32, precision=_HI)
    logp_all = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets_T[:, None], axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def _target_logit(hidden_TxD, unembed_DxV, targets_T):
    """z_y = h · U[:, y] per token: O(T·D), row-wise, so batch invariant."""
    acc = accum_dtype(hidden_TxD.dtype)
    w_y = jnp.take(unembed_DxV, targets_T, axis=1).T.astype(acc)     # [T, D]
    return jnp.sum(hidden_TxD.astype(acc) * w_y, axis=1)


def _chunk(unembed_DxV, j, c):
    """Chunk j: W = c columns from start = min(j·W, V − W), so a ragged last chunk overlaps
    its predecessor instead of padding U (an O(D·V) copy); `new`: columns new to it."""
    v = unembed_DxV.shape[1]
    start = jnp.minimum(j * c, v - c)
    col = start + jnp.arange(c)
    return jax.lax.dynamic_slice_in_dim(unembed_DxV, start, c, axis=1), col, col >= j * c


def _stats_chunked(hidden_TxD, unembed_DxV, c):
    """Online log-sum-exp over vocab chunks: (lse, E_p[z]), each [T]."""
    t, v = hidden_TxD.shape[0], unembed_DxV.shape[1]
    acc = accum_dtype(hidden_TxD.dtype)
    ragged = v % c != 0

    def body(carry, j):
        m, s, sz = carry
        w_c, _, new = _chunk(unembed_DxV, j, c)
        z = jnp.dot(hidden_TxD, w_c, preferred_element_type=acc, precision=_HI)
        if ragged:
            z = jnp.where(new[None, :], z, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new[:, None])
        return (m_new, s * scale + jnp.sum(e, axis=1), sz * scale + jnp.sum(e * z, axis=1)), None

    init = (jnp.full((t,), MASK_VALUE, acc), jnp.zeros((t,), acc), jnp.zeros((t,), acc))
    (m, s, sz), _ = jax.lax.scan(body, init, jnp.arange(-(-v // c)))
    return m + jnp.log(s), sz / s


def _backward_chunked(hidden_TxD, unembed_DxV, targets_T, lse, ez, g_logp, g_ent, c):
    """(dh [T, D], dU [D, V]) in the accumulation dtype; dU leaves the scan as stacked
    [W, D] chunks (dzᵀ h), assembled by a reshape, not a [D, V] carry updated every step."""
    v = unembed_DxV.shape[1]
    n, r = -(-v // c), v - (-(-v // c) - 1) * c  # chunks; new columns in the last one
    acc = accum_dtype(hidden_TxD.dtype)
    h = hidden_TxD.astype(acc)

    def body(dh, j):
        w_c, col, new = _chunk(unembed_DxV, j, c)
        w_c = w_c.astype(acc)
        z = jnp.dot(h, w_c, precision=_HI)
        p = jnp.exp(z - lse[:, None])
        onehot = (col[None, :] == targets_T[:, None]).astype(acc)
        dz = g_logp[:, None] * (onehot - p) + g_ent[:, None] * p * (ez[:, None] - z)
        if r != c:
            dz = jnp.where(new[None, :], dz, 0.0)
        dh = dh + jax.lax.dot_general(dz, w_c, (((1,), (1,)), ((), ())), precision=_HI)
        return dh, jax.lax.dot_general(dz, h, (((0,), (0,)), ((), ())), precision=_HI)

    dh, dwt_JxWxD = jax.lax.scan(body, jnp.zeros(h.shape, acc), jnp.arange(n))
    dwt_VxD = dwt_JxWxD.reshape(n * c, -1)
    if r != c:  # the last chunk started at V − W: keep only its r new columns
        dwt_VxD = jnp.concatenate([dwt_VxD[:(n - 1) * c], dwt_VxD[n * c - r:]])
    return dh, dwt_VxD.T


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(hidden_TxD, unembed_DxV, targets_T, block, target, interpret):
    """target None: the pure-JAX chunks; "gpu" / "tpu": the Pallas kernels."""
    return _fused_fwd(hidden_TxD, unembed_DxV, targets_T, block, target, interpret)[0]


def _fused_fwd(hidden_TxD, unembed_DxV, targets_T, block, target, interpret):
    if target is not None:
        lse, ez, zy = _pallas.stats_pallas(hidden_TxD, unembed_DxV, targets_T, block, target,
                                           interpret)
    else:
        lse, ez = _stats_chunked(hidden_TxD, unembed_DxV, min(block.chunk, unembed_DxV.shape[1]))
        zy = _target_logit(hidden_TxD, unembed_DxV, targets_T)
    return (zy - lse, lse - ez), (hidden_TxD, unembed_DxV, targets_T, lse, ez)


def _fused_bwd(block, target, interpret, res, cot):
    hidden_TxD, unembed_DxV, targets_T, lse, ez = res
    acc = accum_dtype(hidden_TxD.dtype)
    g_logp, g_ent = (g.astype(acc) for g in cot)
    if target is not None:
        dh, dw = _pallas.backward_pallas(hidden_TxD, unembed_DxV, targets_T, lse, ez,
                                         g_logp, g_ent, block, target, interpret)
    else:
        dh, dw = _backward_chunked(hidden_TxD, unembed_DxV, targets_T, lse, ez, g_logp,
                                   g_ent, min(block.chunk, unembed_DxV.shape[1]))
    return dh.astype(hidden_TxD.dtype), dw.astype(unembed_DxV.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)


def chunked(hidden_TxD, unembed_DxV, targets_T, *, block: LogprobBlocks = LogprobBlocks()):
    """(logp_T, entropy_T) by the pure-JAX vocab chunks of `block.chunk` columns."""
    _check(hidden_TxD, unembed_DxV, targets_T)
    return _fused(hidden_TxD, unembed_DxV, targets_T.astype(jnp.int32), block, None, False)


def pallas(hidden_TxD, unembed_DxV, targets_T, *, target: str,
           block: LogprobBlocks = LogprobBlocks(), interpret: bool = False):
    """(logp_T, entropy_T) by the Pallas kernels for `target` ("gpu" | "tpu"), interpreted
    when `interpret`; batch-invariant (z_y from the kernel's own logit tile). targets_T
    None: log p [T, V] (no gradient), each target's entry its logp bit for bit."""
    if targets_T is None:
        _check(hidden_TxD, unembed_DxV, jnp.zeros(hidden_TxD.shape[:1], jnp.int32))
        return _pallas.logprobs_pallas(hidden_TxD, unembed_DxV, block, target,
                                       bool(interpret))
    _check(hidden_TxD, unembed_DxV, targets_T)
    return _fused(hidden_TxD, unembed_DxV, targets_T.astype(jnp.int32), block, target,
                  bool(interpret))


def fused_logprob(hidden_TxD, unembed_DxV, targets_T, *, impl: str = "chunked",
                  block: LogprobBlocks | None = None, interpret: bool = False):
    """(logp_T, entropy_T), float32 (float64 for float64 inputs), by LOGPROB_IMPLS' row
    `impl`; `block`, `interpret`: `Impl.load`."""
    fn = lookup(LOGPROB_IMPLS, impl, "fused_logprob: impl").load(block=block,
                                                                 interpret=interpret)
    return fn(hidden_TxD, unembed_DxV, targets_T)

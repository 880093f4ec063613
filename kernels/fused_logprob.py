"""Fused token log-prob + full-vocabulary entropy that never materializes [T, V] logits.

Letters: T tokens, D model, V vocab, C vocab chunk (block), Bt token block.

    z = h W  (per token, over the vocabulary; float32 accumulation)
    lse = log Σ_v exp z_v,   E_p[z] = Σ_v p_v z_v,   p = softmax(z)
    logp = z_y − lse,        entropy = lse − E_p[z]

Forward streams vocab chunks with an online log-sum-exp (running max m, Σ exp(z − m),
Σ exp(z − m)·z) and saves only lse and E_p[z] per token. The backward (custom VJP)
recomputes each chunk's logits:

    dz = g_logp · (onehot_y − p) + g_ent · p · (E_p[z] − z)
    dh += dz Wᵀ,   dW[:, chunk] = hᵀ dz

No gradient is filtered or approximated: IS ratios amplify tiny log-prob errors.

Implementations, chosen by `impl`:
- "naive": the reference. Full float32 logits, log_softmax, gather. O(T·V) memory.
- "chunked": pure JAX, `lax.scan` over vocab chunks, with the custom VJP above. Memory
  O(T·C). The default on CPU and the fallback everywhere.
- "pallas": the forward as a Pallas kernel (grid over token blocks, a loop over vocab
  blocks inside), sharing the chunked custom VJP for the backward. `interpret=True` on CPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

_NEG = -1e30  # "minus infinity" that keeps exp() and arithmetic finite in padded columns
# Full float32 matmuls for float32 inputs: GPUs otherwise default to TF32 (~1e-3 relative
# error in the logits), which IS ratios would amplify. A no-op on CPU and for bf16 inputs.
_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. `vocab` is the chunk streamed at a time (C); `tokens` is the Pallas
    token block. Powers of two keep GPU (Triton) lowering happy."""

    tokens: int = 128
    vocab: int = 2048

    def __post_init__(self):
        for f in ("tokens", "vocab"):
            v = getattr(self, f)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"BlockSizes.{f}={v!r} must be a positive int")


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


def reference(hidden_TxD, unembed_DxV, targets_T):
    """The naive reference: full float32 logits."""
    z = jnp.dot(hidden_TxD, unembed_DxV, preferred_element_type=jnp.float32, precision=_HI)
    logp_all = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets_T[:, None], axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def _chunk(unembed_DxV, j, c):
    """Chunk j: columns [start, start + C) with start = min(j·C, V − C), so the last chunk
    overlaps its predecessor instead of padding W (a padded copy of W would cost O(D·V)
    memory). `new` marks the columns this chunk is the first to cover."""
    v = unembed_DxV.shape[1]
    start = jnp.minimum(j * c, v - c)
    w_c = jax.lax.dynamic_slice_in_dim(unembed_DxV, start, c, axis=1)
    col = start + jnp.arange(c)
    return w_c, col, col >= j * c, start


def _acc_dtype(x):
    """float32 accumulation for f32/bf16 inputs; float64 when the inputs are float64 (x64
    gradient checks)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _stats_chunked(hidden_TxD, unembed_DxV, targets_T, c):
    """Online log-sum-exp over vocab chunks: (lse, E_p[z], z_y), each [T] float32."""
    t = hidden_TxD.shape[0]
    acc = _acc_dtype(hidden_TxD)
    c = min(c, unembed_DxV.shape[1])
    n = -(-unembed_DxV.shape[1] // c)

    def body(carry, j):
        m, s, sz, zy = carry
        w_c, col, new, _ = _chunk(unembed_DxV, j, c)
        z = jnp.dot(hidden_TxD, w_c, preferred_element_type=acc, precision=_HI)
        z = jnp.where(new[None, :], z, _NEG)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new[:, None])
        s = s * scale + jnp.sum(e, axis=1)
        sz = sz * scale + jnp.sum(e * z, axis=1)
        hit = (col[None, :] == targets_T[:, None]) & new[None, :]
        zy = zy + jnp.sum(jnp.where(hit, z, 0.0), axis=1)
        return (m_new, s, sz, zy), None

    init = (jnp.full((t,), _NEG, acc), jnp.zeros((t,), acc),
            jnp.zeros((t,), acc), jnp.zeros((t,), acc))
    (m, s, sz, zy), _ = jax.lax.scan(body, init, jnp.arange(n))
    return m + jnp.log(s), sz / s, zy


def _backward_chunked(hidden_TxD, unembed_DxV, targets_T, lse, ez, g_logp, g_ent, c):
    acc = _acc_dtype(hidden_TxD)
    c = min(c, unembed_DxV.shape[1])
    n = -(-unembed_DxV.shape[1] // c)
    h32 = hidden_TxD.astype(acc)

    def body(carry, j):
        dh, dw = carry
        w_c, col, new, start = _chunk(unembed_DxV, j, c)
        z = jnp.dot(hidden_TxD, w_c, preferred_element_type=acc, precision=_HI)
        p = jnp.exp(z - lse[:, None])
        onehot = (col[None, :] == targets_T[:, None]).astype(acc)
        dz = g_logp[:, None] * (onehot - p) + g_ent[:, None] * p * (ez[:, None] - z)
        dz = jnp.where(new[None, :], dz, 0.0)
        dh = dh + jnp.dot(dz, w_c.T.astype(acc), preferred_element_type=acc, precision=_HI)
        dw_c = jnp.dot(h32.T, dz, preferred_element_type=acc, precision=_HI)
        old = jax.lax.dynamic_slice_in_dim(dw, start, c, axis=1)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, jnp.where(new[None, :], dw_c, old),
                                                 start, axis=1)
        return (dh, dw), None

    init = (jnp.zeros(hidden_TxD.shape, acc),
            jnp.zeros(unembed_DxV.shape, acc))
    (dh, dw), _ = jax.lax.scan(body, init, jnp.arange(n))
    return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused(hidden_TxD, unembed_DxV, targets_T, block: BlockSizes, impl: str):
    lse, ez, zy = _forward_stats(hidden_TxD, unembed_DxV, targets_T, block, impl)
    return zy - lse, lse - ez


def _forward_stats(hidden_TxD, unembed_DxV, targets_T, block, impl):
    if impl == "pallas":
        from kernels.fused_logprob_pallas import stats_pallas
        return stats_pallas(hidden_TxD, unembed_DxV, targets_T, block)
    return _stats_chunked(hidden_TxD, unembed_DxV, targets_T, block.vocab)


def _fused_fwd(hidden_TxD, unembed_DxV, targets_T, block, impl):
    lse, ez, zy = _forward_stats(hidden_TxD, unembed_DxV, targets_T, block, impl)
    return (zy - lse, lse - ez), (hidden_TxD, unembed_DxV, targets_T, lse, ez)


def _fused_bwd(block, impl, res, cot):
    hidden_TxD, unembed_DxV, targets_T, lse, ez = res
    g_logp, g_ent = cot
    dh, dw = _backward_chunked(hidden_TxD, unembed_DxV, targets_T, lse, ez,
                               g_logp.astype(_acc_dtype(hidden_TxD)),
                               g_ent.astype(_acc_dtype(hidden_TxD)),
                               block.vocab)
    return dh.astype(hidden_TxD.dtype), dw.astype(unembed_DxV.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_logprob(hidden_TxD, unembed_DxV, targets_T, *, block: BlockSizes | None = None,
                  impl: str = "chunked"):
    """(logp_T, entropy_T), float32. See the module docstring for the three impls."""
    _check(hidden_TxD, unembed_DxV, targets_T)
    if impl == "naive":
        return reference(hidden_TxD, unembed_DxV, targets_T)
    if impl not in ("chunked", "pallas"):
        raise ValueError(f"fused_logprob: impl={impl!r} must be 'naive', 'chunked' or 'pallas'")
    return _fused(hidden_TxD, unembed_DxV, targets_T.astype(jnp.int32), block or BlockSizes(),
                  impl)

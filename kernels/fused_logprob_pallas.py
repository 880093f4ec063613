"""Pallas forward of the fused log-prob op, split over the vocabulary.

Letters: T tokens, D model, V vocab, Bt token block, Bv vocab block, Nv = V / Bv.

Grid (T/Bt, Nv): program (i, j) multiplies its [Bt, D] hidden block by the [D, Bv]
unembedding block and reduces the [Bt, Bv] logit tile on the spot to four numbers per
token: the tile max m_j, Σ exp(z − m_j), Σ exp(z − m_j)·z, and the target logit if the
target falls in the tile. Logits never leave the program. A small combine in JAX merges
the Nv partial statistics (an [Nv, T] array, not [T, V]):

    M = max_j m_j,  S = Σ_j s_j e^{m_j − M},  lse = M + log S,  E_p[z] = Σ_j sz_j e^{m_j − M} / S

Every program is independent, so the same kernel lowers to GPU (Triton), TPU (Mosaic) and
the CPU interpreter. The backward pass is the chunked custom VJP of
`kernels.fused_logprob` (it recomputes the same tiles).

T and V are padded up to the block sizes (padded vocab columns are masked to −1e30, so
exp → 0; padded tokens are sliced off). `interpret=None` runs the interpreter on CPU and
compiles elsewhere.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG = -1e30


def _kernel(h_ref, w_ref, y_ref, m_ref, s_ref, sz_ref, zy_ref, *, v: int):
    j = pl.program_id(1)
    h = h_ref[...]
    w = w_ref[...]
    bt, bv = h.shape[0], w.shape[1]
    z = jnp.dot(h, w, preferred_element_type=jnp.float32,
                precision=jax.lax.Precision.HIGHEST)                  # [Bt, Bv]
    col = j * bv + jax.lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
    z = jnp.where(col < v, z, _NEG)
    m = jnp.max(z, axis=1, keepdims=True)
    e = jnp.exp(z - m)
    m_ref[...] = m
    s_ref[...] = jnp.sum(e, axis=1, keepdims=True)
    sz_ref[...] = jnp.sum(e * z, axis=1, keepdims=True)
    zy_ref[...] = jnp.sum(jnp.where(col == y_ref[...], z, 0.0), axis=1, keepdims=True)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def stats_pallas(hidden_TxD, unembed_DxV, targets_T, block, interpret: bool | None = None):
    """(lse_T, E_p[z]_T, z_y_T) in float32 via the Pallas kernel."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    t, d = hidden_TxD.shape
    v = unembed_DxV.shape[1]
    bt, bv = block.tokens, block.vocab
    tp, vp, dp = -(-t // bt) * bt, -(-v // bv) * bv, d
    if not interpret:
        # Triton blocks must be powers of two and dots at least 16 wide: zero-pad D
        # (zero columns change no dot product).
        dp = max(16, _pow2(d))
    h = jnp.pad(hidden_TxD, ((0, tp - t), (0, dp - d)))
    w = jnp.pad(unembed_DxV, ((0, dp - d), (0, vp - v)))
    y = jnp.pad(targets_T.astype(jnp.int32), (0, tp - t))[:, None]
    nv = vp // bv
    part = jax.ShapeDtypeStruct((nv * tp, 1), jnp.float32)
    # Partial statistics of (i, j) land in rows [j·Tp + i·Bt, +Bt) of an [Nv·Tp, 1] array.
    out_block = pl.BlockSpec((bt, 1), lambda i, j: (j * (tp // bt) + i, 0))
    m, s, sz, zy = pl.pallas_call(
        lambda *refs: _kernel(*refs, v=v),
        grid=(tp // bt, nv),
        in_specs=[pl.BlockSpec((bt, dp), lambda i, j: (i, 0)),
                  pl.BlockSpec((dp, bv), lambda i, j: (0, j)),
                  pl.BlockSpec((bt, 1), lambda i, j: (i, 0))],
        out_specs=[out_block] * 4,
        out_shape=[part] * 4,
        interpret=interpret,
    )(h, w, y)
    m, s, sz, zy = (x.reshape(nv, tp)[:, :t] for x in (m, s, sz, zy))
    big = jnp.max(m, axis=0)
    scale = jnp.exp(m - big)
    total = jnp.sum(s * scale, axis=0)
    return big + jnp.log(total), jnp.sum(sz * scale, axis=0) / total, jnp.sum(zy, axis=0)

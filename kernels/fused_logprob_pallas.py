"""Pallas forward of the fused log-prob op: per token block, stream vocab blocks.

Letters: T tokens, D model, V vocab, Bt token block, Bv vocab block.

Grid: one program per token block. Each program holds its [Bt, D] hidden block and loops
over vocab blocks of the unembedding, keeping the online log-sum-exp statistics (running
max, Σ exp, Σ exp·z) and the target logit in float32 registers; it writes lse, E_p[z] and
z_y for its tokens. Logits never leave the program. The backward pass is the chunked
custom VJP of `kernels.fused_logprob` (it recomputes the same tiles).

T and V are padded up to the block sizes; padded vocab columns are masked to −1e30
(exp → 0) and padded tokens are sliced off. `interpret=None` runs the kernel in the
Pallas interpreter on CPU and compiled elsewhere (GPU via Triton, TPU via Mosaic).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG = -1e30


def _kernel(h_ref, w_ref, y_ref, lse_ref, ez_ref, zy_ref, *, bv: int, nv: int, v: int):
    h = h_ref[...]
    y = y_ref[...]                                   # [Bt, 1] int32
    bt = h.shape[0]

    def body(j, carry):
        m, s, sz, zy = carry
        w = w_ref[:, pl.ds(j * bv, bv)]
        z = jnp.dot(h, w, preferred_element_type=jnp.float32)      # [Bt, Bv]
        col = j * bv + jax.lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
        z = jnp.where(col < v, z, _NEG)
        m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new)
        s = s * scale + jnp.sum(e, axis=1, keepdims=True)
        sz = sz * scale + jnp.sum(e * z, axis=1, keepdims=True)
        zy = zy + jnp.sum(jnp.where(col == y, z, 0.0), axis=1, keepdims=True)
        return m_new, s, sz, zy

    zeros = jnp.zeros((bt, 1), jnp.float32)
    m, s, sz, zy = jax.lax.fori_loop(0, nv, body, (zeros + _NEG, zeros, zeros, zeros))
    lse_ref[...] = m + jnp.log(s)
    ez_ref[...] = sz / s
    zy_ref[...] = zy


def stats_pallas(hidden_TxD, unembed_DxV, targets_T, block, interpret: bool | None = None):
    """(lse_T, E_p[z]_T, z_y_T) in float32 via the Pallas kernel."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    t, d = hidden_TxD.shape
    v = unembed_DxV.shape[1]
    bt, bv = block.tokens, block.vocab
    tp, vp = -(-t // bt) * bt, -(-v // bv) * bv
    h = jnp.pad(hidden_TxD, ((0, tp - t), (0, 0)))
    w = jnp.pad(unembed_DxV, ((0, 0), (0, vp - v)))
    y = jnp.pad(targets_T.astype(jnp.int32), (0, tp - t))[:, None]
    out = jax.ShapeDtypeStruct((tp, 1), jnp.float32)
    tok_block = pl.BlockSpec((bt, 1), lambda i: (i, 0))
    lse, ez, zy = pl.pallas_call(
        lambda *refs: _kernel(*refs, bv=bv, nv=vp // bv, v=v),
        grid=(tp // bt,),
        in_specs=[pl.BlockSpec((bt, d), lambda i: (i, 0)),
                  pl.BlockSpec((d, vp), lambda i: (0, 0)),
                  tok_block],
        out_specs=[tok_block, tok_block, tok_block],
        out_shape=[out, out, out],
        interpret=interpret,
    )(h, w, y)
    return lse[:t, 0], ez[:t, 0], zy[:t, 0]

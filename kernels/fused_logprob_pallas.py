"""Pallas kernels of the fused log-prob op: forward statistics, d hidden, d unembed.

Letters: T tokens, D model, V vocab, Bt token block, Bv vocab tile, L vocab tiles per
forward program, S = V / (L·Bv) vocab splits of the forward grid.

Forward, grid (T/Bt, S): program (i, j) keeps its [Bt, D] hidden block and streams L
vocab tiles [D, Bv] through an online log-sum-exp (running max m, Σ e^{z−m}, Σ e^{z−m}·z).
Logits never leave the program. With S > 1 (more programs than token blocks alone give)
a small combine in JAX merges the S partial statistics ([S, T], not [T, V]):

    M = max_j m_j,  Sum = Σ_j s_j e^{m_j − M},  lse = M + log Sum,
    E_p[z] = Σ_j sz_j e^{m_j − M} / Sum

Backward, from the saved lse and E_p[z], recomputing each logit tile z = h W:

    p = e^{z − lse},  dz = g_logp · (onehot_y − p) + g_ent · p · (E_p[z] − z)

- d hidden, grid (T/Bt,): loop over vocab tiles, dh += dz Wᵀ.
- d unembed, grid (V/Bv,): loop over token tiles, dW[:, tile] += hᵀ dz.
Two kernels instead of one with atomics: every output block has one writer, so the
result is deterministic and the same code runs in the CPU interpreter and on TPU.
With bf16 inputs dz is rounded to bf16 for the two gradient matmuls (tensor-core
rate, as flash attention does with its score gradient); statistics stay float32.

T and V are padded up to the blocks: padded vocab columns are masked (z → −1e30 forward,
dz → 0 backward), padded tokens carry zero cotangents and are sliced off. On the GPU
(Triton) every loaded block must be a power of two and a dot at least 16 wide, so D is
zero-padded there (zero columns change no dot product).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG = -1e30  # "minus infinity" that keeps exp() and arithmetic finite in padded columns


def _dot(a, b, contract=(1, 0)):
    """float32-accumulated a·b contracting a's dim contract[0] with b's contract[1].
    HIGHEST: float32 inputs get full-precision (not TF32) products on the GPU."""
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               preferred_element_type=jnp.float32,
                               precision=jax.lax.Precision.HIGHEST)


def _fwd_kernel(h_ref, w_ref, m_ref, s_ref, sz_ref, *, v, bv, tiles, ragged):
    j = pl.program_id(1)
    h = h_ref[...]
    bt = h.shape[0]

    def body(k, carry):
        m, s, sz = carry
        z = _dot(h, w_ref[:, pl.ds(pl.multiple_of(k * bv, bv), bv)])     # [Bt, Bv]
        if ragged:
            col = (j * tiles + k) * bv + jax.lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
            z = jnp.where(col < v, z, _NEG)
        m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new)
        return (m_new, s * scale + jnp.sum(e, axis=1, keepdims=True),
                sz * scale + jnp.sum(e * z, axis=1, keepdims=True))

    init = (jnp.full((bt, 1), _NEG, jnp.float32), jnp.zeros((bt, 1), jnp.float32),
            jnp.zeros((bt, 1), jnp.float32))
    m, s, sz = jax.lax.fori_loop(0, tiles, body, init)
    m_ref[...], s_ref[...], sz_ref[...] = m, s, sz


def _dz(h, w, col, y, lse, ez, gl, ge, v, ragged):
    """The logit-tile cotangent (module docstring), in float32, cast to the input dtype."""
    z = _dot(h, w)
    p = jnp.exp(z - lse)
    dz = gl * (jnp.where(col == y, 1.0, 0.0) - p) + ge * p * (ez - z)
    if ragged:
        dz = jnp.where(col < v, dz, 0.0)
    return dz.astype(w.dtype)


def _dh_kernel(h_ref, w_ref, y_ref, lse_ref, ez_ref, gl_ref, ge_ref, dh_ref, *,
               v, bv, tiles, ragged):
    h = h_ref[...]
    stats = (y_ref[...], lse_ref[...], ez_ref[...], gl_ref[...], ge_ref[...])
    bt = h.shape[0]

    def body(k, acc):
        start = pl.multiple_of(k * bv, bv)
        w = w_ref[:, pl.ds(start, bv)]                                     # [D, Bv]
        col = start + jax.lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
        return acc + _dot(_dz(h, w, col, *stats, v, ragged), w, (1, 1))  # [Bt, D]

    dh_ref[...] = jax.lax.fori_loop(0, tiles, body, jnp.zeros(h.shape, jnp.float32))


def _dw_kernel(h_ref, w_ref, y_ref, lse_ref, ez_ref, gl_ref, ge_ref, dw_ref, *,
               v, bt, tiles, ragged):
    w = w_ref[...]
    bv = w.shape[1]
    col = pl.program_id(0) * bv + jax.lax.broadcasted_iota(jnp.int32, (bt, bv), 1)

    def body(k, acc):
        rows = pl.ds(pl.multiple_of(k * bt, bt), bt)
        h = h_ref[rows, :]                                                 # [Bt, D]
        stats = [r[rows, :] for r in (y_ref, lse_ref, ez_ref, gl_ref, ge_ref)]
        return acc + _dot(h, _dz(h, w, col, *stats, v, ragged), (0, 0))  # [D, Bv]

    dw_ref[...] = jax.lax.fori_loop(0, tiles, body, jnp.zeros(w.shape, jnp.float32))


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _padded(hidden_TxD, unembed_DxV, tp, vp, gpu):
    """Zero-padded h [Tp, Dp], W [Dp, Vp] in one dtype (Triton dots need equal operand
    types)."""
    t, d = hidden_TxD.shape
    dtype = jnp.promote_types(hidden_TxD.dtype, unembed_DxV.dtype)
    dp = max(16, _pow2(d)) if gpu else d
    h = jnp.pad(hidden_TxD.astype(dtype), ((0, tp - t), (0, dp - d)))
    w = jnp.pad(unembed_DxV.astype(dtype), ((0, dp - d), (0, vp - unembed_DxV.shape[1])))
    return h, w, dp


def _params(block, interpret, warps):
    if interpret or jax.default_backend() != "gpu":
        return None  # Triton's knobs mean nothing to the interpreter or to Mosaic (TPU)
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=warps, num_stages=block.num_stages)


def _col(x_T, tp, dtype=jnp.float32):
    return jnp.pad(x_T.astype(dtype), (0, tp - x_T.shape[0]))[:, None]


def stats_pallas(hidden_TxD, unembed_DxV, block, interpret: bool):
    """(lse_T, E_p[z]_T), float32, via the forward kernel."""
    t = hidden_TxD.shape[0]
    v = unembed_DxV.shape[1]
    bt, bv = block.tokens, block.vocab
    tiles = min(block.vocab_tiles, -(-v // bv))
    splits = -(-v // (bv * tiles))
    tp, vp = -(-t // bt) * bt, splits * tiles * bv
    h, w, dp = _padded(hidden_TxD, unembed_DxV, tp, vp, not interpret)
    part = jax.ShapeDtypeStruct((splits * tp, 1), jnp.float32)
    # Partial statistics of program (i, j) land in rows [j·Tp + i·Bt, +Bt).
    out_block = pl.BlockSpec((bt, 1), lambda i, j: (j * (tp // bt) + i, 0))
    kernel = functools.partial(_fwd_kernel, v=v, bv=bv, tiles=tiles, ragged=vp != v)
    m, s, sz = pl.pallas_call(
        kernel,
        grid=(tp // bt, splits),
        in_specs=[pl.BlockSpec((bt, dp), lambda i, j: (i, 0)),
                  pl.BlockSpec((dp, tiles * bv), lambda i, j: (0, j))],
        out_specs=[out_block] * 3,
        out_shape=[part] * 3,
        compiler_params=_params(block, interpret, block.num_warps),
        interpret=interpret,
    )(h, w)
    m, s, sz = (x.reshape(splits, tp)[:, :t] for x in (m, s, sz))
    if splits == 1:
        return m[0] + jnp.log(s[0]), sz[0] / s[0]
    big = jnp.max(m, axis=0)
    scale = jnp.exp(m - big)
    total = jnp.sum(s * scale, axis=0)
    return big + jnp.log(total), jnp.sum(sz * scale, axis=0) / total


def backward_pallas(hidden_TxD, unembed_DxV, targets_T, lse_T, ez_T, g_logp_T, g_ent_T,
                    block, interpret: bool):
    """(d hidden [T, D], d unembed [D, V]) in float32, via the two backward kernels."""
    t, d = hidden_TxD.shape
    v = unembed_DxV.shape[1]
    bt_h, bv_h, bt_w, bv_w = block.dh_tokens, block.dh_vocab, block.dw_tokens, block.dw_vocab
    lt, lv = math.lcm(bt_h, bt_w), math.lcm(bv_h, bv_w)  # padded T, V fit both kernels
    tp, vp = -(-t // lt) * lt, -(-v // lv) * lv
    h, w, dp = _padded(hidden_TxD, unembed_DxV, tp, vp, not interpret)
    cols = (_col(targets_T, tp, jnp.int32), _col(lse_T, tp), _col(ez_T, tp),
            _col(g_logp_T, tp), _col(g_ent_T, tp))  # zero cotangent on padded tokens
    whole_h = pl.BlockSpec((tp, dp), lambda i: (0, 0))
    whole_w = pl.BlockSpec((dp, vp), lambda i: (0, 0))
    params = _params(block, interpret, block.bwd_num_warps)
    dh = pl.pallas_call(
        functools.partial(_dh_kernel, v=v, bv=bv_h, tiles=vp // bv_h, ragged=vp != v),
        grid=(tp // bt_h,),
        in_specs=[pl.BlockSpec((bt_h, dp), lambda i: (i, 0)), whole_w]
        + [pl.BlockSpec((bt_h, 1), lambda i: (i, 0))] * 5,
        out_specs=pl.BlockSpec((bt_h, dp), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((tp, dp), jnp.float32),
        compiler_params=params, interpret=interpret,
    )(h, w, *cols)
    dw = pl.pallas_call(
        functools.partial(_dw_kernel, v=v, bt=bt_w, tiles=tp // bt_w, ragged=vp != v),
        grid=(vp // bv_w,),
        in_specs=[whole_h, pl.BlockSpec((dp, bv_w), lambda j: (0, j))]
        + [pl.BlockSpec((tp, 1), lambda j: (0, 0))] * 5,
        out_specs=pl.BlockSpec((dp, bv_w), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((dp, vp), jnp.float32),
        compiler_params=params, interpret=interpret,
    )(h, w, *cols)
    return dh[:t, :d], dw[:d, :v]

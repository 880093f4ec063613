"""Pallas kernels of the fused log-prob op (fused_logprob.py has the math), run by the
custom VJP of `fused_logprob.pallas` (rows "pallas_gpu" / "pallas_tpu" of LOGPROB_IMPLS).

Letters: T tokens, D model, V vocab, W vocab columns of one backward chunk, J = ⌈V / W⌉
chunks, Bt token block, Bv vocab tile, Bd D slice; Tp, Dp, Vp: T, D, V padded up to
their blocks; `tiles` vocab tiles per forward program, `splits` = ⌈V / (tiles·Bv)⌉
vocab splits of the forward grid; U the unembedding matrix (unembed_DxV).

Forward, grid (T/Bt, splits): program (i, j) streams `tiles` vocab tiles of its token
block through the online log-sum-exp and takes z_y from the tile holding it; each logit
tile z = h U[:, tile] (a matmul K loop over D in Bd slices, float32 accumulation) is
consumed in registers. With splits > 1 (more programs than token blocks alone give) a
small JAX combine merges the partial statistics ([splits, T], not [T, V]). The
distribution (`logprobs_pallas`) recomputes each tile on the same grid and writes z − lse
[T, V]: a token's numbers come from its own row of fixed tiles in a fixed order, whatever
the other rows, and its entry at a target is the forward's z_y − lse bit for bit.

Backward, from the saved lse and E_p[z]: a `lax.scan` over J chunks of W =
`block.bwd_chunk` columns; per chunk the dz kernel, grid (T/Bt, W/Bv), recomputes each
logit tile and writes dz as [T, W] in the input dtype (O(T·W) memory, not O(T·V)), and
two XLA matmuls take dh += dz U_cᵀ and dU_c = hᵀ dz (U_c: the chunk's columns): plain
GEMMs at the vendor library's full rate, one writer per output (deterministic), the same
code in the CPU interpreter and on TPU. With bf16 inputs dz is rounded to bf16 for them
(tensor-core rate, like flash attention's score gradient); statistics stay float32.

T and V are padded up to the blocks and the padding sliced off: padded vocab columns are
masked in the forward (z → MASK_VALUE, kernels/dtypes.py) and have zero U columns in the
backward (adding nothing to dh); padded tokens carry zero cotangents. Triton
(`target="gpu"`) needs every loaded block a power of two and a dot at least 16 wide, so D
is zero-padded there (zero columns change no dot product); `target="tpu"` (Mosaic) and the
interpreter need none. The caller names the target and whether to interpret: nothing here
looks at the platform.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stablerl_jax.kernels import TARGETS
from stablerl_jax.kernels.dtypes import MASK_VALUE, kernel_precision


def _dot(a, b, contract=((1,), (0,))):
    """float32-accumulated a·b over `contract` dims (default a @ b) at `kernel_precision`."""
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32,
                               precision=kernel_precision(a.dtype))


def _logits(h_ref, w_ref, cols, bd):
    """z = h U[:, cols], float32 [Bt, Bv]: one dot over all of D, or (bd < D) a K loop of
    bd-wide slices, keeping the operand tiles small enough to pipeline."""
    bt, dp = h_ref.shape
    if bd >= dp:
        return _dot(h_ref[...], w_ref[:, cols])

    def body(k, z):
        ks = pl.ds(pl.multiple_of(k * bd, bd), bd)
        return z + _dot(h_ref[:, ks], w_ref[ks, cols])

    return jax.lax.fori_loop(0, dp // bd, body, jnp.zeros((bt, cols.size), jnp.float32))


def _fwd_kernel(h_ref, w_ref, y_ref, m_ref, s_ref, sz_ref, zy_ref, *, v, bv, bd, tiles,
                ragged):
    j = pl.program_id(1)
    bt = h_ref.shape[0]

    def body(k, carry):
        m, s, sz, zy = carry
        z = _logits(h_ref, w_ref, pl.ds(pl.multiple_of(k * bv, bv), bv), bd)  # [Bt, Bv]
        col = (j * tiles + k) * bv + jax.lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
        if ragged:
            z = jnp.where(col < v, z, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new)
        # The target's logit, picked from this tile (one column at most; the rest add 0).
        zy = zy + jnp.sum(jnp.where(col == y_ref[...], z, 0.0), axis=1, keepdims=True)
        return (m_new, s * scale + jnp.sum(e, axis=1, keepdims=True),
                sz * scale + jnp.sum(e * z, axis=1, keepdims=True), zy)

    zeros = jnp.zeros((bt, 1), jnp.float32)
    init = (jnp.full((bt, 1), MASK_VALUE, jnp.float32), zeros, zeros, zeros)
    m, s, sz, zy = jax.lax.fori_loop(0, tiles, body, init)
    m_ref[...], s_ref[...], sz_ref[...], zy_ref[...] = m, s, sz, zy


def _logp_kernel(h_ref, w_ref, lse_ref, out_ref, *, bv, bd, tiles):
    """log p = z − lse over the program's `tiles` vocab tiles, each z by the forward
    kernel's own `_logits` call on the same blocks, so it carries the forward's bits."""
    def body(k, carry):
        cols = pl.ds(pl.multiple_of(k * bv, bv), bv)
        out_ref[:, cols] = _logits(h_ref, w_ref, cols, bd) - lse_ref[...]
        return carry

    jax.lax.fori_loop(0, tiles, body, 0)


def _dz(z, col, y, lse, ez, gl, ge):
    """The logit-tile cotangent (module docstring), float32."""
    p = jnp.exp(z - lse)
    return gl * (jnp.where(col == y, 1.0, 0.0) - p) + ge * p * (ez - z)


def _dz_kernel(h_ref, w_ref, y_ref, lse_ref, ez_ref, gl_ref, ge_ref, dz_ref, *, bd):
    """One [Bt, Bv] dz tile of the current chunk in the input dtype; targets chunk-relative."""
    bt, bv = dz_ref.shape
    z = _logits(h_ref, w_ref, pl.ds(0, bv), bd)  # w_ref is this program's [Dp, Bv] tile
    col = pl.program_id(1) * bv + jax.lax.broadcasted_iota(jnp.int32, (bt, bv), 1)
    stats = (y_ref[...], lse_ref[...], ez_ref[...], gl_ref[...], ge_ref[...])
    dz_ref[...] = _dz(z, col, *stats).astype(dz_ref.dtype)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _triton(target: str, interpret: bool) -> bool:
    if target not in TARGETS:
        raise ValueError(f"fused_logprob pallas: target={target!r} must be one of {TARGETS}")
    return target == "gpu" and not interpret


def _check_mosaic(block, d: int, target: str, interpret: bool) -> None:
    """Mosaic (TPU) blocks: lanes (last dims) in multiples of 128, sublanes of 8; a D slice
    short of all of D lane-aligned (Mosaic cannot prove a 64-wide slice's alignment and
    refuses the kernel). LOGPROB_TPU_BLOCKS (fused_logprob_impls.py) satisfies all of them."""
    if target != "tpu" or interpret:
        return
    bad = [f"{f}={getattr(block, f)} (a multiple of {m})"
           for f, m in (("tokens", 8), ("bwd_tokens", 8), ("vocab", 128), ("bwd_vocab", 128))
           if getattr(block, f) % m]
    if block.dim < d and block.dim % 128:
        bad.append(f"dim={block.dim} (a multiple of 128, or >= D={d})")
    if bad:
        raise ValueError("fused_logprob pallas, target='tpu': LogprobBlocks needs "
                         + ", ".join(bad) + "; use fused_logprob_impls.LOGPROB_TPU_BLOCKS")


def _padded(hidden_TxD, unembed_DxV, tp, vp, bd, triton):
    """Zero-padded h [Tp, Dp], U [Dp, Vp] in one dtype (Triton dots need equal operand
    types), Dp a multiple of the D slice; and that slice, at most Dp."""
    t, d = hidden_TxD.shape
    dtype = jnp.promote_types(hidden_TxD.dtype, unembed_DxV.dtype)
    dp = max(16, _pow2(d)) if triton else d
    bd = min(bd, dp)
    dp = -(-dp // bd) * bd
    h = jnp.pad(hidden_TxD.astype(dtype), ((0, tp - t), (0, dp - d)))
    w = jnp.pad(unembed_DxV.astype(dtype), ((0, dp - d), (0, vp - unembed_DxV.shape[1])))
    return h, w, bd


def _interp(interpret: bool):
    """The checking interpreter: out-of-block reads raise, unwritten memory reads NaN, so
    the CPU tests catch indexing that compiled code would get wrong silently."""
    return pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan") \
        if interpret else False


def _params(block, triton: bool):
    if not triton:
        return None  # Triton's knobs mean nothing to the interpreter or to Mosaic (TPU)
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=block.num_warps, num_stages=block.num_stages)


def _col(x_T, tp, dtype=jnp.float32):
    return jnp.pad(x_T.astype(dtype), (0, tp - x_T.shape[0]))[:, None]


class _Grid(NamedTuple):
    """The forward grid: padded operands h [Tp, Dp], w [Dp, Vp], and its sizes."""

    h: jax.Array
    w: jax.Array
    t: int
    v: int
    bt: int
    bv: int
    bd: int
    tiles: int
    splits: int
    tp: int
    triton: bool
    interpret: bool

    def call(self, kernel, out_specs, out_shape, block, *cols):
        """pallas_call of `kernel` over the grid: program (i, j) reads token block i,
        vocab split j (`tiles` tiles of Bv columns) and the [Bt, 1] blocks of `cols`."""
        row = pl.BlockSpec((self.bt, 1), lambda i, j: (i, 0))
        dp = self.h.shape[1]
        return pl.pallas_call(
            kernel,
            grid=(self.tp // self.bt, self.splits),
            in_specs=[pl.BlockSpec((self.bt, dp), lambda i, j: (i, 0)),
                      pl.BlockSpec((dp, self.tiles * self.bv), lambda i, j: (0, j))]
            + [row] * len(cols),
            out_specs=out_specs, out_shape=out_shape,
            compiler_params=_params(block, self.triton),
            interpret=_interp(self.interpret),
        )(self.h, self.w, *cols)


def _forward_grid(hidden_TxD, unembed_DxV, block, target: str, interpret: bool) -> _Grid:
    t, v = hidden_TxD.shape[0], unembed_DxV.shape[1]
    bt, bv = block.tokens, block.vocab
    tiles = min(block.vocab_tiles, -(-v // bv))
    splits = -(-v // (bv * tiles))
    tp, vp = -(-t // bt) * bt, splits * tiles * bv
    triton = _triton(target, interpret)
    _check_mosaic(block, hidden_TxD.shape[1], target, interpret)
    h, w, bd = _padded(hidden_TxD, unembed_DxV, tp, vp, block.dim, triton)
    return _Grid(h, w, t, v, bt, bv, bd, tiles, splits, tp, triton, interpret)


def _stats(g: _Grid, targets_T, block):
    """(lse_T, E_p[z]_T, z_y_T) on the grid's padded operands (`stats_pallas`)."""
    part = jax.ShapeDtypeStruct((g.splits * g.tp, 1), jnp.float32)
    # Partial statistics of program (i, j) land in rows [j·Tp + i·Bt, +Bt).
    out_block = pl.BlockSpec((g.bt, 1), lambda i, j: (j * (g.tp // g.bt) + i, 0))
    kernel = functools.partial(_fwd_kernel, v=g.v, bv=g.bv, bd=g.bd, tiles=g.tiles,
                               ragged=g.splits * g.tiles * g.bv != g.v)
    m, s, sz, zy = g.call(kernel, [out_block] * 4, [part] * 4, block,
                          _col(targets_T, g.tp, jnp.int32))
    m, s, sz, zy = (x.reshape(g.splits, g.tp)[:, :g.t] for x in (m, s, sz, zy))
    if g.splits == 1:
        return m[0] + jnp.log(s[0]), sz[0] / s[0], zy[0]
    big = jnp.max(m, axis=0)
    scale = jnp.exp(m - big)
    total = jnp.sum(s * scale, axis=0)
    # One split holds the target; the others add exact zeros.
    return big + jnp.log(total), jnp.sum(sz * scale, axis=0) / total, jnp.sum(zy, axis=0)


def stats_pallas(hidden_TxD, unembed_DxV, targets_T, block, target: str, interpret: bool):
    """(lse_T, E_p[z]_T, z_y_T), float32, by the forward kernel; z_y from its own tile."""
    return _stats(_forward_grid(hidden_TxD, unembed_DxV, block, target, interpret),
                  targets_T, block)


def logprobs_pallas(hidden_TxD, unembed_DxV, block, target: str, interpret: bool):
    """log softmax(h U), float32 [T, V] (module docstring): `stats_pallas`'s
    lse, then the logits again on the same grid and padded operands."""
    g = _forward_grid(hidden_TxD, unembed_DxV, block, target, interpret)
    lse_T = _stats(g, jnp.zeros((g.t,), jnp.int32), block)[0]
    logp = g.call(functools.partial(_logp_kernel, bv=g.bv, bd=g.bd, tiles=g.tiles),
                  pl.BlockSpec((g.bt, g.tiles * g.bv), lambda i, j: (i, j)),
                  jax.ShapeDtypeStruct((g.tp, g.w.shape[1]), jnp.float32), block,
                  _col(lse_T, g.tp))
    return logp[:g.t, :g.v]


def backward_pallas(hidden_TxD, unembed_DxV, targets_T, lse_T, ez_T, g_logp_T, g_ent_T,
                    block, target: str, interpret: bool):
    """(dh [T, D], dU [D, V]), float32 (module docstring); W: `block.bwd_chunk`, Bv-rounded."""
    t, d = hidden_TxD.shape
    v = unembed_DxV.shape[1]
    bt, bv = block.bwd_tokens, block.bwd_vocab
    c = -(-min(block.bwd_chunk, v) // bv) * bv
    n = -(-v // c)
    tp = -(-t // bt) * bt
    triton = _triton(target, interpret)
    _check_mosaic(block, d, target, interpret)
    h, w, bd = _padded(hidden_TxD, unembed_DxV, tp, n * c, block.dim, triton)
    dp = h.shape[1]
    stats = [_col(x, tp) for x in (lse_T, ez_T, g_logp_T, g_ent_T)]  # zero g on padded rows
    tok = lambda i, j: (i, 0)
    dz_call = pl.pallas_call(
        functools.partial(_dz_kernel, bd=bd),
        grid=(tp // bt, c // bv),
        in_specs=[pl.BlockSpec((bt, dp), tok), pl.BlockSpec((dp, bv), lambda i, j: (0, j))]
        + [pl.BlockSpec((bt, 1), tok)] * 5,
        out_specs=pl.BlockSpec((bt, bv), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((tp, c), h.dtype),
        compiler_params=_params(block, triton), interpret=_interp(interpret),
    )

    def body(dh, k):
        w_c = jax.lax.dynamic_slice_in_dim(w, k * c, c, axis=1)              # [Dp, W]
        dz = dz_call(h, w_c, _col(targets_T - k * c, tp, jnp.int32), *stats)  # [Tp, W]
        return dh + _dot(dz, w_c, ((1,), (1,))), _dot(dz, h, ((0,), (0,)))  # dU_cᵀ [W, Dp]

    dh, dwt = jax.lax.scan(body, jnp.zeros(h.shape, jnp.float32), jnp.arange(n))
    return dh[:t, :d], dwt.reshape(n * c, dp)[:v, :d].T

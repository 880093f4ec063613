"""Grouped matmul as Pallas kernels with a custom VJP (the MoE expert FFN on
accelerators): `pallas`, the rows "pallas_gpu" / "pallas_tpu" of gmm_impls.GMM_IMPLS.

Letters: R rows (sorted by group), D input width, F output width (rhs [E, D, F]), E groups
(experts), Bm row tile, Bn output-column tile, Bk contraction slice, J = R / Bm row tiles.

The contract is the reference's (the pure-JAX `gmm.loop`, beside this file). Bm divides
`tile`, so each row tile is one group's and a tile → group map (`_metadata`, computed in
JAX from group_sizes) is all a kernel needs; tiles past the last group (the static buffer
is sized for the worst case) write zeros and skip their matmul, so the FLOPs are the
routed rows'. Kernels, accumulating in float32 (float64 for float64 operands): gmm, grid
(J, F/Bn), program (i, j) multiplying row tile i by column tile j of its group's matrix
over Bk slices (`transpose_rhs` contracts rhs's last axis: d lhs = d out · rhs[g]ᵀ,
grid (J, D/Bn)); tgmm, d rhs[e] = Σ_{rows r of e} lhs[r]ᵀ d out[r], one [Bk, Bn] output
tile per program summed over its group's row tiles.

Two lowerings, chosen by `target`, never by the platform (`interpret=True` runs either in
Pallas's checking interpreter):
- "tpu" (Mosaic): the map is scalar-prefetched (SMEM) and the BlockSpec index maps use it
  to DMA the group's weight tile (as megablox does). tgmm walks the row tiles as the
  innermost ("arbitrary") grid axis, revisiting its output block while the group stays
  the same and flushing a float32 VMEM accumulator at the group's last tile; groups with
  no rows are never visited, and are zeroed outside the kernel. Blocks are multiples of
  (8, 128) or whole dimensions.
- "gpu" (Triton): no scalar prefetch, so the map is an ordinary input and the operands
  whole-array refs the kernel slices itself; tgmm runs one program per (group, output
  tile), looping over the group's row tiles. Loaded slices must be powers of two ≥ 16: a
  dimension the block does not divide is zero-padded (zeros add nothing).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stablerl_jax.kernels import TARGETS
from stablerl_jax.kernels.dtypes import accum_dtype, kernel_precision
from stablerl_jax.kernels.gmm import HIGHEST
from stablerl_jax.kernels.gmm_impls import GmmBlocks


def _metadata(group_sizes_E, rows: int, bm: int):
    """(group_J, row_J, active_1, start_E, end_E): each row tile's group and the tile its
    operands are read from (inactive tiles re-read the last active one, so a TPU pipeline
    skips the copy), the active tile count, and each group's tile range."""
    sizes = group_sizes_E.astype(jnp.int32)
    end_E = jnp.cumsum(sizes) // bm
    start_E = end_E - sizes // bm
    active = end_E[-1]
    tiles = jnp.arange(rows // bm, dtype=jnp.int32)
    group_J = jnp.clip(jnp.searchsorted(end_E, tiles, side="right"), 0, sizes.shape[0] - 1)
    row_J = jnp.minimum(tiles, jnp.maximum(active - 1, 0))
    return group_J.astype(jnp.int32), row_J, active[None], start_E, end_E


def _kloop(lhs_slice, rhs_slice, k: int, bk: int, contract, shape, acc):
    """Σ over the contraction's Bk slices of lhs_slice(ks) · rhs_slice(ks), in `acc`."""
    def dot(ks):
        a, b = lhs_slice(ks), rhs_slice(ks)
        return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=acc,
                                   precision=kernel_precision(a.dtype))

    if bk >= k:
        return dot(pl.ds(0, k))
    body = lambda kk, a: a + dot(pl.ds(pl.multiple_of(kk * bk, bk), bk))
    return jax.lax.fori_loop(0, k // bk, body, jnp.zeros(shape, acc))


def _gmm_kernel(*refs, k, bk, transpose, tpu):
    """One [Bm, Bn] output tile (module docstring)."""
    if tpu:  # blocks already chosen by the prefetch-driven index maps
        _, _, active_ref, lhs_ref, rhs_ref, out_ref = refs
        lhs = lambda ks: lhs_ref[:, ks]
        rhs = (lambda ks: rhs_ref[:, ks]) if transpose else (lambda ks: rhs_ref[ks, :])
    else:  # whole-array refs: slice the group's tile here
        group_ref, active_ref, lhs_ref, rhs_ref, out_ref = refs
        bm, bn = out_ref.shape
        i, j = pl.program_id(0), pl.program_id(1)
        g = group_ref[i]
        rows, cols = pl.ds(pl.multiple_of(i * bm, bm), bm), pl.ds(pl.multiple_of(j * bn, bn), bn)
        lhs = lambda ks: lhs_ref[rows, ks]
        rhs = (lambda ks: rhs_ref[g, cols, ks]) if transpose else (lambda ks: rhs_ref[g, ks, cols])
    active = pl.program_id(0) < active_ref[0]
    contract = ((1,), (1,)) if transpose else ((1,), (0,))

    @pl.when(active)
    def _():
        acc = _kloop(lhs, rhs, k, bk, contract, out_ref.shape, accum_dtype(out_ref.dtype))
        out_ref[...] = acc.astype(out_ref.dtype)

    @pl.when(jnp.logical_not(active))
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


def _tgmm_kernel_tpu(group_ref, row_ref, active_ref, lhs_ref, dout_ref, out_ref, acc_ref):
    """Program (a, b, t): row tile t's contribution to its group's [Bk, Bn] tile."""
    del row_ref
    t, n = pl.program_id(2), pl.num_programs(2)
    g = group_ref[t]
    first = (t == 0) | (g != group_ref[jnp.maximum(t - 1, 0)])
    last = (t == n - 1) | (g != group_ref[jnp.minimum(t + 1, n - 1)])

    @pl.when(first)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    @pl.when(t < active_ref[0])
    def _():
        acc_ref[...] += jax.lax.dot_general(
            lhs_ref[...], dout_ref[...], (((0,), (0,)), ((), ())),
            preferred_element_type=acc_ref.dtype, precision=kernel_precision(lhs_ref.dtype))

    @pl.when(last)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _tgmm_kernel_gpu(start_ref, end_ref, lhs_ref, dout_ref, out_ref, *, bm):
    """Program (e, a, b): Σ over group e's row tiles of lhs_tileᵀ · dout_tile."""
    e, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bk, bn = out_ref.shape
    ka, nb = pl.ds(pl.multiple_of(a * bk, bk), bk), pl.ds(pl.multiple_of(b * bn, bn), bn)

    def body(t, acc):
        rows = pl.ds(pl.multiple_of(t * bm, bm), bm)
        return acc + jax.lax.dot_general(lhs_ref[rows, ka], dout_ref[rows, nb],
                                         (((0,), (0,)), ((), ())),
                                         preferred_element_type=acc.dtype,
                                         precision=kernel_precision(lhs_ref.dtype))

    acc = jax.lax.fori_loop(start_ref[e], end_ref[e], body,
                            jnp.zeros(out_ref.shape, accum_dtype(out_ref.dtype)))
    out_ref[...] = acc.astype(out_ref.dtype)


def _fit(dim: int, want: int, pad: bool) -> tuple[int, int]:
    """(block, padded dim): `want` if it divides dim; else, for Triton, dim padded to a
    multiple of it; else one block of the whole dim (always legal in Mosaic)."""
    if dim % want == 0:
        return want, dim
    return (want, -(-dim // want) * want) if pad else (dim, dim)


def _pad(x, widths):
    return x if not any(widths) else jnp.pad(x, [(0, w) for w in widths])


def _interp(interpret: bool):
    return pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan") \
        if interpret else False


def _params(block: GmmBlocks, tpu: bool, semantics, interpret: bool, t: bool = False):
    if interpret:
        return None
    if tpu:
        vmem = block.vmem_limit_mib * 2**20 or None
        return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem)
    from jax.experimental.pallas import triton as pltriton
    if t:
        return pltriton.CompilerParams(num_warps=block.t_num_warps,
                                       num_stages=block.t_num_stages)
    return pltriton.CompilerParams(num_warps=block.num_warps, num_stages=block.num_stages)


def _gmm_call(lhs, rhs, group_sizes_E, tile, block, target, interpret, transpose):
    """With rhs [E, D, F]: lhs [R, D] @ rhs[g] → [R, F], or (transpose) lhs [R, F] @
    rhs[g]ᵀ → [R, D]; k is the contraction width, n the output width."""
    rows, k = lhs.shape
    n = rhs.shape[1] if transpose else rhs.shape[2]
    tpu, triton = target == "tpu", target == "gpu" and not interpret
    bm = math.gcd(block.rows, tile)
    bk, kp = _fit(k, block.depth, triton)
    bn, np_ = _fit(n, block.cols, triton)
    out_dtype = lhs.dtype
    lhs = _pad(lhs, (0, kp - k))
    rhs = _pad(rhs, (0, np_ - n, kp - k) if transpose else (0, kp - k, np_ - n))
    group_J, row_J, active, _, _ = _metadata(group_sizes_E, rows, bm)
    kernel = functools.partial(_gmm_kernel, k=kp, bk=bk, transpose=transpose, tpu=tpu)
    out_shape = jax.ShapeDtypeStruct((rows, np_), out_dtype)
    grid = (rows // bm, np_ // bn)
    if tpu:
        rhs_block = (None, bn, kp) if transpose else (None, kp, bn)
        rhs_index = ((lambda i, j, g, r, a: (g[i], j, 0)) if transpose
                     else (lambda i, j, g, r, a: (g[i], 0, j)))
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=grid,
            in_specs=[pl.BlockSpec((bm, kp), lambda i, j, g, r, a: (r[i], 0)),
                      pl.BlockSpec(rhs_block, rhs_index)],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, g, r, a: (i, j)))
        out = pl.pallas_call(kernel, out_shape=out_shape, grid_spec=spec,
                             compiler_params=_params(block, True, ("parallel", "parallel"),
                                                     interpret),
                             interpret=_interp(interpret))(group_J, row_J, active, lhs, rhs)
    else:
        whole = pl.BlockSpec()
        out = pl.pallas_call(kernel, out_shape=out_shape, grid=grid,
                             in_specs=[whole] * 4,
                             out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                             compiler_params=_params(block, False, None, interpret),
                             interpret=_interp(interpret))(group_J, active, lhs, rhs)
    return out[:, :n] if np_ != n else out


def _tgmm_call(lhs_RxD, dout_RxF, group_sizes_E, tile, rhs_dtype, block, target, interpret):
    """d rhs [E, D, F]: d rhs[e] = Σ_{rows of e} lhsᵀ · d out."""
    rows, k = lhs_RxD.shape
    n = dout_RxF.shape[1]
    e = group_sizes_E.shape[0]
    tpu, triton = target == "tpu", target == "gpu" and not interpret
    bm = math.gcd(block.t_rows, tile)
    bk, kp = _fit(k, block.t_depth, triton)
    bn, np_ = _fit(n, block.t_cols, triton)
    lhs, dout = _pad(lhs_RxD, (0, kp - k)), _pad(dout_RxF, (0, np_ - n))
    group_J, row_J, active, start_E, end_E = _metadata(group_sizes_E, rows, bm)
    out_shape = jax.ShapeDtypeStruct((e, kp, np_), rhs_dtype)
    if tpu:
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(kp // bk, np_ // bn, rows // bm),
            in_specs=[pl.BlockSpec((bm, bk), lambda a, b, t, g, r, n_: (r[t], a)),
                      pl.BlockSpec((bm, bn), lambda a, b, t, g, r, n_: (r[t], b))],
            out_specs=pl.BlockSpec((None, bk, bn), lambda a, b, t, g, r, n_: (g[t], a, b)),
            scratch_shapes=[pltpu.VMEM((bk, bn), accum_dtype(rhs_dtype))])
        out = pl.pallas_call(
            _tgmm_kernel_tpu, out_shape=out_shape, grid_spec=spec,
            compiler_params=_params(block, True, ("parallel", "parallel", "arbitrary"),
                                    interpret),
            interpret=_interp(interpret))(group_J, row_J, active, lhs, dout)
        # Groups without rows are never visited: their blocks hold whatever was there.
        out = jnp.where((group_sizes_E > 0)[:, None, None], out, jnp.zeros((), rhs_dtype))
    else:
        whole = pl.BlockSpec()
        out = pl.pallas_call(
            functools.partial(_tgmm_kernel_gpu, bm=bm), out_shape=out_shape,
            grid=(e, kp // bk, np_ // bn), in_specs=[whole] * 4,
            out_specs=pl.BlockSpec((None, bk, bn), lambda g, a, b: (g, a, b)),
            compiler_params=_params(block, False, None, interpret, t=True),
            interpret=_interp(interpret))(start_E, end_E, lhs, dout)
    return out[:, :k, :n] if (kp, np_) != (k, n) else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _gmm(lhs_RxD, rhs_ExDxF, group_sizes_E, tile, block, target, interpret):
    return _gmm_call(lhs_RxD, rhs_ExDxF, group_sizes_E, tile, block, target, interpret, False)


def _gmm_fwd(lhs_RxD, rhs_ExDxF, group_sizes_E, tile, block, target, interpret):
    out = _gmm(lhs_RxD, rhs_ExDxF, group_sizes_E, tile, block, target, interpret)
    return out, (lhs_RxD, rhs_ExDxF, group_sizes_E)


def _gmm_bwd(tile, block, target, interpret, res, dout_RxF):
    lhs_RxD, rhs_ExDxF, group_sizes_E = res
    dout = dout_RxF.astype(lhs_RxD.dtype)
    dlhs = _gmm_call(dout, rhs_ExDxF, group_sizes_E, tile, block, target, interpret, True)
    drhs = _tgmm_call(lhs_RxD, dout, group_sizes_E, tile, rhs_ExDxF.dtype, block, target,
                      interpret)
    return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def pallas(lhs_RxD, rhs_ExDxF, group_sizes_E, tile: int, precision=HIGHEST, *,
           target: str, block: GmmBlocks, interpret: bool = False):
    """Grouped matmul (module docstring), differentiable in lhs and rhs, in lhs's dtype. Full
    products for float32 (bf16 products are exact); `precision` only fills the GroupedMatmul
    contract. `block`: the tiles (GMM_IMPLS' rows bind GMM_GPU_BLOCKS / GMM_TPU_BLOCKS)."""
    del precision
    if target not in TARGETS:
        raise ValueError(f"gmm pallas: target={target!r} must be one of {TARGETS}")
    rows, k = lhs_RxD.shape
    if rows % tile:
        raise ValueError(f"gmm pallas: rows R={rows} must be a multiple of {tile=}")
    if rhs_ExDxF.ndim != 3 or rhs_ExDxF.shape[1] != k:
        raise ValueError(f"gmm pallas: rhs shape {rhs_ExDxF.shape} must be [E, D={k}, F]")
    if group_sizes_E.shape != (rhs_ExDxF.shape[0],):
        raise ValueError(f"gmm pallas: group_sizes shape {group_sizes_E.shape} must be "
                         f"({rhs_ExDxF.shape[0]},)")
    rhs = rhs_ExDxF.astype(lhs_RxD.dtype)
    return _gmm(lhs_RxD, rhs, group_sizes_E.astype(jnp.int32), tile, block,
                target, bool(interpret))

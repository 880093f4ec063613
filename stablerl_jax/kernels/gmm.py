"""The grouped matmul: the dispatcher `gmm(..., impl=name)` and the pure-JAX
implementations (the reference `loop`, `tiles`, `ragged_dot`, `megablox`), named after
their rows of gmm_impls.GMM_IMPLS; the Pallas kernels are in gmm_pallas.py.

Letters: R rows (sorted by group), D input width, F output width, E groups (experts),
W = `tile` rows of a row tile, J = R / W row tiles.

    out[r] = lhs[r] @ rhs[g(r)]        g(r) = the group that row r belongs to

Rows are sorted by group and every group size is a multiple of `tile`, so each tile is
one group's; rows past Σ group_sizes are left zero. `loop` runs over the groups and their
tiles with trip counts read from `group_sizes` at run time: an empty group costs nothing,
and the FLOPs are the routed tokens' plus at most tile−1 padding rows per group. On CPU it
beats `jax.lax.ragged_dot` (a dense masked computation over all groups); on TPU / GPU a
Pallas grouped matmul (gmm_pallas.py, megablox) with the same (lhs, rhs, group_sizes)
contract replaces it (ModelConfig.gmm_impl). Its custom VJP: d lhs = the grouped matmul
of d out with rhsᵀ (the same loop, contracting F); d rhs[e] = Σ over e's tiles of
lhs_tileᵀ · d out_tile. Products run at `precision` (HIGHEST unless told otherwise),
accumulating in float32 (float64 for float64 operands).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from stablerl_jax.kernels import lookup
from stablerl_jax.kernels.dtypes import accum_dtype
from stablerl_jax.kernels.gmm_impls import GMM_IMPLS, GmmBlocks

HIGHEST = jax.lax.Precision.HIGHEST


def _tile_ranges(group_sizes_E: jax.Array, tile: int):
    end_E = jnp.cumsum(group_sizes_E) // tile
    return end_E - group_sizes_E // tile, end_E


def _grouped(lhs_RxD, rhs_ExDxF, group_sizes_E, tile: int, transpose_rhs: bool, precision):
    """out = lhs @ rhs[g] (or lhs @ rhs[g]ᵀ when transpose_rhs)."""
    start_E, end_E = _tile_ranges(group_sizes_E, tile)
    out_dim = rhs_ExDxF.shape[1] if transpose_rhs else rhs_ExDxF.shape[2]
    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

    def per_group(e, out):
        w = rhs_ExDxF[e]

        def per_tile(i, out):
            x = jax.lax.dynamic_slice_in_dim(lhs_RxD, i * tile, tile, 0)
            y = jax.lax.dot_general(x, w, (contract, ((), ())), precision=precision,
                                    preferred_element_type=accum_dtype(x.dtype))
            return jax.lax.dynamic_update_slice_in_dim(out, y, i * tile, 0)

        return jax.lax.fori_loop(start_E[e], end_E[e], per_tile, out)

    # The loop carries the products in their accumulation type and rounds once at the end
    # (the same bits as rounding each tile): XLA's CPU backend updates a loop-carried
    # 16-bit buffer by copying it whole on every iteration, a 32-bit one in place.
    out = jnp.zeros((lhs_RxD.shape[0], out_dim), accum_dtype(lhs_RxD.dtype))
    return jax.lax.fori_loop(0, rhs_ExDxF.shape[0], per_group, out).astype(lhs_RxD.dtype)


def _tgmm(lhs_RxD, dout_RxF, group_sizes_E, tile: int, rhs_like, precision):
    """d rhs[e] = Σ_{tiles of e} lhsᵀ · dout."""
    start_E, end_E = _tile_ranges(group_sizes_E, tile)
    num_groups, d, f = rhs_like.shape

    def per_group(e, drhs):
        def per_tile(i, acc):
            x = jax.lax.dynamic_slice_in_dim(lhs_RxD, i * tile, tile, 0)
            g = jax.lax.dynamic_slice_in_dim(dout_RxF, i * tile, tile, 0)
            return acc + jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())),
                                             precision=precision,
                                             preferred_element_type=accum_dtype(x.dtype))

        acc = jax.lax.fori_loop(start_E[e], end_E[e], per_tile,
                                jnp.zeros((d, f), accum_dtype(lhs_RxD.dtype)))
        return jax.lax.dynamic_update_index_in_dim(drhs, acc.astype(drhs.dtype), e, 0)

    return jax.lax.fori_loop(0, num_groups, per_group, jnp.zeros_like(rhs_like))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def loop(lhs_RxD: jax.Array, rhs_ExDxF: jax.Array, group_sizes_E: jax.Array,
         tile: int, precision=HIGHEST) -> jax.Array:
    """The reference: a loop over groups and their tiles; custom VJP (module docstring)."""
    if lhs_RxD.shape[0] % tile:
        raise ValueError(f"gmm: rows R={lhs_RxD.shape[0]} must be a multiple of {tile=}")
    if lhs_RxD.shape[1] != rhs_ExDxF.shape[1]:
        raise ValueError(f"gmm: lhs width {lhs_RxD.shape[1]} != rhs input width "
                         f"{rhs_ExDxF.shape[1]}")
    if group_sizes_E.shape != (rhs_ExDxF.shape[0],):
        raise ValueError(f"gmm: group_sizes shape {group_sizes_E.shape} must be "
                         f"({rhs_ExDxF.shape[0]},)")
    return _grouped(lhs_RxD, rhs_ExDxF, group_sizes_E, tile, False, precision)


def _loop_fwd(lhs_RxD, rhs_ExDxF, group_sizes_E, tile, precision):
    out = loop(lhs_RxD, rhs_ExDxF, group_sizes_E, tile, precision)
    return out, (lhs_RxD, rhs_ExDxF, group_sizes_E)


def _loop_bwd(tile, precision, res, dout_RxF):
    lhs_RxD, rhs_ExDxF, group_sizes_E = res
    dlhs = _grouped(dout_RxF, rhs_ExDxF, group_sizes_E, tile, True, precision)
    drhs = _tgmm(lhs_RxD, dout_RxF, group_sizes_E, tile, rhs_ExDxF, precision)
    return dlhs.astype(lhs_RxD.dtype), drhs, None


loop.defvjp(_loop_fwd, _loop_bwd)


def tiles(lhs_RxD: jax.Array, rhs_ExDxF: jax.Array, group_sizes_E: jax.Array,
          tile: int, precision=HIGHEST) -> jax.Array:
    """`loop`'s result by one batched matmul of each tile i (rows [i·tile, (i+1)·tile)) with
    its group's gathered weight ([J, D, F]; tiles past Σ group_sizes give 0): fewer, larger
    ops, faster where per-op overhead dominates (small models on CPU), at one weight copy
    per tile; JAX's VJP."""
    if lhs_RxD.shape[0] % tile:
        raise ValueError(f"gmm tiles: rows R={lhs_RxD.shape[0]} must be a multiple of {tile=}")
    n = lhs_RxD.shape[0] // tile
    end_E = jnp.cumsum(group_sizes_E) // tile
    tile_J = jnp.arange(n)
    group_J = jnp.minimum(jnp.searchsorted(end_E, tile_J, side="right"), rhs_ExDxF.shape[0] - 1)
    out_JxWxF = jnp.einsum("ntd,ndf->ntf", lhs_RxD.reshape(n, tile, -1), rhs_ExDxF[group_J],
                           precision=precision, preferred_element_type=accum_dtype(lhs_RxD.dtype))
    out_JxWxF = jnp.where((tile_J < end_E[-1])[:, None, None], out_JxWxF, 0)
    return out_JxWxF.reshape(lhs_RxD.shape[0], -1).astype(lhs_RxD.dtype)


def ragged_dot(lhs_RxD, rhs_ExDxF, group_sizes_E, tile, precision=HIGHEST):
    """jax.lax.ragged_dot under the grouped-matmul contract."""
    del tile
    return jax.lax.ragged_dot(lhs_RxD, rhs_ExDxF, group_sizes_E.astype(jnp.int32),
                              precision=precision,
                              preferred_element_type=accum_dtype(lhs_RxD.dtype)).astype(lhs_RxD.dtype)


def megablox(lhs_RxD, rhs_ExDxF, group_sizes_E, tile, precision=HIGHEST, *,
             interpret: bool = False):
    """jax's TPU megablox gmm under the grouped-matmul contract: bf16 / float32 only, Mosaic's
    default precision, rows past Σ group_sizes left unwritten (`moe.experts_grouped` never
    reads them). `interpret`: Pallas's interpreter, any backend."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm
    del precision
    k, n = rhs_ExDxF.shape[1:]
    tiling = (math.gcd(tile, 512), min(k, 512), min(n, 512))
    return megablox_gmm(lhs_RxD, rhs_ExDxF.astype(lhs_RxD.dtype),
                        group_sizes_E.astype(jnp.int32), lhs_RxD.dtype, tiling,
                        interpret=interpret)


def gmm(lhs_RxD, rhs_ExDxF, group_sizes_E, tile: int, precision=HIGHEST, *,
        impl: str = "loop", block: GmmBlocks | None = None, interpret: bool = False):
    """out_RxF, in lhs's dtype, by GMM_IMPLS' row `impl`; `block`, `interpret`: `Impl.load`."""
    fn = lookup(GMM_IMPLS, impl, "gmm: impl").load(block=block, interpret=interpret)
    return fn(lhs_RxD, rhs_ExDxF, group_sizes_E, tile, precision)

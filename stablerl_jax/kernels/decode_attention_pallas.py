"""Ragged decode attention as a Pallas TPU kernel: each row reads only its own key blocks.
`pallas` implements the row "pallas_tpu" of decode_attention_impls.DECODE_IMPLS, `tokens`
that row's per-token kernel (batch-invariant numerics).

Letters: B rows, KV kv heads, Hg query heads per kv head, Dh head width, S key slots,
X slots of one block, L layers (a stacked cache).

The contract is the reference's (`decode_attention.blocks`, beside this file), which
runs every row up to the largest row's last block; past its own, a row meets only fully
masked blocks, which change none of its running max, normalizer and output. This kernel
stops each row at its own last block, so a step reads Σ_b ⌈(last[b] + 1) / X⌉ blocks,
not B · ⌈(max_b last[b] + 1) / X⌉: paged attention for rows at different lengths.

Layout: one program per row (grid (B,), "parallel"). The cache stays in HBM
(`memory_space=pl.ANY`: [L, B, KV, S, Dh] stacked, the layer scalar-prefetched, or one
layer's [B, KV, S, Dh]); the program copies its row's [KV, X, Dh] key and value blocks
itself, double-buffered, for its own block count (scalar-prefetched `last`). Query, mask
row (whole: S int32 per row and layer, 132 KiB at 33,792 slots, against 1 MiB per
key-and-value block of 512 slots × 4 kv heads in bf16) and output are the row's blocks of
an ordinary grid pipeline. Per block and kv head the update is the reference's, clamped
last block included. Head-major cache only ('bksd', ModelConfig.kv_cache_layout): one kv
head's block is then a contiguous [X, Dh] tile, the legal (8, 128) Mosaic shape.
`interpret` runs Pallas's TPU interpreter, DMAs and semaphores included.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stablerl_jax.kernels.dtypes import MASK_VALUE, accum_dtype, kernel_precision


def _online_softmax(q_ref, out_ref, n, copies, tile):
    """Flash-decoding of q_ref [KV, Hg, Dh] over key blocks 0 … n − 1 into out_ref; scores
    [Hg, X] = q kᵀ / √Dh in float32; a row with no allowed key gets zeros, not NaN.
    `copies(j, slot)`: block j's DMAs into buffer `slot` (double-buffered); `tile(j, slot)`:
    (k_of, v_of, allowed), kv head h's [X, Dh] keys and values and the block's counted keys."""
    kv, g, dh = q_ref.shape
    acc = accum_dtype(q_ref.dtype)
    scale = dh ** -0.5
    for c in copies(0, 0):
        c.start()

    def body(j, carry):
        slot = jax.lax.rem(j, 2)

        @pl.when(j + 1 < n)
        def _():
            for c in copies(j + 1, 1 - slot):
                c.start()

        for c in copies(j, slot):
            c.wait()
        k_of, v_of, allowed = tile(j, slot)
        out = []
        for h in range(kv):  # a static loop over the kv heads: [Hg, Dh] · [X, Dh]ᵀ each
            m, l, o = carry[h]
            scores = jax.lax.dot_general(
                q_ref[h], k_of(h), (((1,), (1,)), ((), ())),
                preferred_element_type=acc, precision=kernel_precision(q_ref.dtype)) * scale
            scores = jnp.where(allowed, scores, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
            p = jnp.where(allowed, jnp.exp(scores - m_new), 0)
            corr = jnp.exp(m - m_new)
            pv = jax.lax.dot_general(p.astype(q_ref.dtype), v_of(h),
                                     (((1,), (0,)), ((), ())), preferred_element_type=acc,
                                     precision=kernel_precision(q_ref.dtype))
            out.append((m_new, l * corr + jnp.sum(p, axis=-1, keepdims=True),
                        o * corr + pv))
        return tuple(out)

    init = tuple((jnp.full((g, 1), MASK_VALUE, acc), jnp.zeros((g, 1), acc),
                  jnp.zeros((g, dh), acc)) for _ in range(kv))
    final = jax.lax.fori_loop(0, n, body, init)
    for h, (_, l, o) in enumerate(final):
        out_ref[h] = (o / jnp.where(l > 0, l, 1)).astype(out_ref.dtype)


def _kernel(last_ref, layer_ref, q_ref, mask_ref, k_hbm, v_hbm, out_ref, k_buf, v_buf, sem,
            *, block: int, s: int, stacked: bool):
    """Program b: row b's attention over its blocks 0 … last[b] // X (module docstring)."""
    b = pl.program_id(0)
    last = last_ref[b]
    n = jax.lax.div(last, block) + 1  # lax.div, rem: jnp's // and % lower through sign

    def copies(j, slot):
        start = jnp.minimum(j * block, s - block)
        row = (layer_ref[0], b) if stacked else (b,)
        return [pltpu.make_async_copy(src.at[(*row, slice(None), pl.ds(start, block))],
                                      buf.at[slot], sem.at[i, slot])
                for i, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))]

    def tile(j, slot):
        start = jnp.minimum(j * block, s - block)
        slots = start + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        allowed = (slots >= j * block) & (slots <= last) & (
            mask_ref[:, pl.ds(start, block)] != 0)
        return (lambda h: k_buf[slot, h]), (lambda h: v_buf[slot, h]), allowed

    _online_softmax(q_ref, out_ref, n, copies, tile)


def pallas(q_BxKVxHgxDh, k, v, key_mask_BxS, last_slot, *, block: int, keys: str = "bksd",
           layer=None, target: str = "tpu", interpret: bool = False):
    """decode_attention.py's contract by the ragged kernel; `target` must be "tpu" (Mosaic)."""
    if target != "tpu":
        raise ValueError(f"decode_attention pallas: target={target!r}; only 'tpu' is built")
    if keys != "bksd":
        raise ValueError(f"decode_attention pallas: the KV cache layout must be 'bksd' "
                         f"(head-major), got {keys!r}: set model.kv_cache_layout=bksd")
    b, kv, g, dh = q_BxKVxHgxDh.shape
    stacked = layer is not None
    s = k.shape[-2]
    block = min(block, s)
    dtype = q_BxKVxHgxDh.dtype
    k, v = k.astype(dtype), v.astype(dtype)
    last_B = jnp.broadcast_to(jnp.asarray(last_slot, jnp.int32), (b,))
    layer_1 = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    mask_Bx1xS = key_mask_BxS.astype(jnp.int32)[:, None, :]
    row = lambda i, last, lay: (i, 0, 0, 0)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(b,),
        in_specs=[pl.BlockSpec((None, kv, g, dh), row),
                  pl.BlockSpec((None, 1, s), lambda i, last, lay: (i, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, kv, g, dh), row),
        scratch_shapes=[pltpu.VMEM((2, kv, block, dh), dtype),
                        pltpu.VMEM((2, kv, block, dh), dtype),
                        pltpu.SemaphoreType.DMA((2, 2))])
    kernel = functools.partial(_kernel, block=block, s=s, stacked=stacked)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((b, kv, g, dh), dtype), grid_spec=spec,
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams(out_of_bounds_reads="raise",
                                        uninitialized_memory="nan") if interpret else False,
    )(last_B, layer_1, q_BxKVxHgxDh, mask_Bx1xS, k, v)


ALIGN = 32  # slots: a whole tile of the cache's slot axis for 32-, 16- and 8-bit types


def _window(block: int) -> int:
    """The slots one block's copy spans: `block` rounded up to ALIGN, plus ALIGN."""
    return -(-block // ALIGN) * ALIGN + ALIGN


def cache_slots(length: int, block: int) -> int:
    """Key slots `tokens` needs for `length`: a multiple of ALIGN, at least one `_window`."""
    return max(-(-length // ALIGN) * ALIGN, _window(block))


def _mask_width(s: int, block: int) -> int:
    """Lanes of `tokens`' mask row: S + X slots rounded up to whole 128-lane tiles."""
    return -(-(s + block) // 128) * 128


_PRICED_BLOCKS = contextvars.ContextVar("decode_attention_tokens_priced_blocks",
                                        default=None)


@contextlib.contextmanager
def priced_blocks(blocks: int):
    """Inside it, `tokens` declares `blocks` key blocks per query to XLA's cost analysis
    (a program priced per block: pod/roofline.py's decode step at its first block)."""
    token = _PRICED_BLOCKS.set(blocks)
    try:
        yield
    finally:
        _PRICED_BLOCKS.reset(token)


def token_cost(n: int, kv: int, g: int, dh: int, itemsize: int, block: int, s: int,
               blocks: int) -> pl.CostEstimate:
    """`tokens`' cost as declared to XLA for n queries of `blocks` key blocks against an
    S-slot cache (a Mosaic call is opaque to XLA's cost analysis, which would otherwise count
    whole operands: a stacked cache's every layer): per query its scalars, query, output and
    `_mask_width` int32 mask row; per block a key and a value window (the DMAs), two
    [Hg, Dh]·[X, Dh] products per kv head and Hg·(X + 1) exponentials."""
    per_query = 3 * 4 + 2 * kv * g * dh * itemsize + _mask_width(s, block) * 4
    per_block = 2 * kv * _window(block) * dh * itemsize
    return pl.CostEstimate(flops=n * blocks * kv * 4 * g * dh * block,
                           transcendentals=n * blocks * kv * g * (block + 1),
                           bytes_accessed=n * (per_query + blocks * per_block))


def _token_kernel(pos_ref, row_ref, start_ref, layer_ref, q_ref, mask_ref, k_hbm, v_hbm,
                  out_ref, k_buf, v_buf, mask_buf, sem, *, block: int, s: int, stacked: bool):
    """Program i: query i over positions 0 … pos[i] of its sequence (`tokens`)."""
    i = pl.program_id(0)
    pos, row, start = pos_ref[i], row_ref[i], start_ref[i]
    # The mask from the sequence's first slot on: mask_buf[0, p] is the slot of position p
    # (mask_ref is zero-padded so that no position up to pos wraps around).
    width = mask_ref.shape[-1]
    mask_buf[...] = pltpu.roll(mask_ref[...], jax.lax.rem(width - start, width), 1)
    window = k_buf.shape[2]  # _window(X) slots

    def first(j):
        """Block j's copy start (ALIGN-aligned, in the cache) and its first key's offset."""
        want = start + j * block
        at = jnp.minimum(jax.lax.div(want, ALIGN) * ALIGN, s - window)
        return pl.multiple_of(at, ALIGN), want - at

    at_row = (layer_ref[0], row) if stacked else (row,)

    def copies(j, slot):
        return [pltpu.make_async_copy(src.at[(*at_row, slice(None), pl.ds(first(j)[0], window))],
                                      buf.at[slot], sem.at[c, slot])
                for c, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))]

    def tile(j, slot):
        # The copy starts at or before the block's first key: rotating it back by the
        # offset puts each key where the block's own tile has it (keys that wrap around
        # sit past pos, or past the cache, and are masked), so the tile is the same in
        # any cache. (Mosaic rotates 32-bit words only: a narrower type rotates as
        # float32, exactly.)
        back = jax.lax.rem(window - first(j)[1], window)
        dt = k_buf.dtype
        wide = jnp.float32 if dt.itemsize < 4 else dt
        k_blk, v_blk = (pltpu.roll(buf[slot].astype(wide), back, 1)[:, :block].astype(dt)
                        for buf in (k_buf, v_buf))
        kpos = j * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        allowed = (kpos <= pos) & (
            mask_buf[:, pl.ds(pl.multiple_of(j * block, block), block)] != 0)
        return (lambda h: k_blk[h]), (lambda h: v_blk[h]), allowed

    _online_softmax(q_ref, out_ref, jax.lax.div(pos, block) + 1, copies, tile)


def tokens(q_NxKVxHgxDh, pos_N, row_N, start_N, k, v, key_mask_BxS, *, block: int,
           layer=None, target: str = "tpu", interpret: bool = False):
    """Per-token attention, each result fixed by its query alone (model/invariant.py's
    batch-invariant numerics; the contract is `attend`'s): query n, of row row_N[n] with
    position 0 at slot start_N[n], attends to the slots start … start + pos_N[n] the key
    mask marks real, by the online softmax over blocks of X = `block` *positions* from the
    sequence's start, one program per query. So every query meets the same tiles in a
    decode step, a prefill and the training forward, whatever the cache length, padding,
    packing or other queries, and never reads blocks past pos. A block's keys are copied as
    _window(X) slots from a multiple of ALIGN at or before its first key (a DMA's offset
    along the tiled slot axis must be whole tiles), or from the cache's last window if that
    would run past it, and rotated into place (pltpu.roll). k, v: one layer's head-major cache
    [B, KV, S, Dh], or with `layer` the stacked [L, B, KV, S, Dh] cache read in place; S a
    multiple of ALIGN of at least one window (`cache_slots`: init_cache allocates that many,
    model/invariant.py pads the training forward's keys to it). Returns [N, KV, Hg, Dh] in
    q's dtype, zeros for a query with no real key. Declared cost: `token_cost`, every query
    reading every block, or `priced_blocks`' count inside that context."""
    if target != "tpu":
        raise ValueError(f"decode_attention tokens: target={target!r}; only 'tpu' is built")
    n, kv, g, dh = q_NxKVxHgxDh.shape
    s = k.shape[-2]
    stacked = layer is not None
    if s != cache_slots(s, block):
        raise ValueError(f"decode_attention tokens: {s} key slots; the kernel needs a "
                         f"multiple of {ALIGN} of at least {_window(block)} "
                         f"(cache_slots)")
    dtype = q_NxKVxHgxDh.dtype
    if k.dtype != dtype:
        k, v = k.astype(dtype), v.astype(dtype)
    # Zero slots after the mask so that rolling a row to its start wraps no real slot
    # into positions 0 … pos, and whole blocks of lanes.
    width = _mask_width(s, block)
    mask_Bx1xW = jnp.pad(key_mask_BxS.astype(jnp.int32), ((0, 0), (0, width - s)))[:, None]
    query = lambda i, *_: (i, 0, 0, 0)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(n,),
        in_specs=[pl.BlockSpec((None, kv, g, dh), query),
                  pl.BlockSpec((None, 1, width), lambda i, pos, row, *_: (row[i], 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, kv, g, dh), query),
        scratch_shapes=[pltpu.VMEM((2, kv, _window(block), dh), dtype),
                        pltpu.VMEM((2, kv, _window(block), dh), dtype),
                        pltpu.VMEM((1, width), jnp.int32),
                        pltpu.SemaphoreType.DMA((2, 2))])
    kernel = functools.partial(_token_kernel, block=block, s=s, stacked=stacked)
    as_i32 = lambda a: jnp.asarray(a, jnp.int32)
    blocks = _PRICED_BLOCKS.get() or -(-s // block)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((n, kv, g, dh), dtype), grid_spec=spec,
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams(out_of_bounds_reads="raise",
                                        uninitialized_memory="nan") if interpret else False,
        cost_estimate=token_cost(n, kv, g, dh, jnp.dtype(dtype).itemsize, block, s, blocks),
    )(as_i32(pos_N), as_i32(row_N), as_i32(start_N),
      jnp.reshape(as_i32(0 if layer is None else layer), (1,)), q_NxKVxHgxDh, mask_Bx1xW, k, v)

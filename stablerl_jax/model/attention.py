"""Attention: RMSNorm, RoPE, grouped-query attention with per-head q/k RMSNorm, KV cache.

Letters: B batch, T new tokens, S key slots (T, or the cache length), D model, H query heads, KV
kv heads, Hg = H / KV, Dh head width, L layers, W rows of a query chunk, J chunks.

A slot indexes the sequence buffer (left padding first); a position (RoPE) counts the real tokens
before it, so left padding changes no activation. Query slot i sees key slot j iff j ≤ i and key
j is real; masked scores get the most negative float32, not −inf, so a query with no real key
(padding) yields a finite, unused output, not NaN.

Score paths (ModelConfig.attention_impl), equal on real rows up to float reassociation of the
softmax sums in 'causal': 'naive', one [T, S] matrix per head; 'chunked', a scan over
rematerialized query chunks with only [chunk, S] scores live (what a 33k-token sequence needs);
'causal' (no cache), unrolled query blocks against the keys up to their last row, never computing
the all-masked blocks above the diagonal (about half the scores for a few hundred slots). A
padding row averages the keys its block sees (unused). Decode with ModelConfig.decode_block reads
the cache in blocks of that many slots up to the written slot (flash-decoding;
kernels/decode_attention.py, implementation ModelConfig.decode_attention_impl), equal up to float
reassociation.

Packed rows (stablerl_jax/packing.py): segment ids (one per slot, 0 on padding, non-decreasing
along real tokens) restrict a query to its segment. 'causal' and 'chunked' skip key blocks above
the diagonal or without a key of the query block's segments (a `lax.cond` per block pair, merged
by the online softmax), costing about the sum of the segments' squares; 'naive' masks (the row's
square).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from stablerl_jax import sharding
from stablerl_jax.kernels import lookup
from stablerl_jax.kernels.decode_attention_impls import DECODE_IMPLS
from stablerl_jax.kernels.dtypes import MASK_VALUE
from stablerl_jax.model import numerics as nx


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x²) + eps) · scale, in float32 (or wider); returns x's dtype."""
    acc = nx.accum_dtype(x.dtype)
    xa = x.astype(acc)
    y = xa * jax.lax.rsqrt(jnp.mean(xa * xa, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(acc)).astype(x.dtype)


def rope(x_BxTxHxDh: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split (HF Qwen3 `rotate_half`), in float32 (or wider)."""
    acc = nx.accum_dtype(x_BxTxHxDh.dtype)
    half = x_BxTxHxDh.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=acc) / half)
    angle_BxTx1xF = (positions_BxT.astype(acc)[..., None] * inv_freq)[:, :, None, :]
    cos, sin = jnp.cos(angle_BxTx1xF), jnp.sin(angle_BxTx1xF)
    x = x_BxTxHxDh.astype(acc)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxHxDh.dtype)


def positions_from_mask(mask_BxT: jax.Array, offset_B: jax.Array | None = None,
                        segments_BxT: jax.Array | None = None) -> jax.Array:
    """RoPE positions: real tokens counted from 0, plus `offset_B` (real tokens already cached);
    with `segments_BxT`, from 0 at each segment. Padding gets a neighbouring position."""
    count = jnp.cumsum(mask_BxT.astype(jnp.int32), axis=1)
    if segments_BxT is not None:  # subtract the real tokens before the segment's start
        before = count - mask_BxT.astype(jnp.int32)
        starts = jnp.concatenate([jnp.ones_like(segments_BxT[:, :1], bool),
                                  segments_BxT[:, 1:] != segments_BxT[:, :-1]], axis=1)
        count = count - jax.lax.cummax(jnp.where(starts, before, 0), axis=1)
    pos = jnp.maximum(count - 1, 0)
    return pos if offset_B is None else pos + offset_B[:, None]


def _dot(eq, a, b, dtype):
    """einsum of two `dtype` operands, float32 (or wider) accumulation, PRECISION."""
    return jnp.einsum(eq, a.astype(dtype), b.astype(dtype), precision=nx.PRECISION,
                      preferred_element_type=nx.accum_dtype(dtype))


def _proj(eq, x, w, numerics, dtype):
    return _dot(eq, nx.act_quant(x, numerics), w, dtype).astype(dtype)


def _attend(q_BxTxKVxHgxDh, k, v, query_slots_T, key_mask_BxS, head_dim: int, dtype,
            keys: str = "bskd", segments=None):
    """softmax(q kᵀ / √Dh + mask) v for the queries at `query_slots_T`; k, v in layout `keys`
    ("bskd", or the cache's "bksd"); `segments`: (query_BxT, key_BxS) ids."""
    s = k.shape[keys.index("s")]
    query_slots_BxT = query_slots_T if query_slots_T.ndim == 2 else query_slots_T[None]
    if keys == "bksd":  # batch dims leading on both sides: no transpose of the cache
        q = jnp.transpose(q_BxTxKVxHgxDh, (0, 2, 3, 1, 4))
        scores_BxKVxHgxTxS = _dot("bkgtd,bksd->bkgts", q, k, dtype)
    else:
        scores_BxKVxHgxTxS = _dot("btkgd,bskd->bkgts", q_BxTxKVxHgxDh, k, dtype)
    scores_BxKVxHgxTxS = scores_BxKVxHgxTxS * head_dim**-0.5
    allowed_BxTxS = (jnp.arange(s)[None, None, :] <= query_slots_BxT[:, :, None]) & (
        key_mask_BxS[:, None, :].astype(bool))
    if segments is not None:
        allowed_BxTxS = allowed_BxTxS & (segments[0][:, :, None] == segments[1][:, None, :])
    scores_BxKVxHgxTxS = jnp.where(allowed_BxTxS[:, None, None], scores_BxKVxHgxTxS, MASK_VALUE)
    probs_BxKVxHgxTxS = jax.nn.softmax(scores_BxKVxHgxTxS, axis=-1).astype(dtype)
    if keys == "bksd":
        o = _dot("bkgts,bksd->bkgtd", probs_BxKVxHgxTxS, v, dtype)
        return jnp.transpose(o, (0, 3, 1, 2, 4)).astype(dtype)
    return _dot("bkgts,bskd->btkgd", probs_BxKVxHgxTxS, v, dtype).astype(dtype)


def decode_attention_fn(cfg, mesh=None, rules: dict | None = None):
    """`(q_BxKVxHgxDh, k, v, key_mask_BxS, last_slot, layer) -> [B, KV, Hg, Dh]` from
    DECODE_IMPLS row cfg.decode_attention_impl (kernels/decode_attention.py); Pallas rows, opaque
    to the partitioner, run per device under shard_map on a mesh (rules["batch"])."""
    row = lookup(DECODE_IMPLS, cfg.decode_attention_impl, "decode_attention_impl")
    fn = row.load()

    def call(q, k, v, key_mask_BxS, last_slot, layer):
        return fn(q, k, v, key_mask_BxS, last_slot, block=cfg.decode_block,
                  keys=cfg.kv_cache_layout, layer=layer)

    if not row.pallas or mesh is None or mesh.size == 1:
        return call
    batch = sharding.spec_axes((rules or sharding.RULES)["batch"])
    rows = P(tuple(a for a in batch if mesh.shape[a] > 1) or None)

    def run(q, k, v, key_mask_BxS, last_slot, layer):
        last_B = jnp.broadcast_to(jnp.asarray(last_slot, jnp.int32), (q.shape[0],))
        layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
        stacked = k.ndim == 5
        cache = P(None, *rows) if stacked else rows
        return jax.shard_map(
            lambda q, k, v, m, last, lay: call(q, k, v, m, last, lay if stacked else None),
            mesh=mesh, in_specs=(rows, cache, cache, rows, rows, P()), out_specs=rows,
            check_vma=False)(q, k, v, key_mask_BxS, last_B, layer)

    return run


def _chunked(attend, q_BxTxKVxHgxDh, query_slots_T, chunk: int):
    """`attend(q, slots)` in a scan over rematerialized `chunk`-row query chunks (T padded)."""
    b, t = q_BxTxKVxHgxDh.shape[:2]
    n = -(-t // chunk)
    pad = n * chunk - t
    q = jnp.pad(q_BxTxKVxHgxDh, ((0, 0), (0, pad)) + ((0, 0),) * 3)
    slots = jnp.pad(query_slots_T, (0, pad), mode="edge")
    q_JxBxWxKVxHgxDh = jnp.moveaxis(q.reshape(b, n, chunk, *q.shape[2:]), 1, 0)
    body = jax.checkpoint(lambda _, xs: (None, attend(*xs)), prevent_cse=False)
    _, o = jax.lax.scan(body, None, (q_JxBxWxKVxHgxDh, slots.reshape(n, chunk)))
    return jnp.moveaxis(o, 0, 1).reshape(b, n * chunk, *o.shape[3:])[:, :t]


def _causal(q_BxTxKVxHgxDh, k_BxTxKVxDh, v_BxTxKVxDh, key_mask_BxT, block: int,
            head_dim: int, dtype):
    """Cache-free attention by unrolled `block`-row query blocks: [lo, hi) sees keys [0, hi)."""
    t = q_BxTxKVxHgxDh.shape[1]
    outs = [_attend(q_BxTxKVxHgxDh[:, lo:lo + block], k_BxTxKVxDh[:, :lo + block],
                    v_BxTxKVxDh[:, :lo + block], jnp.arange(lo, min(t, lo + block)),
                    key_mask_BxT[:, :lo + block], head_dim, dtype)
            for lo in range(0, t, block)]
    return jnp.concatenate(outs, axis=1)


def _online_step(carry, q_BxWxKVxHgxDh, k_BxUxKVxDh, v_BxUxKVxDh, allowed_BxWxU,
                 head_dim: int, dtype):
    """One key block of the online softmax on carry (m, l, o); max m is a stop-gradient shift."""
    m, l, o = carry
    scores = _dot("btkgd,bskd->bkgts", q_BxWxKVxHgxDh, k_BxUxKVxDh, dtype) * head_dim**-0.5
    allowed = allowed_BxWxU[:, None, None]
    scores = jnp.where(allowed, scores, MASK_VALUE)
    m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(scores, axis=-1)))
    p = jnp.where(allowed, jnp.exp(scores - m_new[..., None]), 0)
    corr = jnp.exp(m - m_new)
    pv = _dot("bkgts,bskd->bkgtd", p, v_BxUxKVxDh, dtype)
    return m_new, l * corr + jnp.sum(p, axis=-1), o * corr[..., None] + pv


def _online_init(b, kv, g, rows, dh, dtype):
    acc = nx.accum_dtype(dtype)
    return (jnp.full((b, kv, g, rows), MASK_VALUE, acc), jnp.zeros((b, kv, g, rows), acc),
            jnp.zeros((b, kv, g, rows, dh), acc))


def _online_out(carry, dtype):
    """[B, W, KV, Hg, Dh] outputs of a finished online softmax; 0 with no allowed key."""
    _, l, o = carry
    o = o / jnp.where(l > 0, l, 1)[..., None]
    return jnp.transpose(o, (0, 3, 1, 2, 4)).astype(dtype)


def _segment_range(real_BxT, segments_BxT, block: int):
    """(min, max) real-slot segment id per `block`-slot block, [N, B] (none: int32 max, −1)."""
    b, t = segments_BxT.shape
    n = t // block
    real = real_BxT.reshape(b, n, block)
    seg = segments_BxT.reshape(b, n, block)
    lo = jnp.min(jnp.where(real, seg, jnp.iinfo(jnp.int32).max), axis=2)
    hi = jnp.max(jnp.where(real, seg, -1), axis=2)
    return lo.T, hi.T


def _causal_segments(q_BxTxKVxHgxDh, k_BxTxKVxDh, v_BxTxKVxDh, key_mask_BxT, segments_BxT,
                     block: int, head_dim: int, dtype):
    """`_causal` for packed rows: a pair (qb, kb ≤ qb) is computed (else skipped) only if some
    row's largest real segment in kb ≥ its smallest in qb; pairs merge by `_online_step`."""
    b, t, kv, g, dh = q_BxTxKVxHgxDh.shape
    nb = -(-t // block)
    pad = nb * block - t
    real_BxT = key_mask_BxT.astype(bool) & (segments_BxT > 0)
    lo_seg, hi_seg = _segment_range(jnp.pad(real_BxT, ((0, 0), (0, pad))),
                                    jnp.pad(segments_BxT, ((0, 0), (0, pad))), block)
    outs = []
    for qb in range(nb):
        qs = slice(qb * block, min(t, (qb + 1) * block))
        q, seg_q, rows = q_BxTxKVxHgxDh[:, qs], segments_BxT[:, qs], qs.stop - qs.start

        def pair(carry, kb=None, q=q, seg_q=seg_q, qs=qs):
            ks = slice(kb * block, min(t, (kb + 1) * block))
            allowed = ((jnp.arange(ks.start, ks.stop)[None, None] <=
                        jnp.arange(qs.start, qs.stop)[None, :, None])
                       & real_BxT[:, None, ks]
                       & (seg_q[:, :, None] == segments_BxT[:, None, ks]))
            return _online_step(carry, q, k_BxTxKVxDh[:, ks], v_BxTxKVxDh[:, ks], allowed,
                                head_dim, dtype)

        carry = _online_init(b, kv, g, rows, dh, dtype)
        for kb in range(qb + 1):
            need = jnp.any(hi_seg[kb] >= lo_seg[qb])
            carry = jax.lax.cond(need, functools.partial(pair, kb=kb), lambda c: c, carry)
        outs.append(_online_out(carry, dtype))
    return jnp.concatenate(outs, axis=1)


def _chunked_segments(q_BxTxKVxHgxDh, k_BxTxKVxDh, v_BxTxKVxDh, key_mask_BxT,
                      segments_BxT, chunk: int, head_dim: int, dtype):
    """Packed rows' 'chunked' path: `_chunked`'s scan, each chunk looping over key blocks by
    `_causal_segments`' test; one program whatever the packing."""
    b, t, kv, g, dh = q_BxTxKVxHgxDh.shape
    n = -(-t // chunk)
    pad = ((0, 0), (0, n * chunk - t))
    blocks = lambda x: jnp.moveaxis(jnp.pad(x, pad + ((0, 0),) * (x.ndim - 2)).reshape(
        b, n, chunk, *x.shape[2:]), 1, 0)
    real_BxT = jnp.pad(key_mask_BxT.astype(bool) & (segments_BxT > 0), pad)
    seg_BxT = jnp.pad(segments_BxT, pad)
    lo_seg_NxB, hi_seg_NxB = _segment_range(real_BxT, seg_BxT, chunk)
    q_N, k_N, v_N = blocks(q_BxTxKVxHgxDh), blocks(k_BxTxKVxDh), blocks(v_BxTxKVxDh)
    seg_NxBxW = jnp.moveaxis(seg_BxT.reshape(b, n, chunk), 1, 0)
    real_NxBxW = jnp.moveaxis(real_BxT.reshape(b, n, chunk), 1, 0)
    inside = jnp.arange(chunk)

    def query_chunk(_, xs):
        q, seg_q, j = xs

        def key_block(kb, carry):
            def compute(c):
                seg_k, real_k = seg_NxBxW[kb], real_NxBxW[kb]
                allowed = ((kb * chunk + inside[None, None] <= j * chunk + inside[None, :, None])
                           & real_k[:, None] & (seg_q[:, :, None] == seg_k[:, None]))
                return _online_step(c, q, k_N[kb], v_N[kb], allowed, head_dim, dtype)

            need = (kb <= j) & jnp.any(hi_seg_NxB[kb] >= lo_seg_NxB[j])
            return jax.lax.cond(need, compute, lambda c: c, carry)

        carry = jax.lax.fori_loop(0, n, key_block, _online_init(b, kv, g, chunk, dh, dtype))
        return None, _online_out(carry, dtype)

    body = jax.checkpoint(query_chunk, prevent_cse=False)
    _, o = jax.lax.scan(body, None, (q_N, seg_NxBxW, jnp.arange(n)))
    return jnp.moveaxis(o, 0, 1).reshape(b, n * chunk, *o.shape[3:])[:, :t]


def _write(cache: jax.Array, x: jax.Array, put) -> jax.Array:
    """cache with x written in place by `put(cache, x)`; on CPU a 16-bit cache through its bits,
    as XLA's CPU backend would widen a bfloat16 update to float32 and copy the whole cache every
    decode step (on TPU the bit casts would copy it per layer and step)."""
    x = x.astype(cache.dtype)
    if cache.dtype.itemsize != 2:
        return put(cache, x)
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)
    through_bits = lambda c, u: jax.lax.bitcast_convert_type(put(bits(c), bits(u)), c.dtype)
    return jax.lax.platform_dependent(cache, x, cpu=through_bits, default=put)


def _cache_put(keys: str, index, layer, b: int):
    """`_write`'s put for `new` (layout `keys`, T slots) into a stacked (`layer` given) or one
    layer's cache: scalar `index`, T slots a row from it; [B] (T = 1): row r at index[r]."""
    index = jnp.asarray(index, jnp.int32)
    lead = () if layer is None else (jnp.asarray(layer, jnp.int32),)
    if index.ndim == 0:
        zero = jnp.zeros((), jnp.int32)
        at = lead + tuple(index if a == "s" else zero for a in keys)
        return lambda c, u: jax.lax.dynamic_update_slice(c, u if layer is None else u[None],
                                                         at)
    at = lead + tuple({"b": jnp.arange(b), "s": index}.get(a, slice(None)) for a in keys[:3])
    # Both layouts index to [B, KV, Dh] (NumPy moves separated index arrays to the front).
    return lambda c, u: c.at[at].set(jnp.squeeze(u, keys.index("s")))


def attention(p: dict, x_BxTxD: jax.Array, positions_BxT: jax.Array, key_mask_BxS: jax.Array,
              query_slots_T: jax.Array, cfg, numerics: nx.Numerics, dtype,
              cache_kv: tuple[jax.Array, jax.Array] | None = None, cache_index=None,
              layer=None, segments_BxT=None, decode=None):
    """One attention block (no residual): (out_BxTxD, cache_kv updated or None). No cache: keys
    are this call's tokens (S = T). `cache_kv`: the stacked cache ([L, B, S, KV, Dh], or
    [L, B, KV, S, Dh] for cfg.kv_cache_layout 'bksd'; layer `layer`) or one layer's buffers
    (cfg.unroll_layers), written at slots [cache_index, cache_index + T) ([B] `cache_index`: a
    slot per row, T = 1), returned whole for in-place loop updates. `segments_BxT` (no cache):
    packed rows' ids. `decode`: decode attention (`decode_attention_fn`; from cfg when None)."""
    b, t, _ = x_BxTxD.shape
    kv_heads, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    q_BxTxHxDh = _proj("btd,dhk->bthk", x_BxTxD, p["wq"], numerics, dtype)
    k_BxTxKVxDh = _proj("btd,dhk->bthk", x_BxTxD, p["wk"], numerics, dtype)
    v_BxTxKVxDh = _proj("btd,dhk->bthk", x_BxTxD, p["wv"], numerics, dtype)
    q_BxTxHxDh = rope(rms_norm(q_BxTxHxDh, p["q_norm"], cfg.norm_eps), positions_BxT,
                      cfg.rope_theta)
    k_BxTxKVxDh = rope(rms_norm(k_BxTxKVxDh, p["k_norm"], cfg.norm_eps), positions_BxT,
                       cfg.rope_theta)
    if cache_kv is not None:
        keys = cfg.kv_cache_layout
        to_cache = (lambda x: x) if keys == "bskd" else (lambda x: jnp.swapaxes(x, 1, 2))
        new_kv = tuple(to_cache(x) for x in (k_BxTxKVxDh, v_BxTxKVxDh))
        own = cache_kv[0].ndim == len(keys)  # this layer's own buffers, or the stacked ones
        put = _cache_put(keys, cache_index, None if own else layer, b)
        cache_kv = k, v = tuple(_write(c, x, put) for c, x in zip(cache_kv, new_kv))
    else:
        k, v, keys = k_BxTxKVxDh, v_BxTxKVxDh, "bskd"
    stacked = cache_kv is not None and k.ndim > len(keys)
    q_BxTxKVxHgxDh = q_BxTxHxDh.reshape(b, t, kv_heads, group, cfg.head_dim)
    if cache_kv is not None and t == 1 and cfg.decode_block:
        # Blocks sliced from the stacked cache directly (the implementations' `layer`).
        o_BxKVxHgxDh = (decode or decode_attention_fn(cfg))(
            q_BxTxKVxHgxDh[:, 0].astype(dtype), k, v, key_mask_BxS, cache_index,
            jnp.asarray(layer, jnp.int32) if stacked else None)
        out_BxTxD = _proj("bhk,hkd->bd", o_BxKVxHgxDh.reshape(b, cfg.num_heads, cfg.head_dim),
                          p["wo"], numerics, dtype)[:, None]
        return out_BxTxD, cache_kv
    if stacked:
        k, v = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False) for c in (k, v))
    if segments_BxT is not None and cache_kv is not None:
        raise ValueError("attention: segment ids (packed rows) apply without a KV cache")
    attend = lambda q, slots, seg=None: _attend(
        q, k, v, slots, key_mask_BxS, cfg.head_dim, dtype, keys,
        None if seg is None else (seg, segments_BxT))
    causal = cfg.attention_impl == "causal" and cache_kv is None
    if causal and segments_BxT is not None:
        o_BxTxKVxHgxDh = _causal_segments(q_BxTxKVxHgxDh, k, v, key_mask_BxS, segments_BxT,
                                          min(cfg.attention_chunk, t), cfg.head_dim, dtype)
    elif causal and t > cfg.attention_chunk:
        o_BxTxKVxHgxDh = _causal(q_BxTxKVxHgxDh, k, v, key_mask_BxS, cfg.attention_chunk,
                                 cfg.head_dim, dtype)
    elif cfg.attention_impl == "chunked" and t > cfg.attention_chunk and (
            segments_BxT is not None):
        o_BxTxKVxHgxDh = _chunked_segments(q_BxTxKVxHgxDh, k, v, key_mask_BxS, segments_BxT,
                                           cfg.attention_chunk, cfg.head_dim, dtype)
    elif cfg.attention_impl == "chunked" and t > cfg.attention_chunk:
        o_BxTxKVxHgxDh = _chunked(attend, q_BxTxKVxHgxDh, query_slots_T, cfg.attention_chunk)
    else:
        o_BxTxKVxHgxDh = attend(q_BxTxKVxHgxDh, query_slots_T, segments_BxT)
    o_BxTxHxDh = o_BxTxKVxHgxDh.reshape(b, t, cfg.num_heads, cfg.head_dim)
    out_BxTxD = _proj("bthk,hkd->btd", o_BxTxHxDh, p["wo"], numerics, dtype)
    return out_BxTxD, cache_kv

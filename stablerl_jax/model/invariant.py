"""Batch-invariant numerics: a token's results do not depend on the call it is in.

The sampler (prefill, decode) and the trainer (whole sequences) run the decoder in differently
shaped programs, and a row's result depends on the shape: on a CPU the rows of `jnp.dot` differ
between a [1, D] and a [256, D] call, and a softmax's sum over [B, V]'s last axis differs with B.
Under ModelConfig.batch_invariant (required by the `bitwise` sampler) a token's computation
depends on the token alone:

- Per-token work (norms, projections, RoPE, routing, combine, residual adds, log-softmax) runs in
  fixed tiles of ModelConfig.row_tile rows (ROW_TILE by default): `rowwise` maps one compiled
  tile body, fenced by optimization barriers, over whole tiles (`lax.map`;
  tests/model/invariant_test.py checks each such reliance). The log-softmax may instead be the
  batch-invariant LOGPROB_IMPLS row RLConfig.logprob_impl names (the Pallas kernels;
  `vocab_kernel`), in both engines.
- Attention (`attend`) walks each query's keys in blocks of KEY_BLOCK *positions* (from the
  sequence's first real token) with a float32 online softmax; skipping a block past the query
  (`lax.cond`) equals computing it fully masked (p = 0, rescale by exp(0) = 1), so the call's
  block count (cache or sequence length, left padding, a trimmed window) changes nothing.
- The expert FFN computes tiles of `ModelConfig.moe_tile` expert-sorted rows in fixed-shape
  products by a batch-invariant grouped matmul (`grouped_matmul`: gmm_impl's GMM_IMPLS row if
  marked `invariant`, else the reference `loop`); SwiGLU and the k-ordered combine in row tiles.

Only values must be per token: the trainer's backward is the untiled VJP
(`with_reference_gradient` around each layer, the tiles' routes replayed, and the final norm;
method/logprobs.py for the log-softmax), so an update costs the untiled one plus one tiled
forward; a decode step pays for padding B rows to a tile and the tile loop (docs/method.md, "Zero
mismatch").

Letters: N rows (tokens), W rows of a tile (row_tile), B batch, S key slots, D model, H heads, KV
kv heads, G = H / KV, Dh head width, E experts, K top-k, V vocab, J key positions of a block
(KEY_BLOCK).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from stablerl_jax.kernels import decode_attention_pallas, lookup
from stablerl_jax.kernels.decode_attention_impls import DECODE_IMPLS
from stablerl_jax.kernels.fused_logprob_impls import LOGPROB_IMPLS
from stablerl_jax.kernels.gmm_impls import GMM_IMPLS
from stablerl_jax.model import expert_parallel, moe
from stablerl_jax.model import numerics as nx

ROW_TILE = 32
KEY_BLOCK = 32
QUERY_CHUNK = 512  # queries per call of a per-token attention kernel


def _fence(tree):
    return jax.lax.optimization_barrier(tree)


def rowwise(fn, *rows, tile: int = ROW_TILE):
    """fn over fixed `tile`-row tiles of `rows` (leading axis N; None passes through), back to N
    rows; `fn` must treat rows independently. Rematerialized: the backward keeps tile inputs."""
    n = next(r for r in rows if r is not None).shape[0]
    pad = -n % tile

    def tiles(r):
        if r is None:
            return None
        r = jnp.pad(r, [(0, pad)] + [(0, 0)] * (r.ndim - 1), mode="edge") if pad else r
        return r.reshape(-1, tile, *r.shape[1:])

    dtypes = []

    def body(xs):
        out = _fence(fn(*_fence(xs)))
        dtypes.append(jax.tree.map(lambda o: o.dtype, out))
        return jax.tree.map(_wide, out)

    out = jax.lax.map(jax.checkpoint(body, prevent_cse=False), tuple(tiles(r) for r in rows))
    return jax.tree.map(lambda o, dt: o.reshape(-1, *o.shape[2:])[:n].astype(dt), out,
                        dtypes[-1])


def _wide(x):
    """x widened to a 32-bit type that holds it exactly (float32 or int32; bools too), else x:
    XLA's CPU backend copies a loop's stacked 16- or 8-bit output every iteration (20 ms for
    6,400 rows of 64 bfloat16 in 32-row tiles, 84 ms for 12,800), not a 32-bit one."""
    if x.dtype.itemsize >= 4:
        return x
    return x.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32)


def with_reference_gradient(fn, reference, keep=lambda out: ()):
    """`fn`'s values, `reference`'s VJP: `reference(kept, *args)` is `fn(*args)` untiled (equal
    up to rounding), `kept = keep(fn's outputs)` (e.g. routes, replayed so both route alike).
    Saves only `args` and `kept`."""
    @jax.custom_vjp
    def f(*args):
        return fn(*args)

    def fwd(*args):
        out = fn(*args)
        return out, (args, keep(out))

    def bwd(res, g):
        args, kept = res
        return jax.vjp(lambda *a: reference(kept, *a), *args)[1](g)

    f.defvjp(fwd, bwd)
    return f


def dot(x, w, dtype):
    """x [W, I] · w [I, O] with `dtype` operands, float32 (or wider) accumulation."""
    return jnp.dot(x.astype(dtype), w.astype(dtype), precision=nx.PRECISION,
                   preferred_element_type=nx.accum_dtype(dtype))


def first_slots(key_mask_BxS):
    """Each row's first real slot (0 for a row with none): where position 0 sits."""
    return jnp.argmax(key_mask_BxS, axis=1).astype(jnp.int32)


def token_attention(cfg):
    """`kernel_attend` by the per-token kernel (`tokens`) of `cfg`'s decode_attention_impl row,
    in blocks of cfg.decode_block positions; None without one: `attend`'s own blocks."""
    row = lookup(DECODE_IMPLS, cfg.decode_attention_impl, "decode_attention_impl")
    return None if row.tokens is None else functools.partial(
        kernel_attend, row.tokens.load(), cfg.decode_block)


def runs_token_kernel(cfg) -> bool:
    """Whether `cfg` attends by a per-token kernel (batch-invariant, a row with `tokens`)."""
    row = lookup(DECODE_IMPLS, cfg.decode_attention_impl, "decode_attention_impl")
    return bool(cfg.batch_invariant and row.tokens is not None)


def cache_slots(cfg, length: int) -> int:
    """KV slots for `length` tokens, plus what `cfg`'s per-token kernel's `cache_slots` adds."""
    if not runs_token_kernel(cfg):
        return length
    return decode_attention_pallas.cache_slots(length, cfg.decode_block)


def kernel_attend(kernel, block: int, q_NxHxDh, pos_N, row_N, start_N, k, v, key_mask_BxS,
                  *, kv_heads: int, dtype, keys: str, layer=None):
    """`attend` by a per-token kernel (decode_attention_pallas.tokens' contract) in blocks of
    `block` positions: keys head-major and padded; queries in chunks ≤ QUERY_CHUNK, which changes
    no result."""
    n, h, dh = q_NxHxDh.shape
    if keys == "bskd":
        k, v = jnp.swapaxes(k, -3, -2), jnp.swapaxes(v, -3, -2)
    s = k.shape[-2]
    pad = decode_attention_pallas.cache_slots(s, block) - s
    if pad:
        k, v = (jnp.pad(c, [(0, 0)] * (c.ndim - 2) + [(0, pad), (0, 0)]) for c in (k, v))
        key_mask_BxS = jnp.pad(key_mask_BxS, ((0, 0), (0, pad)))
    if k.dtype != dtype:
        k, v = k.astype(dtype), v.astype(dtype)
    q = q_NxHxDh.astype(dtype).reshape(n, kv_heads, h // kv_heads, dh)
    # A kernel is never differentiated (the trainer's gradient is the untiled layer's),
    # so the chunks, unlike `rowwise`'s tiles, are not rematerialized.
    chunk = min(n, QUERY_CHUNK)
    pad = -n % chunk
    chunks = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), mode="edge").reshape(
        -1, chunk, *a.shape[1:])
    out = jax.lax.map(lambda xs: kernel(*xs, k, v, key_mask_BxS, block=block, layer=layer),
                      tuple(chunks(a) for a in (q, pos_N, row_N, start_N)))
    return out.reshape(-1, h, dh)[:n]


def attend(q_NxHxDh, pos_N, row_N, start_N, k, v, key_mask_BxS, *, kv_heads: int,
           dtype, keys: str = "bskd", tile: int = ROW_TILE, layer=None, kernel=None):
    """softmax(q kᵀ / √Dh) v of each query over its real keys at positions 0..pos (query n: row
    row_N[n], position 0 at slot start_N[n]; none: 0), [N, H, Dh] in `dtype`; `layer`: of a
    stacked cache [L, ...]; `kernel`: a per-token kernel (`token_attention`) instead."""
    if kernel is not None:
        return kernel(q_NxHxDh, pos_N, row_N, start_N, k, v, key_mask_BxS,
                      kv_heads=kv_heads, dtype=dtype, keys=keys, layer=layer)
    if layer is not None:
        k, v = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False) for c in (k, v))
    n, h, dh = q_NxHxDh.shape
    g = h // kv_heads
    s = k.shape[keys.index("s")]
    blocks = -(-s // KEY_BLOCK)
    acc = nx.accum_dtype(dtype)

    def queries(q, pos, row, start):
        w = q.shape[0]
        q = q.reshape(w, kv_heads, g, dh).astype(dtype)

        def block(j, carry):
            def compute(carry):
                m, l, o = carry
                kpos = j * KEY_BLOCK + jnp.arange(KEY_BLOCK)
                slot = start[:, None] + kpos[None, :]                    # [W, J]
                at = jnp.minimum(slot, s - 1)
                real = (kpos[None, :] <= pos[:, None]) & (slot < s) & key_mask_BxS[
                    row[:, None], at]
                if keys == "bskd":
                    kb, vb = k[row[:, None], at], v[row[:, None], at]    # [W, J, KV, Dh]
                else:
                    hh = jnp.arange(kv_heads)[None, None, :]
                    kb = k[row[:, None, None], hh, at[:, :, None]]
                    vb = v[row[:, None, None], hh, at[:, :, None]]
                kb, vb, real = _fence((kb.astype(dtype), vb.astype(dtype), real))
                sc = jnp.einsum("wkgd,wjkd->wkgj", q, kb, precision=nx.PRECISION,
                                preferred_element_type=acc) * dh**-0.5
                sc = jnp.where(real[:, None, None, :], sc, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(sc - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                l = alpha * l + jnp.sum(p, axis=-1)
                pv = jnp.einsum("wkgj,wjkd->wkgd", p.astype(dtype), vb,
                                precision=nx.PRECISION, preferred_element_type=acc)
                return _fence((m_new, l, alpha[..., None] * o + pv))

            needed = j * KEY_BLOCK <= jnp.max(pos)
            return jax.lax.cond(needed, compute, lambda c: c, carry)

        init = (jnp.full((w, kv_heads, g), -jnp.inf, acc), jnp.zeros((w, kv_heads, g), acc),
                jnp.zeros((w, kv_heads, g, dh), acc))
        _, l, o = jax.lax.fori_loop(0, blocks, block, init)
        out = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        return out.reshape(w, h, dh).astype(dtype)

    return rowwise(queries, q_NxHxDh, pos_N, row_N, start_N, tile=tile)


def experts(x_NxD, idx_NxK, w_NxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, tile: int,
            ep_axes: tuple = (), row_tile: int = ROW_TILE, gmm=None):
    """The grouped expert FFN per row, [N, D]: `expert_rows` (`tile`-row tiles, `gmm`), combined
    in `row_tile` tiles. `ep_axes` (in invariant_layer.on_mesh): this shard's experts;
    assignments go to their expert's shard and back (expert_parallel.exchanged_rows)."""
    if not ep_axes:
        return combine(expert_rows(x_NxD, idx_NxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD,
                                   tile=tile, gmm=gmm), w_NxK, row_tile)
    # The all-to-alls move rows and outputs unchanged, the expert's shard computes an
    # assignment's row in its fixed tiles as one device would, and the token's shard
    # combines its K rows in k order. (Gathering the expert-axis peers' tokens instead
    # and reduce-scattering their [N, K, D] outputs moves n·(1 + K) rows a token
    # against the exchange's 2·K, and its outputs take as much memory as the exchange's
    # dropless receive buffer: the exchange is never the worse of the two.)
    offset = jax.lax.axis_index(ep_axes) * w_gate_ExDxF.shape[0]
    rows_fn = lambda x, e, *ws, expert_offset: expert_rows(
        x, e, *ws, tile=tile, expert_offset=expert_offset, gmm=gmm)[:, 0]
    return combine(expert_parallel.exchanged_rows(
        rows_fn, ep_axes, jax.lax.axis_size(ep_axes), x_NxD, idx_NxK,
        (w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD), offset), w_NxK, row_tile)


def expert_rows(x_NxD, idx_NxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *, tile: int,
                expert_offset=None, gmm=None):
    """Each assignment's expert output [N, K, D], in `tile`-row expert-sorted tiles by `gmm`
    (`grouped_matmul`'s; default the reference). `expert_offset`: the E experts start there;
    other experts' rows are 0."""
    n, k = idx_NxK.shape
    num_experts = w_gate_ExDxF.shape[0]
    dt = x_NxD.dtype
    acc = nx.accum_dtype(dt)
    expert_A = idx_NxK.reshape(-1)
    if expert_offset is None:
        mine_A, budget = None, n * k
    else:
        local_A = expert_A - expert_offset
        mine_A = (local_A >= 0) & (local_A < num_experts)
        expert_A = jnp.where(mine_A, local_A, num_experts)
        budget = n * min(k, num_experts)  # a token's K experts are distinct
    row_A, padded_E = moe._plan(expert_A, num_experts, tile)
    rows = moe.padded_rows(budget, num_experts, tile)
    if mine_A is not None:  # other shards' assignments: written nowhere, read as 0
        row_A = jnp.where(mine_A, row_A, rows)
    x_RxD = jnp.zeros((rows, x_NxD.shape[1]), dt).at[row_A].set(
        jnp.repeat(x_NxD, k, axis=0), unique_indices=mine_A is None, mode="drop")
    gmm = gmm or moe.grouped_matmul.loop
    gate_RxF = gmm(x_RxD, w_gate_ExDxF, padded_E, tile, nx.PRECISION)
    up_RxF = gmm(x_RxD, w_up_ExDxF, padded_E, tile, nx.PRECISION)
    h_RxF = rowwise(lambda g_, u_: moe._swiglu(g_.astype(acc), u_.astype(acc)).astype(dt),
                    gate_RxF, up_RxF, tile=tile)
    y_RxD = gmm(h_RxF, w_down_ExFxD, padded_E, tile, nx.PRECISION)
    y_AxD = jnp.take(y_RxD, row_A, axis=0, mode="fill", fill_value=0)
    return y_AxD.reshape(n, k, -1)


def grouped_matmul(impl: str):
    """`ModelConfig.gmm_impl`'s GMM_IMPLS row if batch-invariant, else the reference `loop`."""
    row = lookup(GMM_IMPLS, impl, "gmm_impl")
    return row.load() if row.invariant else moe.grouped_matmul.loop


def combine(y_NxKxD, w_NxK, row_tile: int = ROW_TILE):
    """Σ_k w[:, k] · y[:, k] in k order per row, float32 (or wider) accumulation, y's dtype."""
    dt = y_NxKxD.dtype
    acc = nx.accum_dtype(dt)

    def rows(y, wk):
        out = y[:, 0].astype(acc) * wk[:, :1].astype(acc)
        for i in range(1, wk.shape[1]):
            out = out + y[:, i].astype(acc) * wk[:, i:i + 1].astype(acc)
        return out.astype(dt)

    return rowwise(rows, y_NxKxD, w_NxK, tile=row_tile)


def vocab_kernel(logprob_impl: str):
    """The LOGPROB_IMPLS row for the log-softmax if batch-invariant: `fn(h, unembed, None)` a
    row's distribution, `fn(h, unembed, targets)` the trainer's fused op, same bits at the
    targets. None: `logprobs_V` / `token_logprobs` row tiles."""
    row = lookup(LOGPROB_IMPLS, logprob_impl, "logprob_impl")
    return row if row.invariant else None


def logprobs_V(h_NxD, unembed_DxV, temperature: float = 1.0, tile: int = ROW_TILE,
               logprob_impl: str = "chunked"):
    """log softmax((h / τ) · unembed), float32 [N, V], per row: what the sampler draws from and
    the trainer scores (`token_logprobs`, or the fused op of `vocab_kernel(logprob_impl)`)."""
    row = vocab_kernel(logprob_impl)
    if row is not None:
        return row.load()(scaled(h_NxD, temperature), unembed_DxV, None)
    return rowwise(lambda h: _logp_V(h, unembed_DxV, temperature), h_NxD, tile=tile)


def token_logprobs(h_NxD, unembed_DxV, targets_N, temperature: float = 1.0,
                   tile: int = ROW_TILE):
    """(logp_N, entropy_N) of `targets_N` under `logprobs_V`'s distribution, per row."""
    def rows(h, tgt):
        lp = _fence(_logp_V(h, unembed_DxV, temperature))
        ent = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
        return jnp.take_along_axis(lp, tgt[:, None], axis=1)[:, 0], ent

    return rowwise(rows, h_NxD, targets_N, tile=tile)


def scaled(h, temperature: float):
    """h / τ in float32 (or wider), in h's dtype: the temperature as in method/logprobs.py."""
    if temperature == 1.0:
        return h
    return (h.astype(nx.accum_dtype(h.dtype)) / temperature).astype(h.dtype)


def _logp_V(h, unembed_DxV, temperature):
    dt = h.dtype
    h = scaled(h, temperature)
    z = dot(h, unembed_DxV, dt)
    return jax.nn.log_softmax(z.astype(jnp.float32) if z.dtype != jnp.float64 else z,
                              axis=-1)

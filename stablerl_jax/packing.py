"""Token-budget sequence packing of the score and update steps (rl.pack_tokens).

Letters: B responses of the (mini-)batch, S slots of its padded rows, T = S − 1 scored
positions, D batch shards of the mesh, N = B / D responses per shard, W tokens per packed
row (rl.pack_tokens), R packed rows per shard (capacity N), M packed rows per shard in one
micro-batch (rl.pack_rows / D), L layers, K top-k.

A padded row holds one response's real tokens as one contiguous span (the left-padded
prompt, then the completion, then padding). Packing moves each span whole into a row of
W tokens next to others:

- the plan (`plan`): in each shard, first-fit decreasing by length (ties by row index),
  so the plan is a pure function of the lengths; each response gets a packed row, an
  offset and a segment number (1, 2, … along the row);
- a micro-batch is M packed rows of every shard, so the forward's batch is
  [D·M, W] whatever the responses' lengths, and each shard's rows stay on its devices
  (every gather is within a shard: the batch axis of the reshaped [D, N, …] arrays);
- in a packed row, RoPE positions restart at each segment (a token's position is its
  slot minus its response's first real slot: what the padded row gives it) and
  attention never crosses a segment (`transformer.forward`'s segment ids), so each
  token's hidden state is the one its padded row gives;
- the forward's per-token outputs (log-probs, entropy, routes) are gathered back into
  the padded [B, T] frame, where the mask, advantages, μ and every loss aggregation are
  as they were. Only the forward sees packed rows.

Micro-batches run in a `lax.scan` over the capacity ⌈N / M⌉ whose body is a `lax.cond`:
a micro-batch index past the rows some shard used costs nothing, so a step's forward
work follows its tokens. The fullest shard sets the count, so the loop orders each
mini-batch's rows (`balance_rows`, on the host: a mini-batch is a seeded set of rows in
any order) so that every shard gets about the same tokens.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def balance_rows(rows_M: np.ndarray, tokens_M: np.ndarray, shards: int) -> np.ndarray:
    """`rows_M` (a mini-batch's row indices, with their real tokens `tokens_M`) reordered
    so that each of `shards` contiguous blocks of M / shards rows holds about the same
    tokens: longest first (ties by position), each to the least-loaded shard with room
    (ties: the lower shard). Deterministic; a permutation of `rows_M`."""
    m = len(rows_M)
    if m % shards:
        raise ValueError(f"balance_rows: {m} rows do not split into {shards} shards")
    per = m // shards
    load, count = np.zeros(shards), np.zeros(shards, int)
    slots: list[list[int]] = [[] for _ in range(shards)]
    for i in np.argsort(-np.asarray(tokens_M), kind="stable"):
        free = np.flatnonzero(count < per)
        d = free[np.argmin(load[free])]
        slots[d].append(int(rows_M[i]))
        load[d] += tokens_M[i]
        count[d] += 1
    return np.asarray([r for block in slots for r in block], dtype=np.asarray(rows_M).dtype)


class Plan(NamedTuple):
    """Where each response of a [B, S] batch sits in the packed rows (shard-local)."""

    row_B: jax.Array       # int32, packed row in its shard's buffer [0, N)
    offset_B: jax.Array    # int32, packed slot of its first real token
    start_B: jax.Array     # int32, slot of its first real token in the padded row
    length_B: jax.Array    # int32, its real tokens (prompt + completion)
    segment_B: jax.Array   # int32, its segment number in the packed row (1, 2, …); 0 if empty
    rows_used_D: jax.Array  # int32 [D], packed rows each shard uses


def first_fit_decreasing(length_N: jax.Array, width: int):
    """(row_N, offset_N, segment_N, fill_N): sequences of these lengths (each <= width)
    placed first-fit in decreasing order of length (ties: lower index first) into N rows
    of `width` slots. Empty sequences get row 0, offset 0, segment 0."""
    n = length_N.shape[0]
    order = jnp.argsort(-length_N, stable=True)
    zeros = jnp.zeros((n,), jnp.int32)

    def place(i, carry):
        fill_N, count_N, row_N, offset_N, segment_N = carry
        b = order[i]
        size = length_N[b]
        r = jnp.argmax(fill_N + size <= width).astype(jnp.int32)
        r = jnp.where(size > 0, r, 0)
        real = (size > 0).astype(jnp.int32)
        return (fill_N.at[r].add(size), count_N.at[r].add(real), row_N.at[b].set(r),
                offset_N.at[b].set(jnp.where(size > 0, fill_N[r], 0)),
                segment_N.at[b].set(real * (count_N[r] + 1)))

    fill, _, row, offset, segment = jax.lax.fori_loop(
        0, n, place, (zeros, zeros, zeros, zeros, zeros))
    return row, offset, segment, fill


def plan(attn_BxS: jax.Array, width: int, shards: int) -> Plan:
    """The packing of a batch whose real tokens are `attn_BxS` into rows of `width`
    slots, each of `shards` contiguous blocks of B / shards rows packed on its own."""
    b, s = attn_BxS.shape
    if b % shards:
        raise ValueError(f"packing: {b} rows do not split into {shards} batch shards")
    real = attn_BxS.astype(bool)
    length_B = jnp.sum(real, axis=1, dtype=jnp.int32)
    start_B = jnp.where(length_B > 0, jnp.argmax(real, axis=1), 0).astype(jnp.int32)
    row, offset, segment, fill = jax.vmap(first_fit_decreasing, (0, None))(
        length_B.reshape(shards, -1), width)
    flat = lambda x: x.reshape(b)
    return Plan(flat(row), flat(offset), start_B, length_B, flat(segment),
                jnp.sum(fill > 0, axis=1, dtype=jnp.int32))


def micro_batches(rows: int, shards: int, pack_rows: int) -> tuple[int, int]:
    """(M packed rows per shard in a micro-batch, ⌈N / M⌉ micro-batches at most) for a
    batch of `rows` responses; pack_rows 0: one row per shard."""
    per_shard = max(pack_rows // shards, 1)
    n = rows // shards
    return per_shard, -(-n // per_shard)


def source_table(p: Plan, shards: int, slots: int, width: int) -> jax.Array:
    """[D, N, W] int32: for each packed slot of each shard, the shard-local flat index
    b·S + s of the padded slot it holds (-1: padding)."""
    n = p.row_B.shape[0] // shards
    per = lambda x: x.reshape(shards, n)

    def one(row_N, offset_N, start_N, length_N):
        s_S = jnp.arange(slots)
        rel_NxS = s_S[None] - start_N[:, None]
        real = (rel_NxS >= 0) & (rel_NxS < length_N[:, None])
        dest = jnp.where(real, row_N[:, None] * width + offset_N[:, None] + rel_NxS,
                         n * width)  # out of bounds: dropped
        src = jnp.arange(n)[:, None] * slots + s_S[None]
        table = jnp.full((n * width,), -1, jnp.int32)
        return table.at[dest.reshape(-1)].set(src.reshape(-1).astype(jnp.int32),
                                              mode="drop").reshape(n, width)

    return jax.vmap(one)(per(p.row_B), per(p.offset_B), per(p.start_B), per(p.length_B))


class Packed(NamedTuple):
    """One micro-batch's forward inputs, [D·M, W + 1] (replay [D·M, W, L, K]): the last
    column is padding, so every real token is an input of the T-frame."""

    tokens: jax.Array
    attn: jax.Array        # real input tokens (a response's last token, at the padded
                           # row's last slot, is no input there and none here)
    segments: jax.Array    # segment number per slot, 0 on padding
    positions: jax.Array   # RoPE positions, restarting at each segment
    replay: jax.Array | None
    replay_weights: jax.Array | None


def pack(i, table_DxNxW: jax.Array, p: Plan, per_shard: int, tokens_BxS: jax.Array,
         replay_BxTxLxK=None, replay_weights_BxTxLxK=None) -> Packed:
    """Micro-batch `i` (packed rows [i·M, (i+1)·M) of every shard) of the batch."""
    shards, n, width = table_DxNxW.shape
    s = tokens_BxS.shape[1]
    src_DxMxW = jax.lax.dynamic_slice_in_dim(table_DxNxW, i * per_shard, per_shard, 1)
    have = src_DxMxW >= 0
    src = jnp.maximum(src_DxMxW, 0)
    row, slot = src // s, src % s
    take = jax.vmap(lambda x, idx: x[idx])  # within each shard
    by_shard = lambda x: x.reshape(shards, n, *x.shape[1:])
    flat = lambda x: x.reshape(shards * per_shard, *x.shape[2:])
    tokens = jnp.where(have, take(by_shard(tokens_BxS).reshape(shards, n * s), src), 0)
    segments = jnp.where(have, take(by_shard(p.segment_B), row), 0)
    positions = jnp.where(have, slot - take(by_shard(p.start_B), row), 0)
    attn = have & (slot < s - 1)

    def frame_t(x_BxTx, fill):  # T-frame tensors at the input slot each packed slot holds
        if x_BxTx is None:
            return None
        t = x_BxTx.shape[1]
        x = by_shard(x_BxTx).reshape(shards, n * t, *x_BxTx.shape[2:])
        got = take(x, row * t + jnp.minimum(slot, t - 1))
        ok = attn.reshape(attn.shape + (1,) * (x.ndim - 2))
        return flat(jnp.where(ok, got, fill))

    # One more padding column: every real token is an input of the [:, :-1] frame.
    col = lambda x, fill: jnp.pad(flat(x), ((0, 0), (0, 1)), constant_values=fill)
    return Packed(col(tokens, 0), col(attn, False), col(segments, 0), col(positions, 0),
                  frame_t(replay_BxTxLxK, -1), frame_t(replay_weights_BxTxLxK, 0))


def unpack(i, x_RxTx: jax.Array, p: Plan, per_shard: int, slots: int, fill):
    """The packed forward's per-position output of micro-batch `i` ([D·M, W, …], the
    T-frame of the packed rows) in the padded T-frame [B, T, …], and which rows it holds
    ([B] bool). Positions of rows not in the micro-batch, and positions holding no real
    input, get `fill`."""
    b = p.row_B.shape[0]
    shards = p.rows_used_D.shape[0]
    n = b // shards
    wt = x_RxTx.shape[1]
    t = slots - 1
    local = p.row_B - i * per_shard
    mine_B = (local >= 0) & (local < per_shard) & (p.length_B > 0)
    col_BxT = p.offset_B[:, None] + jnp.arange(t)[None] - p.start_B[:, None]
    rel_BxT = jnp.arange(t)[None] - p.start_B[:, None]
    ok_BxT = (mine_B[:, None] & (rel_BxT >= 0) & (rel_BxT < p.length_B[:, None])
              & (col_BxT < wt))
    idx_BxT = jnp.clip(local, 0, per_shard - 1)[:, None] * wt + jnp.clip(col_BxT, 0, wt - 1)
    x = x_RxTx.reshape(shards, per_shard * wt, *x_RxTx.shape[2:])
    got = jax.vmap(lambda a, idx: a[idx])(x, idx_BxT.reshape(shards, n * t))
    got = got.reshape(b, t, *x_RxTx.shape[2:])
    ok = ok_BxT.reshape(ok_BxT.shape + (1,) * (got.ndim - 2))
    return jnp.where(ok, got, jnp.asarray(fill, got.dtype)), mine_B


class Layout(NamedTuple):
    """A batch's packing, made once per step and read by every micro-batch."""

    plan: Plan
    table: jax.Array   # source_table
    per_shard: int     # M
    count: int         # ⌈N / M⌉, the scan's length
    used: jax.Array    # micro-batches some shard has rows in (the rest are skipped)
    slots: int         # S


def layout(attn_BxS: jax.Array, width: int, shards: int, pack_rows: int) -> Layout:
    """The `Layout` of a [B, S] batch packed into rows of `width`."""
    b, s = attn_BxS.shape
    p = plan(attn_BxS, width, shards)
    per_shard, count = micro_batches(b, shards, pack_rows)
    used = (jnp.max(p.rows_used_D) + per_shard - 1) // per_shard
    return Layout(p, source_table(p, shards, s, width), per_shard, count, used, s)


def map_micro_batches(fn: Callable, lay: Layout, init):
    """`carry = fn(i, carry)` for the micro-batches i < lay.used, in a scan over all
    lay.count of them (a `lax.cond` skips the empty ones); returns the last carry."""

    def body(carry, i):
        return jax.lax.cond(i < lay.used, fn, lambda i, c: c, i, carry), None

    out, _ = jax.lax.scan(body, init, jnp.arange(lay.count))
    return out


def packed_logprobs(forward: Callable, lay: Layout, tokens_BxS, replay_BxTxLxK=None,
                    replay_weights_BxTxLxK=None):
    """(logp_BxT, entropy_BxT, routes_BxTxLxK) of the padded batch, computed by
    `forward(Packed) -> (logp, entropy, aux)` on packed micro-batches (no gradient
    through the loop: the score step's use). Positions without a real input hold 0
    (log-prob, entropy) and -1 (routes)."""
    b, s = tokens_BxS.shape

    def one(i, carry):
        packed = pack(i, lay.table, lay.plan, lay.per_shard, tokens_BxS, replay_BxTxLxK,
                      replay_weights_BxTxLxK)
        logp, entropy, aux = forward(packed)
        outs = []
        for x, old, fill in zip((logp, entropy, aux["routes"]), carry, (0.0, 0.0, -1)):
            new, mine_B = unpack(i, x, lay.plan, lay.per_shard, lay.slots, fill)
            outs.append(jnp.where(mine_B.reshape((b,) + (1,) * (old.ndim - 1)), new, old))
        return tuple(outs)

    logp0, ent0, aux0 = jax.eval_shape(forward, pack(0, lay.table, lay.plan, lay.per_shard,
                                                     tokens_BxS, replay_BxTxLxK,
                                                     replay_weights_BxTxLxK))
    routes = aux0["routes"]
    init = (jnp.zeros((b, s - 1), logp0.dtype), jnp.zeros((b, s - 1), ent0.dtype),
            jnp.full((b, s - 1) + routes.shape[2:], -1, routes.dtype))
    return map_micro_batches(one, lay, init)

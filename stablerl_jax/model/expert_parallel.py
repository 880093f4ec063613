"""The expert FFN on a device mesh: `shard_map` over each device's own tokens, the experts
sharded (expert parallelism) or gathered layer by layer.

Letters: T tokens (the forward's B·T, flattened), D model, F expert FFN width, E experts, K
top-k, n = size of the `expert` mesh axis, E/n experts per expert shard.

Why shard_map: under GSPMD the grouped dispatch's sort over a sharded token axis, or a Pallas
kernel (a custom call the partitioner cannot split), would gather every device's tokens onto
every device.

ModelConfig.expert_parallel:
- True: a device keeps the E/n experts of its `expert` shard (other dims all-gathered over FSDP
  axes, like every weight), all-gathers its n expert-axis peers' tokens, routes and weights
  ([n·T, D]), runs its experts on the assignments that chose them
  (`moe.experts_grouped(expert_offset=)`) and reduce-scatters partial outputs over `expert`.
  Expert weights never cross the `expert` axis: every compiled all-gather of one keeps E/n
  experts (tests/model/expert_parallel_test.py). The sorted buffer fits the dropless worst case
  (all n·T·K assignments here); matmuls skip unused tiles. Decode on many shards (the serving
  layout) exchanges tokens instead (`_exchanged`).
- False: each device all-gathers all E experts' weights per layer (FSDP over experts) for its own
  T tokens: no token exchange, more weight traffic.

Mesh axis names come from `sharding.RULES` (logical "experts", "embed", "mlp", "batch"). The
backward needs no code: an all-gather transposes to a reduce-scatter, and shard_map sums a
replicated weight's gradient.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from stablerl_jax import sharding
from stablerl_jax.config import ModelConfig
from stablerl_jax.model.numerics import PRECISION, accum_dtype


def _gather(w, spec: P, keep_axes: tuple):
    """All-gather `w` over the mesh axes of every dim of `spec`, except `keep_axes`."""
    for dim, part in enumerate(spec):
        axes = tuple(a for a in sharding.spec_axes(part) if a not in keep_axes)
        if axes:
            w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    return w


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                      recv_sizes, *, axis_name):
    """`lax.ragged_all_to_all`; on CPU, which lacks it, built from all-gathers of each peer's
    operand and offsets (slices must not overlap in a receiver's output)."""
    def native(*args):
        return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)

    def on_cpu(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        del send_sizes  # each sender's send_sizes are the receivers' recv_sizes
        gather = lambda a: jax.lax.all_gather(a, axis_name, axis=0)
        me = jax.lax.axis_index(axis_name)
        # Slice s of this receiver came from peer s: rows [start_s, start_s + size_s) of
        # its operand, written at rows [at_s, at_s + size_s) of the output.
        start_S = gather(input_offsets)[:, me]
        at_S = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
        r_R = jnp.arange(output.shape[0])
        hit_RxS = (r_R[:, None] >= at_S) & (r_R[:, None] < at_S + recv_sizes)
        src_R = jnp.argmax(hit_RxS, axis=1)
        row_R = start_S[src_R] + r_R - at_S[src_R]
        got = gather(operand)[src_R, jnp.clip(row_R, 0, operand.shape[0] - 1)]
        keep = jnp.any(hit_RxS, axis=1).reshape((-1,) + (1,) * (output.ndim - 1))
        return jnp.where(keep, got, output)

    return jax.lax.platform_dependent(operand, output, input_offsets, send_sizes,
                                      output_offsets, recv_sizes, cpu=on_cpu,
                                      default=native)


def _exchanged(experts_fn, axes, n, x_TxD, idx_TxK, w_TxK, ws, offset):
    """One decode step's expert FFN by `exchanged_rows`; K outputs combined in k order."""
    rows_fn = lambda x, e, *ws, expert_offset: experts_fn(
        x, e, jnp.ones(e.shape, w_TxK.dtype), *ws, expert_offset=expert_offset)
    y_TxKxD = exchanged_rows(rows_fn, axes, n, x_TxD, idx_TxK, ws, offset)
    acc = accum_dtype(x_TxD.dtype)
    return jnp.einsum("tkd,tk->td", y_TxKxD.astype(acc), w_TxK.astype(acc),
                      precision=PRECISION).astype(x_TxD.dtype)


def exchanged_rows(rows_fn, axes, n, x_TxD, idx_TxK, ws, offset):
    """Each assignment's expert output [T, K, D], computed on its expert's shard by
    `rows_fn(x_RxD, expert_Rx1, *ws, expert_offset=offset)` -> [R, D] (padding rows: expert -1,
    output 0); ragged all-to-alls over `axes` (n shards) move rows and outputs, T·K each way
    instead of n·T (receive buffer: the dropless worst case). Rows go in expert order:
    all-gathered counts per (sender, expert) name each row's expert, so no ids are sent."""
    t, k = idx_TxK.shape
    per_shard = ws[0].shape[0]
    dt = x_TxD.dtype
    expert_A = idx_TxK.reshape(-1)
    order_A = jnp.argsort(expert_A, stable=True)                 # by expert, so by shard
    count_E = jnp.bincount(expert_A, length=n * per_shard).astype(jnp.int32)
    count_NxE = jax.lax.all_gather(count_E, axes, axis=0)        # [sender, expert]
    sizes_NxN = count_NxE.reshape(n, n, per_shard).sum(-1)       # [sender, receiver]
    me = jax.lax.axis_index(axes)
    send_N, recv_N = sizes_NxN[me], sizes_NxN[:, me]
    start_N = jnp.cumsum(send_N) - send_N
    # Where each sender's slice lands on its receiver: after the lower senders' slices.
    at_NxN = jnp.cumsum(sizes_NxN, axis=0) - sizes_NxN
    rows = n * t * min(k, per_shard)                             # dropless worst case
    a2a = functools.partial(ragged_all_to_all, axis_name=axes)
    x_R = a2a(x_TxD[order_A // k], jnp.zeros((rows, x_TxD.shape[1]), dt), start_N,
              send_N, at_NxN[me], recv_N)
    # Received rows: sender by sender, each sender's in expert order. Row r's expert is
    # the (sender, local expert) segment it falls in; past the last one, -1 (padding).
    ends_S = jnp.cumsum(jax.lax.dynamic_slice_in_dim(
        count_NxE, me * per_shard, per_shard, axis=1).reshape(-1))
    seg_R = jnp.searchsorted(ends_S, jnp.arange(rows, dtype=ends_S.dtype), side="right")
    e_R = jnp.where(seg_R < ends_S.shape[0], offset + seg_R % per_shard, -1)
    # Each received row is one assignment (a padding row matches no expert and is 0);
    # its combine weight is applied by the token's own shard.
    y_R = rows_fn(x_R, e_R[:, None].astype(idx_TxK.dtype), *ws, expert_offset=offset)
    home_N = (jnp.cumsum(sizes_NxN, axis=1) - sizes_NxN)[:, me]  # senders' start_N[me]
    y_A = a2a(y_R.astype(dt), jnp.zeros((t * k, x_TxD.shape[1]), dt), at_NxN[:, me],
              recv_N, home_N, send_N)
    return jnp.zeros_like(y_A).at[order_A].set(y_A, unique_indices=True).reshape(t, k, -1)


def exchange_moves_less(dtype, k: int, n: int) -> bool:
    """Whether exchanging (T·K rows each way, b bytes a value) moves fewer bytes than gathering
    (n·T rows in, n·T partial outputs back at b_acc bytes a value): 2·K·b < n·(b + b_acc)."""
    b = jnp.dtype(dtype).itemsize
    return 2 * k * b < n * (b + jnp.dtype(accum_dtype(dtype)).itemsize)


def sharded_experts(experts_fn, mesh, cfg: ModelConfig, rules: dict = sharding.RULES, *,
                    few_experts_fn=None, exchange: bool = False):
    """`experts_fn(x_TxD, idx_TxK, w_TxK, w_gate, w_up, w_down)` (accepting `expert_offset=`)
    under shard_map over `mesh`, the shards the product of the `rules["experts"]` mesh axes.
    `few_experts_fn` (e.g. moe.experts_local_dense) replaces `experts_fn` on shards of ≤ K
    experts; `exchange` (decode): `_exchanged` where cheaper (n > 2K/3 in bfloat16)."""
    batch_axes = tuple(a for a in sharding.spec_axes(rules["batch"]) if mesh.shape[a] > 1)
    expert_axes = tuple(a for a in sharding.spec_axes(rules["experts"]) if mesh.shape[a] > 1)
    ep = cfg.expert_parallel and bool(expert_axes)
    if ep and not set(expert_axes) <= set(batch_axes):
        raise ValueError("expert_parallel: the batch must be split over the expert mesh "
                         f"axes {expert_axes} (sharding.RULES['batch'])")
    n_shards = math.prod(mesh.shape[a] for a in expert_axes)
    rows = P(batch_axes or None, None)

    def run(x_TxD, idx_TxK, w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
        dp = math.prod(mesh.shape[a] for a in batch_axes)
        if x_TxD.shape[0] % dp:
            raise ValueError(f"expert FFN: {x_TxD.shape[0]} tokens do not split over the "
                             f"{dp} data-parallel devices; make the batch a multiple of "
                             "data*fsdp*expert")
        weights = (w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD)
        specs = [sharding.spec(sharding.EXPERT_WEIGHT_AXES[name], w.shape, mesh, rules)
                 for name, w in zip(sharding.EXPERT_WEIGHT_AXES, weights)]
        if ep and not set(expert_axes) <= set(sharding.spec_axes(specs[0][0])):
            raise ValueError(f"expert_parallel: num_experts={w_gate_ExDxF.shape[0]} must "
                             f"be a multiple of the {expert_axes} mesh axes ({n_shards} "
                             "shards)")

        def local(x, idx, w, *ws):
            ws = [_gather(wi, sp, expert_axes if ep else ()) for wi, sp in zip(ws, specs)]
            if not ep:
                return experts_fn(x, idx, w, *ws)
            # The expert shard's index over its axes, in the order the spec splits them.
            ex_axes = tuple(a for a in sharding.spec_axes(specs[0][0]) if a in expert_axes)
            gather = lambda a: jax.lax.all_gather(a, ex_axes, axis=0, tiled=True)
            offset = jax.lax.axis_index(ex_axes) * ws[0].shape[0]
            fn = (few_experts_fn if few_experts_fn is not None
                  and ws[0].shape[0] <= idx.shape[1] else experts_fn)
            if exchange and exchange_moves_less(x.dtype, idx.shape[1], n_shards):
                return _exchanged(fn, ex_axes, n_shards, x, idx, w, ws, offset)
            y_all = fn(gather(x), gather(idx), gather(w), *ws, expert_offset=offset)
            y = jax.lax.psum_scatter(y_all, ex_axes, scatter_dimension=0, tiled=True)
            return y.astype(x.dtype)

        # check_vma=False: the grouped matmuls' loops start from fresh zeros (and Pallas
        # calls carry no varying-axes types), which the checker would reject; the
        # gradients stay exact (shard_map sums a replicated input's cotangent itself).
        return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, *specs),
                             out_specs=rows, check_vma=False)(x_TxD, idx_TxK, w_TxK,
                                                              *weights)

    return run

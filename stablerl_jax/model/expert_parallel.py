"""The expert FFN on a device mesh: `shard_map` with each device's own tokens, and the
experts either sharded (expert parallelism) or gathered layer by layer.

Letters: T tokens (B·T of the forward, flattened), D model, F expert FFN width, E
experts, K top-k, n = size of the `expert` mesh axis, E/n experts per expert shard.

Why shard_map. The grouped dispatch sorts a device's token–expert assignments and runs a
grouped matmul over them; under GSPMD a sort over a sharded token axis, or a Pallas
kernel (a custom call the partitioner cannot split), would gather every device's tokens
onto every device. Inside `shard_map` each device sorts only the tokens it holds.

Two layouts, chosen by ModelConfig.expert_parallel:
- expert parallel (True): a device keeps only the E/n experts of its `expert` shard (the
  experts' other dims are all-gathered over their FSDP axes, as every weight is). It
  gathers the tokens, routes and weights of its n expert-axis peers (an all-gather over
  `expert`, [n·T, D]), runs its own experts on the assignments that chose them
  (`moe.experts_grouped(expert_offset=)`), and reduce-scatters the partial outputs back
  over `expert` (each token's output is the sum over its K experts, which live on
  different shards). Expert weights never cross the `expert` axis: in the compiled HLO
  every all-gather of an expert weight keeps E/n experts (tests/expert_parallel_test.py).
  The sorted buffer is sized for the dropless worst case, every one of the n·T·K
  assignments choosing this shard's experts; the matmuls skip its unused tiles.
- gathered (False): every device all-gathers all E experts' weights for the layer (FSDP
  over experts) and runs them on its own T tokens: no token exchange, more weight
  traffic.

Mesh axis names come from `sharding.RULES` (logical "experts", "embed", "mlp", "batch"),
never from this module. Gradients: the transpose of an all-gather is a reduce-scatter
and shard_map sums the gradient of a weight over the axes it is replicated on, so the
backward pass needs no code here.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from stablerl_jax import sharding
from stablerl_jax.config import ModelConfig

_W_AXES = {"w_gate": ("experts", "embed", "mlp"), "w_up": ("experts", "embed", "mlp"),
           "w_down": ("experts", "mlp", "embed")}


def _axes(part) -> tuple:
    """Mesh axes of one PartitionSpec entry, as a tuple."""
    return () if part is None else (part if isinstance(part, tuple) else (part,))


def _gather(w, spec: P, keep_axes: tuple):
    """All-gather `w` over the mesh axes of every dim of `spec`, except `keep_axes`."""
    for dim, part in enumerate(spec):
        axes = tuple(a for a in _axes(part) if a not in keep_axes)
        if axes:
            w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    return w


def sharded_experts(experts_fn, mesh, cfg: ModelConfig, rules: dict = sharding.RULES, *,
                    few_experts_fn=None):
    """`experts_fn(x_TxD, idx_TxK, w_TxK, w_gate, w_up, w_down)` (moe.experts_grouped with
    its tile and gmm bound, accepting `expert_offset=`) run under shard_map over `mesh`.
    `rules["experts"]` may name several mesh axes (the sampler's serving layout spreads
    the experts over every axis): the expert shards are then their product, and tokens
    are exchanged over all of them. `few_experts_fn` (same signature, e.g.
    moe.experts_local_dense) replaces experts_fn on an expert-parallel shard that holds
    at most K experts (the transformer passes it for decode steps)."""
    batch_axes = tuple(a for a in _axes(rules["batch"]) if mesh.shape[a] > 1)
    expert_axes = tuple(a for a in _axes(rules["experts"]) if mesh.shape[a] > 1)
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
        specs = [sharding.spec(_W_AXES[name], w.shape, mesh, rules)
                 for name, w in zip(_W_AXES, weights)]
        if ep and not set(expert_axes) <= set(_axes(specs[0][0])):
            raise ValueError(f"expert_parallel: num_experts={w_gate_ExDxF.shape[0]} must "
                             f"be a multiple of the {expert_axes} mesh axes ({n_shards} "
                             "shards)")

        def local(x, idx, w, *ws):
            ws = [_gather(wi, sp, expert_axes if ep else ()) for wi, sp in zip(ws, specs)]
            if not ep:
                return experts_fn(x, idx, w, *ws)
            # The expert shard's index over its axes, in the order the spec splits them.
            ex_axes = tuple(a for a in _axes(specs[0][0]) if a in expert_axes)
            gather = lambda a: jax.lax.all_gather(a, ex_axes, axis=0, tiled=True)
            offset = jax.lax.axis_index(ex_axes) * ws[0].shape[0]
            fn = (few_experts_fn if few_experts_fn is not None
                  and ws[0].shape[0] <= idx.shape[1] else experts_fn)
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

"""The per-token decoder layer (model/invariant.py's numerics and letters): `decoder_layer`,
transformer.forward's layer under ModelConfig.batch_invariant, runs per device under `shard_map`
on a mesh (`on_mesh`, `_sharded_layer`), so no tile's products or reductions are split across
devices."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from stablerl_jax import sharding
from stablerl_jax.model import moe
from stablerl_jax.model import numerics as nx
from stablerl_jax.model.attention import rms_norm, rope
from stablerl_jax.model.invariant import (
    attend,
    dot,
    experts,
    first_slots,
    grouped_matmul,
    rowwise,
    token_attention,
)
from stablerl_jax.model.layer_inputs import LayerNumerics, TokenFrame


def decoder_layer(cfg, step: LayerNumerics, frame: TokenFrame, *, put_cache=None,
                  mesh=None, rules=None):
    """`transformer.decoder_layer` per token (same cfg, step, frame, carry, outputs); on a
    multi-device `mesh`, per device (`on_mesh`).
    `put_cache(index, b, kv, k_BxTxKVxDh, v_BxTxKVxDh, layer)` writes `b` rows' keys and values
    into `kv`'s cache at `step.index` and returns (kv, k, v, keys, layer): the cache, this
    layer's keys and values in layout `keys` (stacked: read at `layer`)."""
    numerics, dtype, router_dtype = step.numerics, step.dtype, step.router_dtype
    trace, router_input, mask_BxT = step.trace, step.router_input, frame.mask_BxT
    ctx = {"positions_BxT": frame.positions_BxT, "mask_BxT": mask_BxT,
           "key_mask_BxS": frame.key_mask_BxS, "tokens_BxT": frame.tokens_BxT,
           "segment_ids_BxT": frame.segment_ids_BxT, "index": step.index}
    build = functools.partial(_local_layer, cfg, numerics, dtype, router_dtype,
                              put_cache=put_cache, trace=trace, router_input=router_input)
    if mesh is None or mesh.size == 1:
        body = lambda carry, xs: build(ctx)(carry, xs)
    else:
        body = _sharded_layer(build, ctx, cfg, mesh, rules, outputs=6 if trace else 4)

    def layer(carry, xs):
        carry, (idx, w, probs, logits, *trace_ys) = body(carry, xs)
        flat = lambda a: a.reshape(-1, a.shape[-1])
        load_E, z, balance = moe.router_stats(flat(probs), flat(idx), flat(logits),
                                              mask_BxT.reshape(-1))
        return carry, (idx, w, load_E, z, balance, *trace_ys)

    return layer


def batch_axes(mesh, rules) -> tuple:
    """The mesh axes of more than one device the batch is split over."""
    return tuple(a for a in sharding.spec_axes(rules["batch"]) if mesh.shape[a] > 1)


def on_mesh(fn, mesh, rules=None):
    """`fn(rows, shared)` per device: the batch-major `rows` pytree split over the batch's mesh
    axes, `shared` replicated, the output split like `rows`. Rows get the bits one device gives:
    gathering `shared` and splitting rows only move data. No mesh or one device: `fn` itself."""
    if mesh is None or mesh.size == 1:
        return fn
    rules = sharding.RULES if rules is None else rules
    axes = batch_axes(mesh, rules)
    rows_spec = P(axes or None)

    def run(rows, shared):
        _divides(jax.tree.leaves(rows)[0].shape[0], mesh, axes)
        return jax.shard_map(fn, mesh=mesh, in_specs=(rows_spec, P()), out_specs=rows_spec,
                             check_vma=False)(rows, shared)

    return run


def row_splits(mesh, rules=None) -> int:
    """Parts `on_mesh` splits rows into (1 without a mesh); a call's rows must be a multiple."""
    if mesh is None or mesh.size == 1:
        return 1
    return math.prod(mesh.shape[a] for a in batch_axes(
        mesh, sharding.RULES if rules is None else rules))


def _divides(b: int, mesh, axes):
    dp = math.prod(mesh.shape[a] for a in axes)
    if b % dp:
        raise ValueError(f"batch-invariant numerics: {b} rows do not split over the {dp} "
                         "data-parallel devices; make the batch a multiple of "
                         "data*fsdp*expert")


def _sharded_layer(build, ctx, cfg, mesh, rules, outputs: int):
    """`build(ctx)`'s per-token layer under `shard_map` over the batch's mesh axes, per device on
    its rows and cache rows; weights gathered whole (FSDP), but with expert parallelism only this
    shard's experts (`experts` exchanges rows). Router statistics: the caller's, on the batch."""
    rules = sharding.RULES if rules is None else rules
    axes = batch_axes(mesh, rules)
    row = P(axes or None)
    ex_part = sharding.spec(sharding.EXPERT_WEIGHT_AXES["w_gate"],
                            (cfg.num_experts, cfg.d_model, cfg.expert_ffn_dim), mesh, rules)[0]
    ep_axes = tuple(a for a in sharding.spec_axes(ex_part) if mesh.shape[a] > 1)
    ep_axes = ep_axes if cfg.expert_parallel else ()
    if ep_axes and not set(ep_axes) <= set(axes):
        raise ValueError("expert_parallel: the batch must be split over the expert mesh "
                         f"axes {ep_axes} (sharding.RULES['batch'])")
    ctx_specs = {k: (None if v is None else P() if v.ndim == 0 else row)
                 for k, v in ctx.items()}

    def weight_specs(p):
        experts = sharding.EXPERT_WEIGHT_AXES if ep_axes else {}
        return {k: jax.tree.map(lambda _: P(ex_part) if k in experts else P(), w)
                for k, w in p.items()}

    def layer(carry, xs):
        x, kv = carry
        _divides(x.shape[0], mesh, axes)
        p, layer_idx, replay, replay_w = xs
        # A stacked cache [L, B, ...] is split on its second axis, a layer's own on its first.
        kv_spec = jax.tree.map(lambda c: row if c.ndim == 4 else P(None, axes or None), kv)
        opt = lambda a: None if a is None else row
        specs = ((row, kv_spec), (weight_specs(p), P(), opt(replay), opt(replay_w)),
                 ctx_specs)
        out_specs = ((row, kv_spec), (row,) * outputs)

        def local(carry, xs, ctx):
            return build(ctx, ep_axes=ep_axes)(carry, xs)

        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs,
                             check_vma=False)(carry, xs, ctx)

    return layer


def _local_layer(cfg, numerics, dtype, router_dtype, ctx, *, put_cache, trace, router_input,
                 ep_axes=()):
    """The per-token layer over the rows of `ctx` (decoder_layer's arrays): layer(carry, xs) ->
    (carry, (idx, w, probs, logits[, x_attn, x_block])), batch-major."""
    positions_BxT, key_mask_BxS = ctx["positions_BxT"], ctx["key_mask_BxS"]
    tokens_BxT, segment_ids_BxT = ctx["tokens_BxT"], ctx["segment_ids_BxT"]
    b, t = positions_BxT.shape
    n, d = b * t, cfg.d_model
    h_, kvh, dh, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps
    pos_N = positions_BxT.reshape(n)
    row_N = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    if segment_ids_BxT is None:
        start_N = first_slots(key_mask_BxS)[row_N]
    else:  # each segment is one sequence's real tokens, contiguous (packing.py)
        seg = segment_ids_BxT
        new_BxT = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]],
                                  axis=1)
        start_N = jax.lax.cummax(jnp.where(new_BxT, jnp.arange(t, dtype=jnp.int32), 0),
                                 axis=1).reshape(n)
    quant = lambda x: nx.act_quant(x, numerics)

    def layer(carry, xs):
        x_BxTxD, kv = carry
        p, layer_idx, replay_BxTxK, replay_w_BxTxK = xs
        p = {k: nx.dequantize(w) for k, w in p.items()}

        def pre(x, pos):
            h = quant(rms_norm(x, p["attn_norm"], eps))
            proj = lambda name, heads: dot(h, p[name].reshape(d, heads * dh), dtype).astype(
                dtype).reshape(-1, 1, heads, dh)
            q = rope(rms_norm(proj("wq", h_), p["q_norm"], eps), pos[:, None], cfg.rope_theta)
            k = rope(rms_norm(proj("wk", kvh), p["k_norm"], eps), pos[:, None], cfg.rope_theta)
            return q[:, 0], k[:, 0], proj("wv", kvh)[:, 0]

        q_N, k_N, v_N = rowwise(pre, x_BxTxD.reshape(n, d), pos_N, tile=cfg.row_tile)
        k_new, v_new = (a.reshape(b, t, kvh, dh) for a in (k_N, v_N))
        if put_cache is None:
            k_src, v_src, keys, stacked = k_new, v_new, "bskd", None
        else:
            kv, k_src, v_src, keys, stacked = put_cache(ctx["index"], b, kv, k_new, v_new,
                                                        layer_idx)
        o_N = attend(q_N, pos_N, row_N, start_N, k_src, v_src, key_mask_BxS, kv_heads=kvh,
                     dtype=dtype, keys=keys, tile=cfg.row_tile, layer=stacked,
                     kernel=token_attention(cfg))
        noise = nx.router_noise(numerics, layer_idx, positions_BxT, tokens_BxT,
                                cfg.num_experts)
        noise_N = None if noise.ndim == 0 else noise.reshape(n, -1)
        flat = lambda r: None if r is None else r.reshape(n, -1)

        def post(o, x, noise, replay, replay_w):
            x = x + dot(quant(o.reshape(o.shape[0], h_ * dh)),
                        p["wo"].reshape(h_ * dh, d), dtype).astype(dtype)
            h = rms_norm(x, p["mlp_norm"], eps)
            h_router = h if router_input is None else router_input(x, p["mlp_norm"])
            logits = dot(h_router, p["router"], router_dtype)
            if noise is not None:
                logits = logits + noise
            idx, w, probs = moe.route(logits, cfg.top_k, replay, replay_w,
                                      normalize=cfg.norm_topk_prob)
            return x, quant(h), idx, w, probs, logits

        x_N, h_N, idx_NxK, w_NxK, probs_NxE, logits_NxE = rowwise(
            post, o_N, x_BxTxD.reshape(n, d), noise_N, flat(replay_BxTxK),
            flat(replay_w_BxTxK), tile=cfg.row_tile)
        y_N = experts(h_N, idx_NxK, w_NxK, p["w_gate"].astype(dtype),
                      p["w_up"].astype(dtype), p["w_down"].astype(dtype), tile=cfg.moe_tile,
                      ep_axes=ep_axes, row_tile=cfg.row_tile,
                      gmm=grouped_matmul(cfg.gmm_impl))
        x_BxTxD = (x_N + y_N).reshape(b, t, d)
        ys = tuple(a.reshape(b, t, -1) for a in (idx_NxK, w_NxK, probs_NxE, logits_NxE))
        trace_ys = (x_N.reshape(b, t, d), x_BxTxD) if trace else ()
        return (x_BxTxD, kv), ys + trace_ys

    return layer

"""The sampler as roofline.py prices it: a pass's rows and what each holds in HBM, and the
programs of one decode step, its head and one layer's key-block attention, each compiled on its
own (roofline.py's docstring: why, how their costs make a decode step, and the letters B, P, C,
S, L, KV, Dh). Nothing here runs them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from stablerl_jax import sharding
from stablerl_jax.config import ExperimentConfig
from stablerl_jax.kernels import decode_attention, decode_attention_pallas
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.model.attention import rms_norm
from stablerl_jax.model.invariant import cache_slots, runs_token_kernel
from stablerl_jax.sampling import rollout


def rows_per_pass(cfg: ExperimentConfig) -> int:
    """Rows the sampler decodes at once (sampling.max_batch, else the whole step)."""
    return cfg.sampling.max_batch or cfg.rl.prompts_per_step * cfg.rl.group_size


def kv_bytes_per_row(cfg: ExperimentConfig) -> int:
    """KV cache bytes of a sampled row: L × 2 (K, V) × S × KV × Dh in the compute dtype."""
    mc = cfg.model
    s = cfg.task.max_prompt_len + cfg.sampling.max_new_tokens
    dtype = nx.compute_dtype(nx.numerics_preset(cfg.sampling.numerics), mc.compute_dtype)
    return mc.num_layers * 2 * s * mc.num_kv_heads * mc.head_dim * jnp.dtype(dtype).itemsize


def row_state_bytes(cfg: ExperimentConfig) -> int:
    """Per-row sampler bytes beside the KV cache: S-slot tokens, log μ, masks, routes and route
    weights (int32 / float32 per layer and expert), float32 vocabulary logits."""
    mc = cfg.model
    s = cfg.task.max_prompt_len + cfg.sampling.max_new_tokens
    return s * (4 + 4 + 2 + 8 * mc.num_layers * mc.top_k) + 4 * mc.vocab_size


def rows_that_fit(cfg: ExperimentConfig, sample_total_gib: float, hbm_gib: float,
                  chips: int) -> int:
    """Rows per chip whose KV cache and row state fit in `hbm_gib`, given the compiled sample
    step's per-chip total at its rows per chip (the rest fixed: weights, buffers)."""
    per_row = (kv_bytes_per_row(cfg) + row_state_bytes(cfg)) / 2**30
    fixed = sample_total_gib - rows_per_pass(cfg) / chips * per_row
    return int((hbm_gib - fixed) // per_row)


def _sampler_weights(engine):
    """(model, numerics, abstract decode-layout weights, shardings, rules, serve) of sampling."""
    cfg, mesh = engine.cfg, engine.mesh
    model = rollout.sampler_model(cfg.model, cfg.sampling)
    numerics = nx.of_sampling(cfg.sampling, 0)
    serve = cfg.sampling.layout == "serve"
    params_like = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), model))
    weights_like = jax.eval_shape(
        lambda p: nx.prepare_params(p, numerics, keep_quantized=serve), params_like)
    rules = sharding.serve_rules(model.expert_parallel) if serve else sharding.RULES
    w_sh = rollout.serving_shardings(weights_like, model, mesh, rules)
    return model, numerics, weights_like, w_sh, rules, serve


def sampler_weight_bytes(engine) -> int:
    """Bytes of the sampler's weights in its decode layout, all chips together: what a trainer
    pushes to a separate sampler after each update."""
    weights_like = _sampler_weights(engine)[2]
    return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(weights_like))


def decode_step_program(engine):
    """(function, abstract args) of one jitted decode step as the sampler's loop runs it (a
    one-token forward of all L layers against the KV cache, logits, sampled distribution). In:
    weights in the decode layout (serving e4m3 + scales and shardings, or training shardings), a
    token per row of a pass, the cache; out: the sampled distribution, the cache."""
    cfg, mesh = engine.cfg, engine.mesh
    model, numerics, weights_like, w_sh, rules, serve = _sampler_weights(engine)
    # Priced with the reference decode attention: XLA's cost analysis cannot see into a
    # Pallas kernel (it counts a custom call's whole cache operand as read), and the
    # ragged kernel reads per row what the reference reads per row up to that row's
    # slot (schedule_prices.SamplerPrices prices the difference). A per-token kernel
    # (batch-invariant numerics) is priced as itself: it declares what it reads
    # (decode_attention_pallas.token_cost), here one key block per query, as XLA counts
    # the reference's block loop once.
    if not token_kernel(engine):
        model = model.replace(decode_attention_impl="blocks")
    model_mesh = mesh if mesh.size > 1 else None
    b = rows_per_pass(cfg)
    s = cfg.task.max_prompt_len + cfg.sampling.max_new_tokens
    cache_like = jax.eval_shape(lambda: tf.init_cache(
        model, b, s, nx.compute_dtype(numerics, model.compute_dtype)))
    rows = sharding.RULES["batch"]
    # [L, B, ...] stacked, or L buffers [B, ...] (unrolled layers), in either cache layout
    kv_sh = jax.tree.map(lambda a: NamedSharding(mesh, P(*(None,) * (a.ndim - 4), rows)),
                         cache_like["k"])
    cache_sh = {"k": kv_sh, "v": kv_sh, "mask": NamedSharding(mesh, P(rows)),
                "index": sharding.replicated(mesh)}
    batch = sharding.batch_sharding(mesh)

    def step(weights, tok_B, cache):
        with decode_attention_pallas.priced_blocks(1):
            h, aux = tf.forward(weights, tok_B[:, None], model,
                                attention_mask_BxT=jnp.ones((b, 1), bool), numerics=numerics,
                                cache=cache, mesh=model_mesh,
                                rules=rules if serve and model_mesh else None)
        logp = rollout.next_logprobs(weights, h[:, 0], model, cfg.sampling, numerics,
                                     model_mesh, rules if serve and model_mesh else None,
                                     cfg.rl.logprob_impl)
        return logp, aux["cache"], aux["routes"]

    fn = jax.jit(step, in_shardings=(w_sh, batch, cache_sh),
                 out_shardings=(batch, cache_sh, batch), donate_argnums=2)
    return fn, (weights_like, jax.ShapeDtypeStruct((b,), jnp.int32), cache_like)


def head_program(engine):
    """(function, abstract args) of the decode step without its layers (embedding lookup, final
    norm, logits, sampled distribution), in the same layout. Loop-free."""
    cfg, mesh = engine.cfg, engine.mesh
    model, numerics, weights_like, w_sh, rules, serve = _sampler_weights(engine)
    dtype = nx.compute_dtype(numerics, model.compute_dtype)
    batch = sharding.batch_sharding(mesh)

    def head(weights, tok_B):
        h = rms_norm(weights["embed"][tok_B[:, None]].astype(dtype), weights["final_norm"],
                     model.norm_eps)
        return rollout.next_logprobs(weights, h[:, 0], model, cfg.sampling, numerics,
                                     mesh if mesh.size > 1 else None,
                                     rules if serve and mesh.size > 1 else None,
                                     cfg.rl.logprob_impl)

    fn = jax.jit(head, in_shardings=(w_sh, batch), out_shardings=batch)
    return fn, (weights_like, jax.ShapeDtypeStruct((rows_per_pass(cfg),), jnp.int32))


def token_kernel(engine) -> bool:
    """Whether sampling runs a per-token Pallas kernel on TPU (invariant.runs_token_kernel)."""
    return (runs_token_kernel(rollout.sampler_model(engine.cfg.model, engine.cfg.sampling))
            and engine.mesh.devices.flat[0].platform == "tpu")


def token_block_cost(engine) -> dict:
    """{"flops", "bytes accessed"} of one more key block of the per-token kernel for this chip's
    pass rows (one query each): its declared cost (decode_attention_pallas.token_cost) at two
    blocks minus at one."""
    cfg, model = engine.cfg, rollout.sampler_model(engine.cfg.model, engine.cfg.sampling)
    rows = NamedSharding(engine.mesh, P(sharding.RULES["batch"])).shard_shape(
        (rows_per_pass(cfg),))[0]
    dtype = nx.compute_dtype(nx.of_sampling(cfg.sampling, 0), model.compute_dtype)
    s = cache_slots(model, cfg.task.max_prompt_len + cfg.sampling.max_new_tokens)
    kv, dh = model.num_kv_heads, model.head_dim
    cost = lambda blocks: decode_attention_pallas.token_cost(
        rows, kv, model.num_heads // kv, dh, jnp.dtype(dtype).itemsize, model.decode_block,
        s, blocks)
    one, two = cost(1), cost(2)
    return {"flops": two.flops - one.flops,
            "bytes accessed": two.bytes_accessed - one.bytes_accessed}


def decode_block_program(engine):
    """(function, abstract args) of one layer's jitted decode attention (the reference "blocks"
    of kernels/decode_attention.py) for a pass's rows against the whole S-slot cache, rows split
    as in the sampler. XLA counts its loop body, one key block, once: one block's cost (a
    one-block cache would be staged whole on chip, unlike in a decode step)."""
    cfg, mesh = engine.cfg, engine.mesh
    model = rollout.sampler_model(cfg.model, cfg.sampling)
    dtype = nx.compute_dtype(nx.of_sampling(cfg.sampling, 0), model.compute_dtype)
    b, blk, keys = rows_per_pass(cfg), model.decode_block, model.kv_cache_layout
    s = cfg.task.max_prompt_len + cfg.sampling.max_new_tokens
    kv_shape = tuple({"b": b, "s": s, "k": model.num_kv_heads, "d": model.head_dim}[a]
                     for a in keys)
    q_like = jax.ShapeDtypeStruct((b, model.num_kv_heads, model.num_heads // model.num_kv_heads,
                                   model.head_dim), dtype)
    kv_like = jax.ShapeDtypeStruct(kv_shape, dtype)
    args = (q_like, kv_like, kv_like, jax.ShapeDtypeStruct((b, s), bool),
            jax.ShapeDtypeStruct((), jnp.int32))
    rows = NamedSharding(mesh, P(sharding.RULES["batch"]))
    fn = jax.jit(lambda q, k, v, m, last: decode_attention.blocks(
        q, k, v, m, last, block=blk, keys=keys),
        in_shardings=(rows, rows, rows, rows, sharding.replicated(mesh)), out_shardings=rows)
    return fn, args

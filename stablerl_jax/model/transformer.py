"""The Qwen3-MoE style decoder as pure functions over a params pytree.

Letters: B batch, T tokens, S cache slots, D model, H heads, Dh head width, E experts, K top-k, F
expert FFN width, V vocab, L layers.

    tokens ─ embed ─▶ L × [ RMSNorm → GQA attention (RoPE, q/k RMSNorm) → +residual
                            RMSNorm → router softmax → top-k (or replay) → SwiGLU experts
                            → +residual ] ─▶ RMSNorm ─▶ hidden_BxTxD

Per-layer weights are stacked on a leading L axis and scanned (`lax.scan`). Route tensors are
batch-major at the interface (`replay_BxTxLxK` in, aux["routes"] [B, T, L, K] out: one batch
sharding), layer-major inside, scanned with the weights, so Routing Replay works with scanned and
rematerialized layers. The KV cache rides in the carry, each layer writing its slots in place.

`forward` returns hidden states: log-probs come from a fused op that never builds [B, T, V]
logits (stablerl_jax/method/logprobs.py); `logits` serves sampling and tests.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from stablerl_jax import input_checks
from stablerl_jax.config import ModelConfig
from stablerl_jax.model import attention as att
from stablerl_jax.model import expert_parallel, invariant, invariant_layer, moe
from stablerl_jax.model import numerics as nx
from stablerl_jax.model.layer_inputs import LayerNumerics, TokenFrame
from stablerl_jax.model.attention import (
    attention,
    decode_attention_fn,
    positions_from_mask,
    rms_norm,
)
from stablerl_jax.model.numerics import dtype_of


def _shapes(cfg: ModelConfig) -> dict:
    L, D, H, KV, Dh = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    E, F = cfg.num_experts, cfg.expert_ffn_dim
    return {
        "attn_norm": ((L, D), ("layers", "norm")),
        "wq": ((L, D, H, Dh), ("layers", "embed", "heads", "head_dim")),
        "wk": ((L, D, KV, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ((L, D, KV, Dh), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ((L, H, Dh, D), ("layers", "heads", "head_dim", "embed")),
        "q_norm": ((L, Dh), ("layers", "norm")),
        "k_norm": ((L, Dh), ("layers", "norm")),
        "mlp_norm": ((L, D), ("layers", "norm")),
        "router": ((L, D, E), ("layers", "embed", "router_experts")),
        "w_gate": ((L, E, D, F), ("layers", "experts", "embed", "mlp")),
        "w_up": ((L, E, D, F), ("layers", "experts", "embed", "mlp")),
        "w_down": ((L, E, F, D), ("layers", "experts", "mlp", "embed")),
    }


def param_logical_axes(cfg: ModelConfig) -> dict:
    """The params tree with a tuple of logical axis names in place of each array."""
    axes = {"embed": ("vocab", "embed"), "final_norm": ("norm",),
            "layers": {k: a for k, (_, a) in _shapes(cfg).items()}}
    if not cfg.tie_embeddings:
        axes["unembed"] = ("embed", "vocab")
    return axes


def init_params(key: jax.Array, cfg: ModelConfig) -> dict:
    """Normal(0, init_std) matrices (output projections scaled by 1/√(2L)), unit norms."""
    dtype = dtype_of(cfg.param_dtype)
    shapes = _shapes(cfg)
    keys = dict(zip(list(shapes) + ["embed", "unembed"], jax.random.split(key, len(shapes) + 2)))
    out_scale = (2 * cfg.num_layers) ** -0.5

    def init(name, shape):
        if name.endswith("norm"):
            return jnp.ones(shape, dtype)
        std = cfg.init_std * (out_scale if name in ("wo", "w_down") else 1.0)
        return (std * jax.random.normal(keys[name], shape, jnp.float32)).astype(dtype)

    params = {
        "embed": init("embed", (cfg.vocab_size, cfg.d_model)),
        "final_norm": jnp.ones((cfg.d_model,), dtype),
        "layers": {name: init(name, shape) for name, (shape, _) in shapes.items()},
    }
    if not cfg.tie_embeddings:
        params["unembed"] = init("unembed", (cfg.d_model, cfg.vocab_size))
    return params


def unembed_matrix(params: dict, cfg: ModelConfig) -> jax.Array:
    """The D×V output projection (the transposed embedding when tied)."""
    return params["embed"].T if cfg.tie_embeddings else params["unembed"]


def logits(params: dict, hidden_BxTxD: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Float32 logits (accumulated in float32, or float64 for float64 hidden states)."""
    w = unembed_matrix(params, cfg).astype(hidden_BxTxD.dtype)
    return jnp.einsum("btd,dv->btv", hidden_BxTxD, w, precision=nx.PRECISION,
                      preferred_element_type=nx.accum_dtype(hidden_BxTxD.dtype))


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> dict:
    """Empty KV cache of `length` slots: k/v [L, B, S, KV, Dh] ([L, B, KV, S, Dh] for
    cfg.kv_cache_layout 'bksd'), slot mask, write index; with cfg.unroll_layers, L buffers each
    updated in place (a stacked layer slice is a copy per step); plus the unwritten slots a
    per-token kernel's tiles may want (invariant.cache_slots)."""
    if length > cfg.max_seq_len:
        raise ValueError(f"cache length {length} exceeds max_seq_len={cfg.max_seq_len}; "
                         "raise ModelConfig.max_seq_len or shorten prompt + max_new_tokens")
    length = invariant.cache_slots(cfg, length)
    layer = {"b": batch, "s": length, "k": cfg.num_kv_heads, "d": cfg.head_dim}
    shape = tuple(layer[a] for a in cfg.kv_cache_layout)
    if cfg.unroll_layers:
        k = v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    else:
        k = v = jnp.zeros((cfg.num_layers, *shape), dtype)
    return {"k": k, "v": v, "mask": jnp.zeros((batch, length), bool),
            "index": jnp.zeros((), jnp.int32)}


def _check_inputs(tokens_BxT, cfg, replay, mask, checks=None):
    """Shapes and dtypes always; values under `checks` (input_checks.py)."""
    input_checks.tokens(tokens_BxT, cfg.vocab_size, checks=checks)
    if mask is not None:
        input_checks.mask(mask, tokens_BxT.shape, name="attention_mask", checks=checks)
    if replay is not None:
        moe.validate_replay(replay, tokens_BxT.shape + (cfg.num_layers,), cfg.top_k,
                            cfg.num_experts)


def forward(params: dict, tokens_BxT: jax.Array, cfg: ModelConfig, *,
            attention_mask_BxT: jax.Array | None = None,
            positions_BxT: jax.Array | None = None,
            segment_ids_BxT: jax.Array | None = None,
            replay_BxTxLxK: jax.Array | None = None,
            replay_weights_BxTxLxK: jax.Array | None = None,
            numerics: nx.Numerics = nx.TRAIN,
            cache: dict | None = None,
            gmm: moe.GroupedMatmul | None = None,
            mesh=None, rules: dict | None = None, checks: bool | None = None,
            trace: bool = False):
    """Run the decoder: (hidden_BxTxD, aux).

    Args:
      attention_mask_BxT: True for real tokens (default: all); padding never influences them.
      positions_BxT: RoPE positions (default: counted over real tokens).
      segment_ids_BxT: packed rows (stablerl_jax/packing.py), 0 on padding, non-decreasing;
        attention and default positions per segment. No cache.
      replay_BxTxLxK: expert indices replacing the router's top-k; K entries of -1 route live.
      replay_weights_BxTxLxK: recorded combine weights of those routes, held fixed (`moe.route`).
      numerics: how to compute (training: the default "train").
      cache: from `init_cache`; tokens are written at its index (scalar, or [B]: one a row).
      gmm: grouped matmul for `cfg.dispatch == "grouped"` (default: `cfg.gmm_impl`'s).
      mesh: the caller's jit mesh; on several devices the grouped expert FFN and a Pallas decode
        attention run per device under shard_map (model/expert_parallel.py).
      checks: also check input values (ids in [0, V), mask in {0, 1}); shapes and dtypes are
        always checked (stablerl_jax/input_checks.py).
      trace: also return each layer's residual streams, aux["trace"] "attention" and "block"
        ([B, T, L, D] each), to compare engines layer by layer (bitwise_check.py).

    aux: routes [B,T,L,K] int32, route_weights [B,T,L,K], expert_load [L,E], router_z_loss [L],
    load_balance_loss [L], router_loss (weighted scalar), and the updated cache if given.
    """
    _check_inputs(tokens_BxT, cfg, replay_BxTxLxK, attention_mask_BxT, checks)
    if numerics.name == "bitwise" and not cfg.batch_invariant:
        raise ValueError("numerics 'bitwise' computes per token only under "
                         "ModelConfig.batch_invariant=True (an override "
                         "sampling.numerics=bitwise sets it); pass the model that way")
    if replay_weights_BxTxLxK is not None:
        moe.validate_replay_weights(replay_weights_BxTxLxK, replay_BxTxLxK, cfg.top_k)
    if segment_ids_BxT is not None and cache is not None:
        raise ValueError("forward: segment_ids_BxT (packed rows) apply without a cache")
    b, t = tokens_BxT.shape
    dtype = nx.compute_dtype(numerics, cfg.compute_dtype)
    router_dtype, router_input = _router_numerics(cfg, numerics, dtype)
    mask_BxT = (jnp.ones((b, t), bool) if attention_mask_BxT is None
                else attention_mask_BxT.astype(bool))
    key_mask_BxS, slots_T, offset_B = _cache_frame(cache, mask_BxT)
    if positions_BxT is None:
        positions_BxT = positions_from_mask(mask_BxT, offset_B, segment_ids_BxT)
    frame = TokenFrame(positions_BxT, key_mask_BxS, slots_T, mask_BxT, tokens_BxT,
                       segment_ids_BxT)
    step = LayerNumerics(numerics, dtype, router_dtype, router_input,
                         None if cache is None else cache["index"], trace)
    layer = _layer(cfg, step, frame, cache is not None, gmm, mesh, rules)
    layer_major = lambda r: None if r is None else jnp.transpose(r, (2, 0, 1, 3))
    xs = (params["layers"], jnp.arange(cfg.num_layers), layer_major(replay_BxTxLxK),
          layer_major(replay_weights_BxTxLxK))
    x = params["embed"][tokens_BxT].astype(dtype)
    x, kv, ys = _run_layers(layer, x, xs, cache, cfg)
    routes_LxBxTxK, weights_LxBxTxK, load, z, balance = ys[:5]
    hidden_BxTxD = _final_norm(x, params["final_norm"], cfg, mesh, rules)
    batch_major = lambda y: jnp.transpose(y, (1, 2, 0, 3))
    aux = {
        "routes": batch_major(routes_LxBxTxK),
        "route_weights": batch_major(weights_LxBxTxK),
        "expert_load": load,
        "router_z_loss": z,
        "load_balance_loss": balance,
        "router_loss": (cfg.router_z_loss_weight * jnp.mean(z)
                        + cfg.router_aux_loss_weight * jnp.mean(balance)),
    }
    if trace:
        aux["trace"] = {name: batch_major(y) for name, y in zip(("attention", "block"), ys[5:])}
    if cache is not None:
        aux["cache"] = {"k": kv[0], "v": kv[1], "mask": key_mask_BxS,
                        "index": cache["index"] + t}
    return hidden_BxTxD, aux


def _router_numerics(cfg: ModelConfig, numerics: nx.Numerics, dtype):
    """(router dtype, router input). A named router dtype (bf16 / fp8 presets, or model /
    sampling.router_dtype) also feeds the router the normalized hidden state before its rounding
    to the compute dtype; unnamed: the rounded one (router input None)."""
    named = numerics.router_dtype or cfg.router_dtype
    router_dtype = dtype_of(named) if named else nx.accum_dtype(dtype)
    wider = named and jnp.dtype(router_dtype).itemsize > jnp.dtype(dtype).itemsize
    router_input = ((lambda x, scale: rms_norm(x.astype(router_dtype), scale, cfg.norm_eps))
                    if wider else None)
    return router_dtype, router_input


def _cache_frame(cache: dict | None, mask_BxT: jax.Array):
    """(key mask [B, S], slots of this call's tokens, real tokens before them [B] or None),
    without a cache (S = T) or with one (index scalar, or [B] for the continuous sampler)."""
    b, t = mask_BxT.shape
    if cache is None:
        return mask_BxT, jnp.arange(t), None
    index = cache["index"]
    if index.ndim:
        key_mask_BxS = cache["mask"].at[jnp.arange(b), index].set(mask_BxT[:, 0])
        slots_T = index[:, None] + jnp.arange(t)  # [B, T]
    else:
        key_mask_BxS = jax.lax.dynamic_update_slice_in_dim(cache["mask"], mask_BxT, index, 1)
        slots_T = index + jnp.arange(t)
    return key_mask_BxS, slots_T, jnp.sum(cache["mask"], axis=1, dtype=jnp.int32)


def decoder_layer(cfg: ModelConfig, step: LayerNumerics, frame: TokenFrame, experts, decode):
    """The decoder layer for `lax.scan`, `(carry, xs) -> (carry, ys)`: carry (x_BxTxD, kv or
    None), xs (params, index, replayed routes and weights), ys (routes, weights, load, z and
    balance losses[, residual streams if `step.trace`]). `experts`: from `_experts_fn`; `decode`:
    decode attention or None."""
    b, t = frame.tokens_BxT.shape

    def layer(carry, xs):
        x_BxTxD, kv = carry
        p, layer_idx, replay_BxTxK, replay_w_BxTxK = xs
        # Quantized weights (prepare_params(keep_quantized=True)) are widened here, one
        # layer at a time, so only their e4m3 bytes stay resident.
        p = {k: nx.dequantize(w) for k, w in p.items()}
        h = rms_norm(x_BxTxD, p["attn_norm"], cfg.norm_eps)
        a, kv = attention(p, h, frame.positions_BxT, frame.key_mask_BxS, frame.slots_T, cfg,
                          step.numerics, step.dtype, kv, step.index, layer_idx,
                          frame.segment_ids_BxT, decode)
        x_BxTxD = x_BxTxD + a
        x_attn = x_BxTxD
        h = rms_norm(x_BxTxD, p["mlp_norm"], cfg.norm_eps)
        h_router = h if step.router_input is None else step.router_input(x_BxTxD,
                                                                         p["mlp_norm"])
        router_logits = jnp.einsum("btd,de->bte", h_router.astype(step.router_dtype),
                                   p["router"].astype(step.router_dtype),
                                   precision=nx.PRECISION,
                                   preferred_element_type=nx.accum_dtype(step.router_dtype))
        router_logits = router_logits + nx.router_noise(
            step.numerics, layer_idx, frame.positions_BxT, frame.tokens_BxT, cfg.num_experts)
        flat = lambda r: None if r is None else r.reshape(b * t, -1)
        logits_TxE = router_logits.reshape(b * t, -1)
        idx_TxK, w_TxK, probs_TxE = moe.route(logits_TxE, cfg.top_k, flat(replay_BxTxK),
                                              flat(replay_w_BxTxK),
                                              normalize=cfg.norm_topk_prob)
        h_TxD = nx.act_quant(h.reshape(b * t, -1), step.numerics)
        y = experts(h_TxD, idx_TxK, w_TxK, p["w_gate"].astype(step.dtype),
                    p["w_up"].astype(step.dtype), p["w_down"].astype(step.dtype))
        x_BxTxD = x_BxTxD + y.reshape(b, t, -1)
        load_E, z, balance = moe.router_stats(probs_TxE, idx_TxK, logits_TxE,
                                              frame.mask_BxT.reshape(-1))
        ys = (idx_TxK.reshape(b, t, -1), w_TxK.reshape(b, t, -1), load_E, z, balance)
        return (x_BxTxD, kv), ys + ((x_attn, x_BxTxD) if step.trace else ())

    return layer


def _layer(cfg: ModelConfig, step: LayerNumerics, frame: TokenFrame, cached: bool, gmm, mesh,
           rules):
    """The layer `forward` scans: `decoder_layer`, or under `cfg.batch_invariant` its per-token
    twin (with the plain layer's backward), rematerialized as `cfg.remat` says."""
    t = frame.tokens_BxT.shape[1]
    experts = _experts_fn(cfg, gmm, mesh, rules, decode=cached and t == 1)
    decode = (decode_attention_fn(cfg, mesh, rules)
              if cached and t == 1 and cfg.decode_block else None)
    plain = lambda frame: decoder_layer(cfg, step, frame, experts, decode)
    layer, remat = plain(frame), cfg.remat
    if cfg.batch_invariant:
        def tiled(frame):
            put = functools.partial(_put_cache, cfg) if cached else None
            return invariant_layer.decoder_layer(cfg, step, frame, put_cache=put, mesh=mesh,
                                                 rules=rules)

        if cached:
            layer = tiled(frame)
        else:
            # The trainer's backward pass is the plain layer's, with the tiles' routes
            # replayed: only the values must be per token, and the tiles' backward is
            # most of their cost.
            layer = invariant.with_reference_gradient(
                lambda frame, carry, xs: tiled(frame)(carry, xs),
                lambda routes, frame, carry, xs: plain(frame)(
                    carry, (xs[0], xs[1], routes, xs[3])),
                keep=lambda out: out[1][0])
            layer = functools.partial(layer, frame)
            remat = "none"  # the custom VJP keeps only the layer's inputs (remat "full")
    if remat == "full":
        return jax.checkpoint(layer, prevent_cse=False)
    if remat == "dots":
        return jax.checkpoint(layer, prevent_cse=False,
                              policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return layer


def _run_layers(layer, x, xs, cache: dict | None, cfg: ModelConfig):
    """(x, kv cache or None, the layers' stacked outputs) of `layer` over the layers."""
    if cache is not None and cfg.unroll_layers:
        # Per-layer cache buffers (init_cache): a Python loop, so each layer reads and
        # writes its own buffer.
        ys, kv = [], []
        for i, kv_i in enumerate(zip(cache["k"], cache["v"])):
            (x, kv_i), y = layer((x, kv_i), jax.tree.map(lambda a: a[i], xs))
            ys.append(y)
            kv.append(kv_i)
        return x, tuple(zip(*kv)), jax.tree.map(lambda *a: jnp.stack(a), *ys)
    # The stacked KV cache is carried (each layer writes its slots in place), not
    # scanned: a scanned cache would be re-stacked across layers on every decode step.
    kv = None if cache is None else (cache["k"], cache["v"])
    (x, kv), ys = jax.lax.scan(layer, (x, kv), xs,
                               unroll=cfg.num_layers if cfg.unroll_layers else 1)
    return x, kv, ys


def _final_norm(x, scale, cfg: ModelConfig, mesh, rules):
    """The final RMSNorm; per token under `cfg.batch_invariant`."""
    if not cfg.batch_invariant:
        return rms_norm(x, scale, cfg.norm_eps)
    norm = invariant.with_reference_gradient(
        lambda x, scale: invariant.rowwise(
            lambda r: rms_norm(r, scale, cfg.norm_eps), x.reshape(-1, x.shape[-1]),
            tile=cfg.row_tile).reshape(x.shape),
        lambda _, x, scale: rms_norm(x, scale, cfg.norm_eps))
    return invariant_layer.on_mesh(norm, mesh, rules)(x, scale)


def _put_cache(cfg: ModelConfig, index, b: int, kv, k_BxTxKVxDh, v_BxTxKVxDh, layer):
    """The batch-invariant layer's cache write at `index` (as `attention.attention` writes):
    returns (kv, k, v, layout, layer), k and v this layer's own buffers, or the stacked ones with
    `layer` their index (None for own buffers), read in place."""
    keys = cfg.kv_cache_layout
    to_cache = (lambda x: x) if keys == "bskd" else (lambda x: jnp.swapaxes(x, 1, 2))
    own = kv[0].ndim == len(keys)
    put = att._cache_put(keys, index, None if own else layer, b)
    kv = tuple(att._write(c, to_cache(x), put) for c, x in zip(kv, (k_BxTxKVxDh, v_BxTxKVxDh)))
    return (kv, *kv, keys, None if own else layer)


def _experts_fn(cfg: ModelConfig, gmm, mesh, rules, decode: bool):
    """The expert FFN. Decode: shards of ≤ K experts run them densely (moe.experts_local_dense,
    no sort); many shards exchange tokens (expert_parallel._exchanged). Else grouped over
    gathered tokens."""
    if cfg.dispatch == "dense":
        return moe.experts_dense
    kw = {"tile": cfg.moe_tile, "gmm": gmm if gmm is not None else moe.gmm_of(cfg.gmm_impl)}
    fn = lambda *a, **k: moe.experts_grouped(*a, **kw, **k)
    if mesh is None or mesh.size == 1:
        return fn
    ep_kw = {"few_experts_fn": moe.experts_local_dense if decode else None,
             "exchange": decode}
    if rules is not None:
        ep_kw["rules"] = rules
    return expert_parallel.sharded_experts(fn, mesh, cfg, **ep_kw)

"""Hugging Face `Qwen3MoeConfig` (config.json) ↔ our `ModelConfig`.

    config.json                         ModelConfig
    vocab_size                          vocab_size
    hidden_size                         d_model
    num_hidden_layers                   num_layers
    num_attention_heads                 num_heads
    num_key_value_heads                 num_kv_heads
    head_dim (else hidden/heads)        head_dim
    num_experts | num_local_experts     num_experts          (transformers 4 | 5 spelling)
    num_experts_per_tok                 top_k
    norm_topk_prob                      norm_topk_prob       (HF's default is False)
    moe_intermediate_size               expert_ffn_dim
    rope_theta | rope_parameters        rope_theta           (4 | 5 spelling; default RoPE only)
    rms_norm_eps                        norm_eps
    tie_word_embeddings                 tie_embeddings
    max_position_embeddings             max_seq_len
    torch_dtype | dtype                 param_dtype
    router_aux_loss_coef                router_aux_loss_weight = coef · K if
                                        output_router_logits else 0 (see below)

Refused, with the field named: a model_type other than qwen3_moe; attention biases;
sliding-window attention; an activation other than SiLU; RoPE scaling (yarn, linear,
…); dense MLP layers mixed in (`mlp_only_layers` non-empty or `decoder_sparse_step` ≠ 1:
every layer of our decoder is an MoE layer).

Load-balancing loss. HF adds `router_aux_loss_coef · aux` to the loss only when
`output_router_logits` is true (false in Qwen3-30B-A3B's config.json), with aux = E ·
Σ_{e,k} f_{k,e} P_e pooled over all layers (f: fraction of tokens whose k-th choice is
e), which is K times our per-layer E · Σ_e load_e P_e (load normalized over the K slots)
when every layer has the same statistics; hence the factor K. Ours averages the
per-layer values rather than pooling the layers.
"""
from __future__ import annotations

from stablerl_jax.config import DTYPES, ConfigError, ModelConfig

_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                 "float64": "float64"}


def _get(hf: dict, *names, default=None, required=True):
    for n in names:
        if n in hf and hf[n] is not None:
            return hf[n]
    if required and default is None:
        raise ConfigError(f"config.json: missing {' / '.join(names)}; is this a Qwen3-MoE "
                          "checkpoint?")
    return default


def _refuse(cond: bool, field: str, msg: str) -> None:
    if cond:
        raise ConfigError(f"config.json: {field}: {msg}")


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    _refuse(kind != "default", "rope_scaling / rope_parameters.rope_type",
            f"{kind!r} RoPE is not implemented (only the default rotary embedding); "
            "use a checkpoint without RoPE scaling")
    return float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """The ModelConfig of a Qwen3-MoE config.json (a dict); `overrides` replace any
    ModelConfig field afterwards (e.g. max_seq_len=4096, compute_dtype='bfloat16',
    param_dtype='float32' to upcast on load, dispatch='dense')."""
    return ModelConfig(**{**checkpoint_fields(hf), **overrides})


def checkpoint_fields(hf: dict) -> dict:
    """{ModelConfig field: value} of every field a Qwen3-MoE config.json defines (the
    table in the module docstring), checked; every other field is how to compute, not
    what the model is, and config.json says nothing about it."""
    _refuse(hf.get("model_type", "qwen3_moe") != "qwen3_moe", "model_type",
            f"must be 'qwen3_moe', got {hf.get('model_type')!r}")
    _refuse(bool(hf.get("attention_bias", False)), "attention_bias",
            "attention biases are not implemented; our q/k/v/o projections have none")
    _refuse(bool(hf.get("use_sliding_window", False)), "use_sliding_window",
            "sliding-window attention is not implemented; set it to false if unused")
    _refuse(hf.get("hidden_act", "silu") != "silu", "hidden_act",
            f"our experts are SwiGLU (SiLU), got {hf.get('hidden_act')!r}")
    layers = int(_get(hf, "num_hidden_layers"))
    dense = list(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    _refuse(bool(dense) or step != 1, "mlp_only_layers / decoder_sparse_step",
            f"dense MLP layers mixed in (mlp_only_layers={dense}, decoder_sparse_step="
            f"{step}) are not supported: every layer of this decoder is an MoE layer")
    _refuse(int(_get(hf, "num_experts", "num_local_experts")) <= 0, "num_experts",
            "must be > 0 (a dense Qwen3 model is not a Qwen3-MoE)")
    dtype = _get(hf, "torch_dtype", "dtype", default="float32", required=False)
    dtype = _TORCH_DTYPES.get(str(dtype).removeprefix("torch."), str(dtype))
    _refuse(dtype not in DTYPES, "torch_dtype", f"must be one of {DTYPES}, got {dtype!r}")
    heads, hidden = int(_get(hf, "num_attention_heads")), int(_get(hf, "hidden_size"))
    top_k = int(_get(hf, "num_experts_per_tok"))
    aux = float(hf.get("router_aux_loss_coef", 0.0) or 0.0)
    kw = dict(
        vocab_size=int(_get(hf, "vocab_size")),
        d_model=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_get(hf, "num_key_value_heads", default=heads, required=False)),
        head_dim=int(_get(hf, "head_dim", default=hidden // heads, required=False)),
        num_experts=int(_get(hf, "num_experts", "num_local_experts")),
        top_k=top_k,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        expert_ffn_dim=int(_get(hf, "moe_intermediate_size")),
        rope_theta=_rope_theta(hf),
        norm_eps=float(_get(hf, "rms_norm_eps", default=1e-6, required=False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(_get(hf, "max_position_embeddings", default=32768, required=False)),
        param_dtype=dtype,
        router_aux_loss_weight=aux * top_k if hf.get("output_router_logits") else 0.0,
    )
    return kw


def hf_config_from_model(cfg: ModelConfig, **extra) -> dict:
    """The config.json of `cfg` for Qwen3MoeForCausalLM, in the spelling of the released
    Qwen3-MoE checkpoints (which transformers 4 and 5, vLLM and SGLang all read); `extra`
    adds or replaces keys (e.g. eos_token_id, bos_token_id, pad_token_id from the
    tokenizer)."""
    out = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk_prob,
        "moe_intermediate_size": cfg.expert_ffn_dim,
        # Only read for dense layers, of which there are none (mlp_only_layers is empty).
        "intermediate_size": cfg.expert_ffn_dim,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len,
        "torch_dtype": cfg.param_dtype,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "output_router_logits": cfg.router_aux_loss_weight > 0,
        "router_aux_loss_coef": cfg.router_aux_loss_weight / cfg.top_k,
        "use_cache": True,
    }
    out.update(extra)
    return out

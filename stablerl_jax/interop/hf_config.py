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
    router_aux_loss_coef                router_aux_loss_weight (below)

Refused, naming the field: a model_type other than qwen3_moe, attention biases,
sliding-window attention, a non-SiLU activation, RoPE scaling (yarn, linear, …), dense MLP
layers (`mlp_only_layers` non-empty or `decoder_sparse_step` ≠ 1: ours are all MoE).

Load balancing: router_aux_loss_weight = coef · K if `output_router_logits` (false in
Qwen3-30B-A3B's config.json), else 0, as HF adds `router_aux_loss_coef · aux` only then,
aux = E · Σ_{e,k} f_{k,e} P_e pooled over layers (f: fraction of tokens whose k-th choice
is e): K times our per-layer E · Σ_e load_e P_e (load normalized over the K slots) when
all layers share statistics. Ours averages the per-layer values instead of pooling.

Checked before use, each error naming the field, file and fix: JSON types (an int field a
JSON int, as transformers writes them: 2.7 and 2.0 are refused, not truncated, as by its
own config class; a bool true or false; a number finite), ranges (sizes >= 1 within
int32, `config.checks.is_int`; rms_norm_eps in (0, 1), rope_theta > 0, …), the decoder's
relations (num_key_value_heads divides num_attention_heads, even head_dim,
num_experts_per_tok <= num_experts); weights: `hf_checkpoint.check_config_against_weights`.
"""
from __future__ import annotations

from stablerl_jax.config import DTYPES, ConfigError, ModelConfig, is_finite, is_int
from stablerl_jax.config.checks import FLOAT32_MAX, FLOAT32_TINY, fits_float32

_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                 "float64": "float64"}
_REQUIRED = object()


class _Reader:
    """Typed reads of config.json `hf`: the first of `names` present and not null, else
    `default`; a ConfigError (naming `source`) if required but absent, or of bad type/range."""

    def __init__(self, hf, source: str):
        if not isinstance(hf, dict):
            raise ConfigError(f"{source}: must hold a JSON object of the model's settings, "
                              f"got {type(hf).__name__}; restore the checkpoint's config.json")
        self.hf, self.source = hf, source

    def refuse(self, cond: bool, field: str, msg: str) -> None:
        if cond:
            raise ConfigError(f"{self.source}: {field}: {msg}")

    def get(self, *names, default=_REQUIRED):
        for n in names:
            if self.hf.get(n) is not None:
                return n, self.hf[n]
        self.refuse(default is _REQUIRED, " / ".join(names),
                    "missing; is this a Qwen3-MoE checkpoint?")
        return names[0], default

    def integer(self, *names, default=_REQUIRED, lo: int = 1) -> int:
        n, v = self.get(*names, default=default)
        self.refuse(not (is_int(v) and v >= lo), n,
                    f"must be an int >= {lo} and <= 2147483647 (a JSON integer, as "
                    f"transformers writes it: 2.0 and 2.7 are refused, not rounded), got "
                    f"{v!r}; correct it in config.json")
        return v

    def number(self, *names, default=_REQUIRED, ok=lambda v: v > 0, what="> 0") -> float:
        n, v = self.get(*names, default=default)
        self.refuse(not (is_finite(v) and ok(v)), n,
                    f"must be a finite number {what}, got {v!r}; correct it in config.json")
        self.refuse(not fits_float32(v), n,
                    f"is {v!r}, which float32 (the dtype the model computes it in) cannot "
                    f"hold (finite, nonzero values from {FLOAT32_TINY:.4g} to "
                    f"{FLOAT32_MAX:.4g}); correct it in config.json")
        return float(v)

    def flag(self, name: str) -> bool:
        n, v = self.get(name, default=False)
        self.refuse(not isinstance(v, bool), n,
                    f"must be true or false, got {v!r}; correct it in config.json")
        return v

    def text(self, *names, default=_REQUIRED) -> str:
        n, v = self.get(*names, default=default)
        self.refuse(not isinstance(v, str), n, f"must be a string, got {v!r}; correct it "
                    "in config.json")
        return v

    def mapping(self, name: str) -> dict:
        n, v = self.get(name, default={})
        self.refuse(not isinstance(v, dict), n, f"must be a JSON object or null, got "
                    f"{v!r}; correct it in config.json")
        return v


def _rope_theta(r: _Reader) -> float:
    params, scaling = r.mapping("rope_parameters"), r.mapping("rope_scaling")
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    r.refuse(kind != "default", "rope_scaling / rope_parameters.rope_type",
             f"{kind!r} RoPE is not implemented (only the default rotary embedding); "
             "use a checkpoint without RoPE scaling")
    if "rope_theta" in params:
        return _Reader(params, f"{r.source}: rope_parameters").number("rope_theta")
    return r.number("rope_theta", default=10_000.0)


def model_config_from_hf(hf: dict, *, source: str = "config.json", **overrides) -> ModelConfig:
    """The ModelConfig of a Qwen3-MoE config.json dict (errors name `source`); `overrides`
    then replace any field (e.g. max_seq_len=4096, compute_dtype='bfloat16',
    param_dtype='float32' to upcast on load, dispatch='dense')."""
    return ModelConfig(**{**checkpoint_fields(hf, source=source), **overrides})


def checkpoint_fields(hf: dict, *, source: str = "config.json") -> dict:
    """{ModelConfig field: value} of every field a Qwen3-MoE config.json defines (module
    docstring), checked (errors name `source`); the rest is how to compute, not the model."""
    r = _Reader(hf, source)
    model_type = r.text("model_type", default="qwen3_moe")
    r.refuse(model_type != "qwen3_moe", "model_type", f"must be 'qwen3_moe', got {model_type!r}")
    r.refuse(r.flag("attention_bias"), "attention_bias",
             "attention biases are not implemented; our q/k/v/o projections have none")
    r.refuse(r.flag("use_sliding_window"), "use_sliding_window",
             "sliding-window attention is not implemented; set it to false if unused")
    act = r.text("hidden_act", default="silu")
    r.refuse(act != "silu", "hidden_act", f"our experts are SwiGLU (SiLU), got {act!r}")
    _, dense = r.get("mlp_only_layers", default=[])
    r.refuse(not isinstance(dense, list), "mlp_only_layers",
             f"must be a list of layer indices, got {dense!r}; correct it in config.json")
    step = r.integer("decoder_sparse_step", default=1)
    r.refuse(bool(dense) or step != 1, "mlp_only_layers / decoder_sparse_step",
             f"dense MLP layers mixed in (mlp_only_layers={dense}, decoder_sparse_step="
             f"{step}) are not supported: every layer of this decoder is an MoE layer")
    dtype = r.text("torch_dtype", "dtype", default="float32")
    dtype = _TORCH_DTYPES.get(dtype.removeprefix("torch."), dtype)
    r.refuse(dtype not in DTYPES, "torch_dtype", f"must be one of {DTYPES}, got {dtype!r}")
    heads, hidden = r.integer("num_attention_heads"), r.integer("hidden_size")
    kv_heads = r.integer("num_key_value_heads", default=heads)
    r.refuse(heads % kv_heads != 0, "num_key_value_heads",
             f"must divide num_attention_heads={heads}, got {kv_heads}; correct it in "
             "config.json")
    # Without head_dim, transformers takes hidden_size // num_attention_heads.
    r.refuse(hf.get("head_dim") is None and hidden < heads, "num_attention_heads",
             f"{heads} is more than hidden_size={hidden}, which leaves no width per head "
             "(config.json has no head_dim); set head_dim")
    head_dim = r.integer("head_dim", default=hidden // heads)
    r.refuse(head_dim % 2 != 0, "head_dim", f"must be even for RoPE, got {head_dim} "
             "(hidden_size // num_attention_heads when config.json has none); correct it "
             "in config.json")
    experts = r.integer("num_experts", "num_local_experts")
    top_k = r.integer("num_experts_per_tok")
    r.refuse(top_k > experts, "num_experts_per_tok",
             f"must be <= num_experts={experts}, got {top_k}; correct it in config.json")
    aux = r.number("router_aux_loss_coef", default=0.0, ok=lambda v: v >= 0, what=">= 0")
    return dict(
        vocab_size=r.integer("vocab_size"),
        d_model=hidden,
        num_layers=r.integer("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        top_k=top_k,
        norm_topk_prob=r.flag("norm_topk_prob"),
        expert_ffn_dim=r.integer("moe_intermediate_size"),
        rope_theta=_rope_theta(r),
        norm_eps=r.number("rms_norm_eps", default=1e-6, ok=lambda v: 0 < v < 1,
                          what="in (0, 1)"),
        tie_embeddings=r.flag("tie_word_embeddings"),
        max_seq_len=r.integer("max_position_embeddings", default=32768),
        param_dtype=dtype,
        router_aux_loss_weight=aux * top_k if r.flag("output_router_logits") else 0.0,
    )


def hf_config_from_model(cfg: ModelConfig, **extra) -> dict:
    """`cfg`'s config.json as released checkpoints spell it (transformers 4 and 5, vLLM and
    SGLang read it); `extra` adds or replaces keys (e.g. the tokenizer's eos_token_id)."""
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

"""Frozen configuration dataclasses, validated on construction.

Every check raises `ConfigError` naming the field, the bad value and what to change.
Nothing is silently fixed: a config either describes exactly what runs or is refused.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def check(cond: bool, field: str, msg: str) -> None:
    """Raise `ConfigError(f"{field}: {msg}")` unless `cond`."""
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def check_positive_int(obj, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        check(isinstance(v, int) and not isinstance(v, bool) and v > 0, f,
              f"must be a positive int, got {v!r}")


def dtype_of(name: str):
    """The jnp dtype for a config dtype name ('float32', 'bfloat16', 'float16')."""
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Qwen3-MoE style decoder. Letters: V vocab, D model, H heads, E experts, K top-k.

    Attributes:
      vocab_size: V.
      d_model: D, the residual stream width.
      num_layers: L, decoder blocks (run as one scan over stacked weights).
      num_heads: query heads H.
      num_kv_heads: key/value heads (GQA); must divide num_heads.
      head_dim: per-head width (Qwen3 decouples it from d_model / num_heads).
      num_experts: E routed experts per layer.
      top_k: K experts per token.
      expert_ffn_dim: F, hidden width of each SwiGLU expert.
      rope_theta: RoPE base.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: unembedding is the transposed input embedding.
      max_seq_len: longest sequence (prompt + response) the model is used with.
      param_dtype: storage dtype of parameters ('float32' | 'bfloat16').
      compute_dtype: activation / matmul dtype of the training path.
      init_std: std of the normal initializer for matrices.
      remat: rematerialize each layer in the backward pass (saves activation memory).
      dispatch: expert dispatch path: 'grouped' (sorted, dropless, fast) or 'dense'
        (every expert on every token, the reference).
      moe_tile: rows per tile of the grouped path (groups are padded to a multiple).
      router_z_loss_weight: weight of the router z-loss in aux['router_loss'].
      router_aux_loss_weight: weight of the load-balancing loss in aux['router_loss'].
    """

    vocab_size: int = 512
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    top_k: int = 2
    expert_ffn_dim: int = 64
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_seq_len: int = 256
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    init_std: float = 0.02
    remat: bool = False
    dispatch: str = "grouped"
    moe_tile: int = 64
    router_z_loss_weight: float = 0.0
    router_aux_loss_weight: float = 0.0

    def __post_init__(self):
        check_positive_int(self, "vocab_size", "d_model", "num_layers", "num_heads",
                           "num_kv_heads", "head_dim", "num_experts", "top_k",
                           "expert_ffn_dim", "max_seq_len", "moe_tile")
        check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
              f"must divide num_heads={self.num_heads}, got {self.num_kv_heads}")
        check(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        check(self.top_k <= self.num_experts, "top_k",
              f"must be <= num_experts={self.num_experts}, got {self.top_k}")
        check(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        check(0 < self.norm_eps < 1, "norm_eps", f"must be in (0, 1), got {self.norm_eps}")
        check(self.init_std > 0, "init_std", f"must be > 0, got {self.init_std}")
        for f in ("param_dtype", "compute_dtype"):
            check(getattr(self, f) in _DTYPES, f,
                  f"must be one of {sorted(_DTYPES)}, got {getattr(self, f)!r}")
        check(self.dispatch in ("grouped", "dense"), "dispatch",
              f"must be 'grouped' or 'dense', got {self.dispatch!r}")
        for f in ("router_z_loss_weight", "router_aux_loss_weight"):
            check(getattr(self, f) >= 0, f, f"must be >= 0, got {getattr(self, f)}")

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

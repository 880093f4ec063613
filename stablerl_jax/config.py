"""Frozen configuration dataclasses, validated on construction.

Every check raises `ConfigError` naming the field, the bad value and what to change.
Nothing is silently fixed: a config either describes exactly what runs or is refused.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# float64 is for numerical reference runs under `jax.enable_x64` (the tests compare
# algorithms in it); training runs use float32 or bfloat16.
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
           "float64": jnp.float64}


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
    """The jnp dtype for a config dtype name ('float32', 'bfloat16', 'float16', 'float64')."""
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


LOSS_NAMES = ("minirl", "grpo", "cispo", "gspo", "gspo_token", "dapo")
IS_CORRECTIONS = ("none", "tis", "mis", "icepop", "seq_product", "seq_geomean")
AGGREGATIONS = ("response_sum", "seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
ADVANTAGE_NAMES = ("group_mean", "group_norm", "leave_one_out")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Surrogate loss settings. Defaults are MiniRL exactly (PAPER.md §4, Eq. 7).

    Attributes:
      name: one of LOSS_NAMES (keys of `losses.LOSSES`).
      eps_low / eps_high: clip range on the staleness ratio r = π_θ/π_old.
      clip: apply the clipping mask (MiniRL) / clipped objective; False = "no clipping".
      use_is: apply the training–inference IS weight; False = "w/o train-infer IS".
      is_correction: how the IS weight is formed: 'none' (weight 1), 'tis' truncates at
        tis_cap, 'mis' drops tokens with ratio > is_high, 'icepop' drops outside [is_low, is_high],
        'seq_product' / 'seq_geomean' use one sequence-level weight (truncated at tis_cap).
      tis_cap: C, the truncation of the token IS weight.
      cap_target: 'full' caps π_θ/μ_old (MiniRL decision); 'engine' caps only π_old/μ_old
        and multiplies by the uncapped staleness ratio.
      aggregation: None = the loss's own (MiniRL: response_sum; GRPO, GSPO:
        seq_mean_token_mean; CISPO, DAPO: token_mean); or one of AGGREGATIONS.
        MiniRL "+ length normalization" is aggregation='seq_mean_token_mean'.
      advantage: baseline (see `advantages.ADVANTAGES`); MiniRL uses group_mean.
      max_log_ratio: log-ratios are clipped to ±this before exp (no overflow).
      gspo_eps_low / gspo_eps_high: GSPO's (tiny) clip range on the sequence ratio.
      norm_length: the constant T_norm of aggregation 'seq_mean_token_sum_norm' (Dr. GRPO
        divides by the generation budget); 0 = the padded width T of the batch.
    """

    name: str = "minirl"
    eps_low: float = 0.2
    eps_high: float = 0.27
    clip: bool = True
    use_is: bool = True
    is_correction: str = "tis"
    tis_cap: float = 5.0
    is_low: float = 0.5
    is_high: float = 2.0
    cap_target: str = "full"
    aggregation: str | None = None
    advantage: str = "group_mean"
    max_log_ratio: float = 20.0
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    norm_length: int = 0

    def __post_init__(self):
        check(self.name in LOSS_NAMES, "name", f"must be one of {LOSS_NAMES}, got {self.name!r}")
        check(self.is_correction in IS_CORRECTIONS, "is_correction",
              f"must be one of {IS_CORRECTIONS}, got {self.is_correction!r}")
        check(self.aggregation is None or self.aggregation in AGGREGATIONS, "aggregation",
              f"must be None or one of {AGGREGATIONS}, got {self.aggregation!r}")
        check(self.advantage in ADVANTAGE_NAMES, "advantage",
              f"must be one of {ADVANTAGE_NAMES}, got {self.advantage!r}")
        check(self.cap_target in ("full", "engine"), "cap_target",
              f"must be 'full' or 'engine', got {self.cap_target!r}")
        for f in ("eps_low", "gspo_eps_low"):
            check(0 <= getattr(self, f) < 1, f, f"must be in [0, 1), got {getattr(self, f)}")
        for f in ("eps_high", "gspo_eps_high"):
            check(getattr(self, f) >= 0, f, f"must be >= 0, got {getattr(self, f)}")
        check(self.tis_cap >= 1, "tis_cap", f"must be >= 1, got {self.tis_cap}")
        check(0 <= self.is_low < 1 < self.is_high, "is_low",
              f"need 0 <= is_low < 1 < is_high, got is_low={self.is_low}, is_high={self.is_high}")
        # exp(±max) and the squared weights of the metrics must stay finite in float32.
        check(0 < self.max_log_ratio <= 40, "max_log_ratio",
              f"must be in (0, 40] so exp(2·max_log_ratio) fits float32, got {self.max_log_ratio}")
        check(isinstance(self.norm_length, int) and not isinstance(self.norm_length, bool)
              and self.norm_length >= 0, "norm_length",
              f"must be an int >= 0 (0 = padded T), got {self.norm_length!r}")
        for f in ("clip", "use_is"):
            check(isinstance(getattr(self, f), bool), f,
                  f"must be True or False, got {getattr(self, f)!r}")

    def replace(self, **kw) -> LossConfig:
        return dataclasses.replace(self, **kw)

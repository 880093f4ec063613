"""Every setting of an experiment: frozen dataclasses, validated on construction.

    ExperimentConfig
      model     ModelConfig     the Qwen3-MoE decoder (vocab_size is stated here only)
      task      TaskConfig      data and token budgets
      sampling  SamplingConfig  the inference engine: decoding and its numerics
      loss      LossConfig      the surrogate loss (MiniRL by default)
      rl        RLConfig        the global-step loop, its cadence and `rl.optim`
      sft       SFTConfig       the cold start and `sft.optim`
      mesh                      (data, fsdp, expert) device mesh of every jitted step

Every check raises `ConfigError` naming the field, the bad value and what to change.
Nothing is silently fixed: a config either describes exactly what runs or is refused.
`apply_overrides` applies `section.field=value` strings (nested: `rl.optim.learning_rate`)
all at once, then validates once, so overrides that only make sense together (e.g.
`task.kind=jsonl task.jsonl_dir=…`) are accepted in any order.

This module is a leaf: it imports nothing from the model, data or training code. Special
token ids are the tokenizer's (`data.tokenizer`), dtype objects the model's
(`model.numerics.dtype_of`).
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing

DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64: reference runs under x64
INFERENCE_NUMERICS = ("exact", "bf16", "fp8")  # presets of model.numerics for the sampler
LOSS_NAMES = ("minirl", "grpo", "cispo", "gspo", "gspo_token", "dapo")
IS_CORRECTIONS = ("none", "tis", "mis", "icepop", "seq_product", "seq_geomean")
AGGREGATIONS = ("response_sum", "seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
ADVANTAGE_NAMES = ("group_mean", "group_norm", "leave_one_out")
REPLAY_MODES = ("none", "r2", "r3")
OVERLONG_MODES = ("keep", "mask", "penalty")  # what a truncated response trains on
LOGPROB_IMPLS = ("naive", "chunked", "pallas_gpu", "pallas_tpu")
REMAT_POLICIES = ("none", "full", "dots")  # what a layer saves for the backward pass
GMM_IMPLS = ("loop", "tiles", "ragged_dot", "pallas_gpu", "pallas_tpu", "megablox")
ATTENTION_IMPLS = ("naive", "chunked")
SAMPLER_LAYOUTS = ("train", "serve")  # SamplingConfig.layout
KV_CACHE_LAYOUTS = ("bskd", "bksd")  # a layer's cache: [B, S, KV, Dh] or [B, KV, S, Dh]
TASK_KINDS = ("arithmetic", "jsonl", "gsm8k")  # 'gsm8k': the former name of 'jsonl'
DATA_FORMATS = ("auto", "gsm8k", "math", "dapo", "aime", "prompt_answer", "custom")
EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_-]+")
STYLES = ("steps", "rewrite", "terse")
OPERATORS = ("+-", "+")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def check(cond: bool, field: str, msg: str) -> None:
    """Raise `ConfigError(f"{field}: {msg}")` unless `cond`."""
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_positive_int(obj, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        check(_is_int(v) and v > 0, f, f"must be a positive int, got {v!r}")


def check_choice(obj, field: str, choices) -> None:
    v = getattr(obj, field)
    check(v in choices, field, f"must be one of {tuple(choices)}, got {v!r}")


def check_bool(obj, *fields: str) -> None:
    for f in fields:
        check(isinstance(getattr(obj, f), bool), f,
              f"must be true or false, got {getattr(obj, f)!r}")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Replace:
    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Replace):
    """A Qwen3-MoE style decoder. Letters: V vocab, D model, H heads, E experts, K top-k.

    Attributes:
      vocab_size: V, the embedding rows; the tokenizer is trained with at most V pieces.
      d_model: D, the residual stream width.
      num_layers: L, decoder blocks (run as one scan over stacked weights).
      num_heads: query heads H.
      num_kv_heads: key/value heads (GQA); must divide num_heads.
      head_dim: per-head width (Qwen3 decouples it from d_model / num_heads).
      num_experts: E routed experts per layer.
      top_k: K experts per token.
      norm_topk_prob: renormalize the K routing weights to sum to 1 (Qwen3-30B-A3B does);
        False combines with the raw softmax probabilities (HF Qwen3MoeConfig's default).
      expert_ffn_dim: F, hidden width of each SwiGLU expert.
      rope_theta: RoPE base.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: unembedding is the transposed input embedding.
      max_seq_len: longest sequence (prompt + response) the model is used with.
      param_dtype: storage dtype of parameters (one of DTYPES).
      compute_dtype: activation / matmul dtype of the training path.
      init_std: std of the normal initializer for matrices.
      remat: what each layer of the scan keeps for the backward pass (REMAT_POLICIES):
        'none' (every activation), 'full' (only the layer's input; the layer is recomputed
        in the backward pass), 'dots' (matmul outputs without batch dimensions are kept,
        the rest is recomputed: jax.checkpoint_policies.dots_with_no_batch_dims_saveable).
      dispatch: expert dispatch path: 'grouped' (sorted, dropless, fast) or 'dense'
        (every expert on every token, the reference).
      moe_tile: rows per tile of the grouped path (groups are padded to a multiple).
      gmm_impl: the grouped matmul of the grouped path (GMM_IMPLS): 'loop' (pure JAX, the
        reference and the CPU default), 'tiles' (pure JAX, every tile in one batched
        matmul against its gathered expert weight: fewer, larger ops, for small models on
        CPU, at the memory of one weight copy per tile), 'ragged_dot' (jax.lax.ragged_dot), 'pallas_gpu' /
        'pallas_tpu' (this project's Pallas kernel compiled by Triton / Mosaic),
        'megablox' (jax's TPU megablox gmm). The preset chooses; layers never look at
        the platform.
      expert_parallel: with a multi-device mesh, run the expert FFN under shard_map with
        each device holding only its `expert` shard of the experts: tokens are gathered
        over the `expert` mesh axis, each device runs its own experts and the partial
        outputs are reduce-scattered back (model/expert_parallel.py). False: every device
        gathers all experts' weights layer by layer and keeps its own tokens.
      unroll_layers: unroll the scan over layers (no per-layer slicing of stacked weights
        and residuals: faster for a few small layers, compile time grows with depth).
      attention_impl: 'naive' (one [T, S] score matrix per head) or 'chunked' (a scan over
        query chunks of `attention_chunk` rows, each rematerialized: memory O(chunk · S)
        instead of O(T · S), the same function).
      attention_chunk: query rows per chunk of the 'chunked' attention.
      kv_cache_layout: the sampler's KV cache, per layer (KV_CACHE_LAYOUTS): 'bskd'
        ([B, S, KV, Dh]) or 'bksd' ([B, KV, S, Dh]: each (row, kv head) a contiguous
        [S, Dh] block, so a decode step's products read the cache without transposing it:
        faster on CPU; on TPU the `paper` sampler's temp memory is lower with 'bskd').
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
    norm_topk_prob: bool = True
    expert_ffn_dim: int = 64
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_seq_len: int = 256
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    init_std: float = 0.02
    remat: str = "none"
    dispatch: str = "grouped"
    moe_tile: int = 64
    gmm_impl: str = "loop"
    expert_parallel: bool = False
    unroll_layers: bool = False
    attention_impl: str = "naive"
    attention_chunk: int = 512
    kv_cache_layout: str = "bskd"
    router_z_loss_weight: float = 0.0
    router_aux_loss_weight: float = 0.0

    def __post_init__(self):
        check_positive_int(self, "vocab_size", "d_model", "num_layers", "num_heads",
                           "num_kv_heads", "head_dim", "num_experts", "top_k",
                           "expert_ffn_dim", "max_seq_len", "moe_tile", "attention_chunk")
        check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
              f"must divide num_heads={self.num_heads}, got {self.num_kv_heads}")
        check(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        check(self.top_k <= self.num_experts, "top_k",
              f"must be <= num_experts={self.num_experts}, got {self.top_k}")
        check(_finite(self.rope_theta) and self.rope_theta > 0, "rope_theta",
              f"must be > 0, got {self.rope_theta}")
        check(_finite(self.norm_eps) and 0 < self.norm_eps < 1, "norm_eps",
              f"must be in (0, 1), got {self.norm_eps}")
        check(_finite(self.init_std) and self.init_std > 0, "init_std",
              f"must be > 0, got {self.init_std}")
        for f in ("param_dtype", "compute_dtype"):
            check_choice(self, f, DTYPES)
        check(self.dispatch in ("grouped", "dense"), "dispatch",
              f"must be 'grouped' or 'dense', got {self.dispatch!r}")
        for f in ("router_z_loss_weight", "router_aux_loss_weight"):
            v = getattr(self, f)
            check(_finite(v) and v >= 0, f, f"must be >= 0, got {v}")
        check(self.remat in REMAT_POLICIES, "remat",
              f"must be one of {REMAT_POLICIES} ('full' was remat=true), got {self.remat!r}")
        check_choice(self, "gmm_impl", GMM_IMPLS)
        check_choice(self, "attention_impl", ATTENTION_IMPLS)
        check_choice(self, "kv_cache_layout", KV_CACHE_LAYOUTS)
        check(not self.expert_parallel or self.dispatch == "grouped", "expert_parallel",
              "needs dispatch='grouped' (the dense path runs every expert on every token)")
        check_bool(self, "tie_embeddings", "expert_parallel", "norm_topk_prob", "unroll_layers")


@dataclasses.dataclass(frozen=True)
class TaskConfig(_Replace):
    """The RL task: data and prompt/solution token budgets.

    kind: 'arithmetic' (data/synthetic.py) or 'jsonl' (local JSONL math data,
      data/jsonl.py; 'gsm8k' is the same, its former name).
    num_operands / max_digits / operators / modulus: arithmetic difficulty.
    min_steps / max_steps: long problems when max_steps > 0 (data/synthetic.py): a start
      value and num_operands − 1 operations applied in turn for a number of steps drawn
      from [min_steps, max_steps]; 0 (the default) = one pass over the prompt's chain.
    style: worked-solution style used for SFT: 'steps', 'rewrite' or 'terse'.
    num_train / num_test: records per split (arithmetic only; JSONL files set their own).
    test_fraction: share of the problem space hashed into the test split.
    seed: the generator's seed.
    max_prompt_len / max_solution_len: token budgets. A prompt whose rendered (templated)
      token count exceeds max_prompt_len is dropped when the data loads, and counted.
    jsonl_dir: kind='jsonl': a directory holding train.jsonl and/or test.jsonl, or one
      .jsonl file (an eval-only test split).
    format: how a JSONL record maps to (question, answer): 'auto' (the one named format
      whose fields the file has), 'gsm8k', 'math', 'dapo', 'aime', 'prompt_answer', or
      'custom' with prompt_field / answer_field (/ solution_field). data/formats.py.
    tokenizer_dir: a directory holding a checkpoint's tokenizer.json (and
      tokenizer_config.json): use that tokenizer and its special ids; '' trains the
      SentencePiece tokenizer on the task (the default).
    skip_malformed: kind='jsonl' only: skip (and count) malformed JSONL lines instead of
      failing on the first one.
    chat_template: render prompts with the tokenizer_dir's jinja chat template
      (data/chat_template.py); needs tokenizer_dir when the data loads (a preset may
      leave it to `experiments.quickstart --hf`, which sets it to the checkpoint).
    system_prompt: a system message ('' = none; needs chat_template).
    prompt_template: the user message, "{question}" replaced by the question.
    enable_thinking / add_generation_prompt: passed to the chat template.
    """

    kind: str = "arithmetic"
    num_operands: int = 4
    max_digits: int = 1
    operators: str = "+-"
    modulus: int = 0
    min_steps: int = 0
    max_steps: int = 0
    style: str = "steps"
    num_train: int = 4000
    num_test: int = 400
    test_fraction: float = 0.1
    seed: int = 0
    max_prompt_len: int = 16
    max_solution_len: int = 40
    jsonl_dir: str = ""
    tokenizer_dir: str = ""
    skip_malformed: bool = False
    format: str = "auto"
    prompt_field: str = ""
    answer_field: str = ""
    solution_field: str = ""
    chat_template: bool = False
    system_prompt: str = ""
    prompt_template: str = "{question}"
    enable_thinking: bool = True
    add_generation_prompt: bool = True

    def __post_init__(self):
        check_choice(self, "kind", TASK_KINDS)
        check_positive_int(self, "num_operands", "max_digits", "num_train", "num_test",
                           "max_prompt_len", "max_solution_len")
        check(self.num_operands >= 2, "num_operands", f"must be >= 2, got {self.num_operands}")
        check(self.max_digits <= 6, "max_digits", f"must be <= 6, got {self.max_digits}")
        check_choice(self, "operators", OPERATORS)
        check(_is_int(self.modulus) and (self.modulus == 0 or self.modulus >= 2),
              "modulus", f"must be 0 (no modulus) or an int >= 2, got {self.modulus!r}")
        check_choice(self, "style", STYLES)
        check(_is_int(self.max_steps) and self.max_steps >= 0, "max_steps",
              f"must be an int >= 0 (0 = no long problems), got {self.max_steps!r}")
        check(_is_int(self.min_steps) and (self.min_steps == 0 if not self.max_steps else
                                           1 <= self.min_steps <= self.max_steps),
              "min_steps", f"must be in [1, max_steps={self.max_steps}] for long problems, "
              f"or 0 with max_steps=0; got {self.min_steps!r}")
        check(not self.max_steps or self.style != "rewrite", "style",
              "'rewrite' has no long-problem form; use 'steps' or 'terse' with max_steps > 0")
        check(_finite(self.test_fraction) and 0 < self.test_fraction < 1, "test_fraction",
              f"must be in (0, 1), got {self.test_fraction}")
        check(_is_int(self.seed) and self.seed >= 0, "seed",
              f"must be an int >= 0, got {self.seed!r}")
        check(self.kind == "arithmetic" or bool(self.jsonl_dir), "jsonl_dir",
              f"must name the directory holding train.jsonl / test.jsonl (or one .jsonl "
              f"file) when kind={self.kind!r}")
        check_bool(self, "skip_malformed", "chat_template", "enable_thinking",
                   "add_generation_prompt")
        check_choice(self, "format", DATA_FORMATS)
        custom = ("prompt_field", "answer_field", "solution_field")
        for name in custom + ("system_prompt", "prompt_template"):
            check(isinstance(getattr(self, name), str), name,
                  f"must be a string, got {getattr(self, name)!r}")
        if self.format == "custom":
            check(bool(self.prompt_field) and bool(self.answer_field), "format",
                  "'custom' needs task.prompt_field and task.answer_field (the JSONL keys "
                  "of the question and the answer)")
        else:
            for name in custom:
                check(not getattr(self, name), name,
                      f"is only read with task.format=custom, got format={self.format!r}; "
                      "set task.format=custom or drop it")
        check("{question}" in self.prompt_template, "prompt_template",
              f"must contain '{{question}}' (where the question goes), got "
              f"{self.prompt_template!r}")
        check(not self.system_prompt or self.chat_template, "system_prompt",
              "is a chat message, so it needs task.chat_template=true; set it or drop the "
              "system prompt")


@dataclasses.dataclass(frozen=True)
class SamplingConfig(_Replace):
    """The sampling engine (inference engine μ): how it decodes and how it computes.

    Attributes:
      max_new_tokens: N, completion slots per row.
      temperature: logits are divided by it (> 0).
      top_k: keep the k most likely tokens (0 = off).
      top_p: keep the smallest set of most likely tokens whose mass reaches top_p
        (1.0 = off).
      numerics: the engine's numerics preset (INFERENCE_NUMERICS, model/numerics.py).
      router_noise_std / act_fp8: extra mismatch knobs on top of it (seeded router-logit
        noise; per-token e4m3 activations).
      max_batch: rows decoded at once over the whole mesh; a larger batch is decoded as a
        sequence of slices of this many rows (its KV cache is the memory that bounds a
        pod's sampling batch). 0: every row at once. A row's sample does not depend on
        the slicing (each row draws from its own key).
      dispatch: the engine's own expert dispatch ('grouped' or 'dense', the same function
        up to float reassociation, as an inference server's MoE kernels differ from the
        trainer's); '' = the model's (model.dispatch). 'dense' decodes a small model on
        CPU faster (a decode step routes few tokens).
      layout: where the decode loop's weights live (SAMPLER_LAYOUTS). 'train': the
        trainer's shardings (FSDP-sharded weights, all-gathered again in every layer of
        every decode step). 'serve': resharded once per sample call into the serving
        layout of sharding.SERVE_RULES (attention, router and embeddings replicated,
        experts spread over every chip; the FP8 engine keeps its weights as e4m3 values
        with per-channel scales), so a decode step moves only activations. The prefill
        runs in the training layout either way (one pass per slice, compute bound). Same
        tokens, log μ and routes as 'train' up to float reassociation.
    EOS and padding ids are the tokenizer's.
    """

    max_new_tokens: int = 48
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    numerics: str = "fp8"
    router_noise_std: float = 0.0
    act_fp8: bool = False
    max_batch: int = 0
    dispatch: str = ""
    layout: str = "train"

    def __post_init__(self):
        check_positive_int(self, "max_new_tokens")
        check_choice(self, "layout", SAMPLER_LAYOUTS)
        check(_is_int(self.max_batch) and self.max_batch >= 0, "max_batch",
              f"must be an int >= 0 (0 = every row at once), got {self.max_batch!r}")
        check(_finite(self.temperature) and self.temperature > 0, "temperature",
              f"must be > 0, got {self.temperature}")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k",
              f"must be an int >= 0 (0 = off), got {self.top_k!r}")
        check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p",
              f"must be in (0, 1] (1 = off), got {self.top_p}")
        check(self.numerics in INFERENCE_NUMERICS, "numerics",
              f"must be an inference preset {INFERENCE_NUMERICS} ('train' is the trainer's), "
              f"got {self.numerics!r}")
        check(_finite(self.router_noise_std) and self.router_noise_std >= 0,
              "router_noise_std", f"must be a finite number >= 0, got {self.router_noise_std}")
        check_bool(self, "act_fp8")
        check(self.dispatch in ("", "grouped", "dense"), "dispatch",
              f"must be '', 'grouped' or 'dense', got {self.dispatch!r}")


@dataclasses.dataclass(frozen=True)
class LossConfig(_Replace):
    """Surrogate loss settings. Defaults are MiniRL exactly (docs/method.md §4, Eq. 7).

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
      advantage_std_ddof: the std of advantage='group_norm' divides by G − ddof. 0 (the
        default, the population std: the paper's "std of the group") keeps this
        project's stored results; verl and tunix use the sample std, ddof=1, whose
        advantages are √((G−1)/G) as large (×0.935 at G = 8).
      clip_ratio_c: verl's dual-clip for the PPO-clip losses (grpo, dapo): on tokens with
        Â < 0 the clipped term is bounded below by c·Â, so a token whose ratio r exceeds
        c contributes the constant c·Â and no gradient. 0 = off; verl's default when on
        is 3.0; must be > 1 + eps_high.
      max_log_ratio: log-ratios are clipped to ±this before exp (no overflow).
      gspo_eps_low / gspo_eps_high: GSPO's (tiny) clip range on the sequence ratio.
      gspo_max_log_ratio: GSPO's sequence log-ratio is clamped at this (tunix, verl: 10).
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
    advantage_std_ddof: int = 0
    clip_ratio_c: float = 0.0
    max_log_ratio: float = 20.0
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    gspo_max_log_ratio: float = 10.0
    norm_length: int = 0

    def __post_init__(self):
        check_choice(self, "name", LOSS_NAMES)
        check_choice(self, "is_correction", IS_CORRECTIONS)
        check(self.aggregation is None or self.aggregation in AGGREGATIONS, "aggregation",
              f"must be None or one of {AGGREGATIONS}, got {self.aggregation!r}")
        check_choice(self, "advantage", ADVANTAGE_NAMES)
        check(self.cap_target in ("full", "engine"), "cap_target",
              f"must be 'full' or 'engine', got {self.cap_target!r}")
        for f in ("eps_low", "gspo_eps_low"):
            v = getattr(self, f)
            check(_finite(v) and 0 <= v < 1, f, f"must be in [0, 1), got {v}")
        for f in ("eps_high", "gspo_eps_high"):
            v = getattr(self, f)
            check(_finite(v) and v >= 0, f, f"must be a finite number >= 0, got {v}")
        check(_finite(self.tis_cap) and self.tis_cap >= 1, "tis_cap",
              f"must be a finite number >= 1, got {self.tis_cap}")
        check(_finite(self.is_low) and _finite(self.is_high)
              and 0 <= self.is_low < 1 < self.is_high, "is_low",
              f"need 0 <= is_low < 1 < is_high, got is_low={self.is_low}, is_high={self.is_high}")
        # exp(±max) and the squared weights of the metrics must stay finite in float32.
        check(_finite(self.max_log_ratio) and 0 < self.max_log_ratio <= 40, "max_log_ratio",
              f"must be in (0, 40] so exp(2·max_log_ratio) fits float32, got {self.max_log_ratio}")
        check(_finite(self.gspo_max_log_ratio) and 0 < self.gspo_max_log_ratio <= 40,
              "gspo_max_log_ratio", f"must be in (0, 40], got {self.gspo_max_log_ratio}")
        check(_is_int(self.advantage_std_ddof) and self.advantage_std_ddof in (0, 1),
              "advantage_std_ddof",
              f"must be 0 (population std) or 1 (sample std, verl / tunix), got "
              f"{self.advantage_std_ddof!r}")
        check(_finite(self.clip_ratio_c)
              and (self.clip_ratio_c == 0 or self.clip_ratio_c > 1 + self.eps_high),
              "clip_ratio_c", f"must be 0 (off) or > 1 + eps_high = {1 + self.eps_high} "
              f"(verl uses 3.0), got {self.clip_ratio_c}")
        check(self.clip_ratio_c == 0 or self.name in ("grpo", "dapo"), "clip_ratio_c",
              f"dual-clip applies to the PPO-clip losses 'grpo' and 'dapo', not "
              f"{self.name!r}; set loss.clip_ratio_c=0")
        check(_is_int(self.norm_length) and self.norm_length >= 0, "norm_length",
              f"must be an int >= 0 (0 = padded T), got {self.norm_length!r}")
        check_bool(self, "clip", "use_is")


@dataclasses.dataclass(frozen=True)
class OptimConfig(_Replace):
    """Global-norm gradient clipping, then AdamW, with a learning-rate schedule.

    schedule: 'constant' (after `warmup_frac` of the steps of linear warmup from 0) or
    'cosine' (warmup, then cosine decay to end_lr_frac · learning_rate).
    """

    learning_rate: float = 1e-4
    schedule: str = "constant"
    warmup_frac: float = 0.0
    end_lr_frac: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self):
        check(_finite(self.learning_rate) and self.learning_rate > 0, "learning_rate",
              f"must be a finite number > 0, got {self.learning_rate}")
        check(self.schedule in ("constant", "cosine"), "schedule",
              f"must be 'constant' or 'cosine', got {self.schedule!r}")
        for f in ("warmup_frac", "end_lr_frac"):
            v = getattr(self, f)
            check(_finite(v) and 0 <= v <= 1, f, f"must be in [0, 1], got {v}")
        for f in ("b1", "b2"):
            v = getattr(self, f)
            check(_finite(v) and 0 <= v < 1, f,
                  f"must be in [0, 1) (1 never forgets the first gradient), got {v}")
        # AdamW divides by sqrt(v) + eps: below ~1e-30 a zero second moment overflows.
        check(_finite(self.eps) and self.eps >= 1e-30, "eps",
              f"must be a finite number >= 1e-30, got {self.eps}")
        check(_finite(self.weight_decay) and self.weight_decay >= 0, "weight_decay",
              f"must be a finite number >= 0, got {self.weight_decay}")
        check(_finite(self.grad_clip) and self.grad_clip > 0, "grad_clip",
              f"must be a finite number > 0, got {self.grad_clip}")


@dataclasses.dataclass(frozen=True)
class RLConfig(_Replace):
    """The global-step loop (docs/method.md §1): B/G prompts × G responses = B responses per
    step, N mini-batches (= optimizer steps) per step, evaluation and checkpoint cadence.

    replay: 'none' | 'r2' | 'r3' (docs/method.md §3).
    microbatches: each mini-batch's update accumulates gradients over this many slices
      of it inside one jitted step (one optimizer update; losses and metrics equal one
      big batch's, rl/accumulate.py); the score step runs its batch in slices of the
      same size. Memory of a step scales with the slice, not the mini-batch.
    replay_weights: R3 only, an extension beyond the paper: also replay the sampler's
      recorded routing (combine) weights, held fixed, instead of recomputing them from the
      live router; the router then gets no gradient through the combine.
    eval_sets: named held-out sets, "name:path,name:path" (each path a JSONL file or a
      directory holding test.jsonl, read like the task's data); '' = the task's own test
      split, as one set named 'test'.
    offline_rollouts: path of an offline rollout file (interop/rollouts.py, e.g. from
      vLLM / SGLang) to train on instead of sampling; '' samples with our engine.
    logprob_impl: the fused log-prob op: 'naive', 'chunked' (runs everywhere), or the
      Pallas kernels compiled for 'pallas_gpu' (Triton) / 'pallas_tpu' (Mosaic). On a GPU
      with bf16 compute 'pallas_gpu' is the fast one (forward + backward 0.16× naive,
      'chunked' 1.4×; docs/benchmarks.md).
    trim_bucket: before scoring, cut each step's rollout to the slots some row used (the
      longest prompt's first slot to the longest completion's end), the width rounded up
      to a multiple of this many slots, so score and updates skip the all-padding slots
      (a step's result is unchanged: positions count real tokens, masked slots add
      nothing). Each distinct width compiles its own score and update programs, once.
      0: off (every step at the full max_prompt_len + max_new_tokens).
    score_in_update: when a step has one mini-batch (on-policy), take log π_old from the
      update's own forward (stop-gradient) instead of a separate score pass at the same
      θ_old: the same step for one forward less (rl/steps.py). The rollout's monitors then
      come from that forward, and are 0 for a step whose update was skipped as
      non-finite. With num_minibatches > 1 the score pass runs as usual.
    seed: every random choice of the run derives from (seed, step).
    max_consecutive_skips: the run stops with an error after this many updates in a row
      were skipped as non-finite (a diverged run should not exit 0).
    overlong: what a truncated response (max_new_tokens reached without a stop id) trains
      on (OVERLONG_MODES): 'keep' (as a finished one, scored from its cut text), 'mask'
      (no gradient: its tokens leave the loss and every denominator of it; advantages are
      computed over the whole group first, as verl / DAPO do), 'penalty' (DAPO's soft
      overlong punishment added to every reward: 0 up to max_new_tokens −
      overlong_buffer tokens, then falling linearly to −overlong_penalty_factor at
      max_new_tokens, `overlong.length_penalty`).
    overlong_buffer: L_buf of 'penalty', in tokens (0 < L_buf <= sampling.max_new_tokens).
    overlong_penalty_factor: the penalty at max_new_tokens (> 0; DAPO: 1.0).
    log_samples: decoded prompt / response / reward rows written to samples.jsonl and
      TensorBoard text at every eval (and every log_samples_every steps); 0: none.
    log_samples_every: also log training samples every this many global steps (0: only
      at evals).
    """

    steps: int = 60
    prompts_per_step: int = 16
    group_size: int = 8
    num_minibatches: int = 1
    microbatches: int = 1
    replay: str = "none"
    replay_weights: bool = False
    offline_rollouts: str = ""
    logprob_impl: str = "chunked"
    trim_bucket: int = 0
    score_in_update: bool = False
    eval_every: int = 10
    eval_k: int = 4
    eval_problems: int = 64
    eval_sets: str = ""
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    async_checkpoints: bool = True
    seed: int = 0
    max_consecutive_skips: int = 16
    overlong: str = "keep"
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    log_samples: int = 4
    log_samples_every: int = 0
    optim: OptimConfig = OptimConfig()

    def __post_init__(self):
        check_choice(self, "overlong", OVERLONG_MODES)
        check(_is_int(self.overlong_buffer) and self.overlong_buffer >= 0
              and (self.overlong != "penalty" or self.overlong_buffer > 0), "overlong_buffer",
              f"must be an int > 0 with rl.overlong=penalty (the tokens before max_new_tokens "
              f"over which the penalty ramps), >= 0 otherwise, got {self.overlong_buffer!r}")
        check(_finite(self.overlong_penalty_factor) and self.overlong_penalty_factor > 0,
              "overlong_penalty_factor", f"must be a number > 0 (DAPO: 1.0), got "
              f"{self.overlong_penalty_factor!r}")
        for f in ("log_samples", "log_samples_every"):
            check(_is_int(getattr(self, f)) and getattr(self, f) >= 0, f,
                  f"must be an int >= 0 (0 = off), got {getattr(self, f)!r}")
        check_positive_int(self, "steps", "prompts_per_step", "group_size", "num_minibatches",
                           "microbatches", "eval_every", "eval_k", "eval_problems",
                           "checkpoint_every", "keep_checkpoints", "max_consecutive_skips")
        check_choice(self, "replay", REPLAY_MODES)
        check_choice(self, "logprob_impl", LOGPROB_IMPLS)
        check(self.group_size >= 2, "group_size",
              f"must be >= 2, got {self.group_size}: every baseline is a group baseline, and "
              "the baseline of a one-response group is that response, so every advantage "
              "would be 0 and nothing would be learned")
        responses = self.prompts_per_step * self.group_size
        check(responses % self.num_minibatches == 0, "num_minibatches",
              f"must divide prompts_per_step*group_size = {responses}")
        minibatch = responses // self.num_minibatches
        check(minibatch % self.microbatches == 0, "microbatches",
              f"must divide the mini-batch prompts_per_step*group_size/num_minibatches = "
              f"{minibatch}")
        check(_is_int(self.seed) and self.seed >= 0, "seed",
              f"must be an int >= 0, got {self.seed!r}")
        check(_is_int(self.trim_bucket) and self.trim_bucket >= 0, "trim_bucket",
              f"must be an int >= 0 (0 = off), got {self.trim_bucket!r}")
        check_bool(self, "async_checkpoints", "replay_weights", "score_in_update")
        check(not self.replay_weights or self.replay == "r3", "replay_weights",
              f"replays the sampler's recorded weights, so it needs replay='r3', got "
              f"replay={self.replay!r}; set rl.replay=r3 or rl.replay_weights=false")
        check(isinstance(self.offline_rollouts, str), "offline_rollouts",
              f"must be a path string ('' = sample), got {self.offline_rollouts!r}")
        parse_eval_sets(self.eval_sets)


def parse_eval_sets(spec) -> dict[str, str]:
    """`rl.eval_sets` "name:path,name:path" as {name: path} in order ({} for '').
    Names are unique and [A-Za-z0-9_-]+; paths are non-empty (the first ':' splits, so a
    path may hold ':')."""
    check(isinstance(spec, str), "eval_sets", f"must be a string, got {spec!r}")
    sets = {}
    for item in filter(None, (i.strip() for i in spec.split(","))):
        name, sep, path = item.partition(":")
        name, path = name.strip(), path.strip()
        check(bool(sep) and bool(path), "eval_sets",
              f"entry {item!r} must be name:path, e.g. aime24:/data/aime24.jsonl")
        check(bool(EVAL_SET_NAME.fullmatch(name)), "eval_sets",
              f"set name {name!r} must be letters, digits, '_' or '-'")
        check(name not in sets, "eval_sets", f"set name {name!r} appears twice; names "
              "must be unique")
        sets[name] = path
    return sets


@dataclasses.dataclass(frozen=True)
class SFTConfig(_Replace):
    """Cold-start supervised fine-tuning on the task's worked solutions (the run stops with
    an error after `max_consecutive_skips` non-finite updates in a row). `microbatches`:
    gradient accumulation over that many slices of each batch (as rl.microbatches)."""

    steps: int = 300
    batch_size: int = 32
    microbatches: int = 1
    seed: int = 0
    max_consecutive_skips: int = 16
    optim: OptimConfig = OptimConfig(learning_rate=3e-3, schedule="cosine", warmup_frac=0.1,
                                     weight_decay=0.01)

    def __post_init__(self):
        check_positive_int(self, "steps", "batch_size", "microbatches", "max_consecutive_skips")
        check(self.batch_size % self.microbatches == 0, "microbatches",
              f"must divide batch_size = {self.batch_size}")
        check(_is_int(self.seed) and self.seed >= 0, "seed",
              f"must be an int >= 0, got {self.seed!r}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(_Replace):
    """One run: every section above, plus the name and the device mesh."""

    name: str = "run"
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    loss: LossConfig = LossConfig()
    rl: RLConfig = RLConfig()
    sft: SFTConfig = SFTConfig()
    mesh: tuple = (1, 1, 1)

    def __post_init__(self):
        need = self.task.max_prompt_len + self.sampling.max_new_tokens
        check(need <= self.model.max_seq_len, "model.max_seq_len",
              f"must be >= task.max_prompt_len + sampling.max_new_tokens = {need}, "
              f"got {self.model.max_seq_len}")
        check(isinstance(self.mesh, tuple) and len(self.mesh) == 3
              and all(_is_int(m) and m > 0 for m in self.mesh), "mesh",
              f"must be three positive ints (data, fsdp, expert), got {self.mesh!r}")
        # Batches are split over every mesh axis (sharding.RULES["batch"]).
        dp = self.mesh[0] * self.mesh[1] * self.mesh[2]
        rl = self.rl
        minibatch = rl.prompts_per_step * rl.group_size // rl.num_minibatches
        # The eval batch is padded to the mesh and sampler multiple (rl/loop.py).
        for what, rows in [("the RL micro-batch (rl.prompts_per_step*rl.group_size/"
                            "rl.num_minibatches/rl.microbatches)", minibatch // rl.microbatches),
                           ("the SFT micro-batch (sft.batch_size/sft.microbatches)",
                            self.sft.batch_size // self.sft.microbatches)]:
            check(rows % dp == 0, "mesh",
                  f"data*fsdp*expert = {dp} must divide {what} = {rows}; change the mesh or "
                  "the batch")
        check(not self.model.expert_parallel or self.model.num_experts % self.mesh[2] == 0,
              "model.expert_parallel", f"needs the mesh's expert axis ({self.mesh[2]}) to "
              f"divide num_experts={self.model.num_experts}; change the mesh or set it false")
        # The serving layout splits the experts over every device (sharding.SERVE_RULES).
        sampler_ep = (self.model.expert_parallel
                      and (self.sampling.dispatch or self.model.dispatch) == "grouped")
        check(self.sampling.layout != "serve" or not sampler_ep
              or self.model.num_experts % dp == 0, "sampling.layout",
              f"'serve' puts num_experts={self.model.num_experts} on data*fsdp*expert = "
              f"{dp} devices, which must divide it; use layout 'train' or another mesh")
        rows = self.sampling.max_batch
        if rows:
            check(rows % dp == 0, "sampling.max_batch",
                  f"must be a multiple of data*fsdp*expert = {dp}, got {rows}")
            n = rl.prompts_per_step * rl.group_size
            check(n % rows == 0, "sampling.max_batch",
                  f"must divide rl.prompts_per_step*rl.group_size = {n}, got {rows}")
        check(rl.overlong_buffer <= self.sampling.max_new_tokens, "rl.overlong_buffer",
              f"must be <= sampling.max_new_tokens = {self.sampling.max_new_tokens} (the "
              f"penalty ramps over the last overlong_buffer tokens), got {rl.overlong_buffer}")


def _parse(value: str, current, key: str):
    """`value` (a command-line string) as the type of the field's current value."""
    low = value.strip().lower()
    if isinstance(current, (bool, int, float, tuple)) and not value.isascii():
        # int() and float() read any Unicode digit ('٣', full-width '３'): a typo's
        # lookalike would pass as a number.
        raise ConfigError(f"override {key!r}: {value!r} is not ASCII; write numbers with "
                          "the digits 0-9")
    if isinstance(current, bool):
        if low not in ("true", "false", "1", "0"):
            raise ConfigError(f"override {key!r}: expected true/false, got {value!r}")
        return low in ("true", "1")
    if isinstance(current, tuple):
        try:
            return tuple(int(v) for v in value.strip("()").split(",") if v.strip())
        except ValueError:
            raise ConfigError(f"override {key!r}: expected comma-separated ints like 2,2,2, "
                              f"got {value!r}") from None
    if current is None:  # an optional string field (LossConfig.aggregation)
        return None if low == "none" else value
    if isinstance(current, float):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"override {key!r}: cannot parse {value!r} as a number") \
                from None
    if isinstance(current, int):
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"override {key!r}: cannot parse {value!r} as an int") from None
    return value


def _field_names(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def apply_overrides(cfg: ExperimentConfig, overrides: typing.Sequence[str]) -> ExperimentConfig:
    """Apply `path=value` overrides (`name=x`, `mesh=2,2,2`, `rl.num_minibatches=4`,
    `rl.optim.learning_rate=3e-4`): every override is parsed first, then each config is
    rebuilt once with all its changes, so validation sees the final values together."""
    changes: dict = {}  # nested {field: value or {sub-field: ...}}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected section.field=value")
        path = key.strip().split(".")
        node, tree = cfg, changes
        for i, name in enumerate(path):
            names = _field_names(node)
            if name not in names:
                where = ".".join(path[:i]) or "the experiment config"
                hint = ("use section.field=value with section in "
                        f"{[n for n in names if dataclasses.is_dataclass(getattr(node, n))]}"
                        if i == 0 else f"{where} has {names}")
                raise ConfigError(f"override {key!r}: unknown field {name!r}; {hint}")
            child = getattr(node, name)
            if i == len(path) - 1:
                if dataclasses.is_dataclass(child):
                    raise ConfigError(f"override {key!r}: {key} is a section; set one of its "
                                      f"fields, e.g. {key}.{_field_names(child)[0]}=...")
                tree[name] = _parse(value, child, key)
            else:
                if not dataclasses.is_dataclass(child):
                    raise ConfigError(f"override {key!r}: {'.'.join(path[:i + 1])} is not a "
                                      "section")
                tree = tree.setdefault(name, {})
                node = child
    return _rebuild(cfg, changes)


def _rebuild(obj, changes: dict):
    """dataclasses.replace with nested changes, innermost first; a ConfigError from a
    nested config is prefixed with its section path."""
    kw = {}
    for name, change in changes.items():
        if isinstance(change, dict):
            try:
                kw[name] = _rebuild(getattr(obj, name), change)
            except ConfigError as e:
                raise ConfigError(f"{name}.{e}" if not str(e).startswith(f"{name}.") else
                                  str(e)) from None
        else:
            kw[name] = change
    try:
        return dataclasses.replace(obj, **kw)
    except TypeError as e:  # a value of the wrong type reached a comparison
        raise ConfigError(f"{type(obj).__name__}: {e}") from None


def flat_dict(cfg) -> dict:
    """{"section.field": value} of a config, JSON-ready (tuples as lists): what a
    checkpoint stores, and what `changed_fields` compares."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out.update({f"{f.name}.{k}": x for k, x in flat_dict(v).items()})
        else:
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def changed_fields(saved: dict, cfg) -> list[str]:
    """Paths whose value in `cfg` differs from a stored `flat_dict`. A field the stored
    dict lacks (added to the code after that run was saved) counts as changed only when
    `cfg` sets it away from its default: a new field's default keeps the old behaviour."""
    now, default = flat_dict(cfg), flat_dict(type(cfg)())
    return sorted(k for k in set(saved) | set(now)
                  if saved.get(k, default.get(k)) != now.get(k))

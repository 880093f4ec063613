"""`ModelConfig` (the decoder) and `SamplingConfig` (inference engine: decoding, numerics)."""
from __future__ import annotations

import dataclasses

from stablerl_jax.config.checks import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    Section,
    check,
    check_bool,
    check_choice,
    check_positive_int,
    fits_float32,
    is_finite,
    is_int,
)
from stablerl_jax.config.choices import (
    ATTENTION_IMPLS,
    DECODE_IMPLS,
    DTYPES,
    GMM_IMPLS,
    INFERENCE_NUMERICS,
    KV_CACHE_LAYOUTS,
    REMAT_POLICIES,
    SAMPLER_LAYOUTS,
)


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    """A Qwen3-MoE style decoder. Letters: V vocab, D model, H heads, E experts, K top-k.

    vocab_size: V, the embedding rows; the tokenizer is trained with at most V pieces.
    d_model / num_layers: D, the residual width / L decoder blocks (one scan, stacked weights).
    num_heads / num_kv_heads: H query heads / key-value heads (GQA; divides num_heads).
    head_dim: per-head width (Qwen3 decouples it from d_model / num_heads).
    num_experts / top_k: E routed experts per layer / K experts per token.
    norm_topk_prob: renormalize the K routing weights to sum to 1 (Qwen3-30B-A3B does); False:
      the raw softmax probabilities (HF Qwen3MoeConfig's default).
    expert_ffn_dim: F, hidden width of each SwiGLU expert.
    rope_theta / norm_eps / init_std: RoPE base / RMSNorm epsilon / normal init std of matrices.
    tie_embeddings: the unembedding is the transposed input embedding.
    max_seq_len: longest sequence (prompt + response) the model is used with.
    param_dtype / compute_dtype: parameter / training-path activation and matmul dtype (DTYPES).
    remat: what a scanned layer keeps for backward (REMAT_POLICIES): 'none' every activation,
      'full' its input, 'dots' per jax.checkpoint_policies.dots_with_no_batch_dims_saveable.
      Always 'full' under batch_invariant, each layer recomputed untiled (model/invariant.py).
    dispatch: 'grouped' (sorted, dropless, fast) or 'dense' (every expert on every token: the
      reference). moe_tile: rows per tile of the grouped path (groups pad to a multiple).
    gmm_impl: the grouped path's matmul, a row of GMM_IMPLS (kernels/gmm_impls.py; 'loop': the
      pure-JAX reference). The preset chooses; layers never look at the platform.
    expert_parallel: expert FFN under shard_map, each device holding its `expert` shard of the
      experts (model/expert_parallel.py); False: every device gathers all experts' weights.
    unroll_layers: unroll the layer scan (fast for few small layers; compiles slower when deep).
    attention_impl: 'naive' (one [T, S] score matrix per head), 'chunked' (the same function,
      scanning rematerialized chunks of `attention_chunk` query rows: memory O(chunk · S), not
      O(T · S)) or 'causal' (no KV cache: unrolled query blocks skipping the masked ones, ≈ half
      the score work at a few hundred slots, up to float reassociation; with a cache: 'naive').
    attention_chunk: query rows per chunk ('chunked') or block ('causal').
    kv_cache_layout: the sampler's per-layer cache (KV_CACHE_LAYOUTS): 'bskd' [B, S, KV, Dh] or
      'bksd' [B, KV, S, Dh], a contiguous [S, Dh] per (row, kv head) that decode reads without a
      transpose (faster on CPU; on TPU the blocked decode attention reads its blocks).
    decode_block: decode attention reads the cache in blocks of this many slots up to the slot it
      writes (online softmax, as flash-decoding): HBM traffic grows with the rollout, not all S
      slots per step; 0: one softmax. Decode only; equal up to float reassociation.
    decode_attention_impl: that blocked attention, a row of DECODE_IMPLS
      (kernels/decode_attention_impls.py; 'blocks': the pure-JAX reference). A ragged row (each
      row reads its own blocks) needs decode_block > 0 and kv_cache_layout='bksd'.
    router_z_loss_weight / router_aux_loss_weight: weight of the router z-loss / the
      load-balancing loss in aux['router_loss'].
    router_dtype: dtype of the router's matmul operands, accumulation, softmax and top-k (or
      float32 if wider) in the trainer and in a sampler whose preset sets none ('exact',
      'bitwise'). '': the compute dtype widened to float32. 'float64' needs JAX_ENABLE_X64=1.
    batch_invariant: both engines compute each token independently of its call
      (model/invariant.py): sampler log-probs, experts, gate weights equal the trainer's bit for
      bit at equal weights and numerics. Forward values take per-token paths in place of
      dispatch, attention_impl and decode_block, and 'loop' in place of a gmm_impl row that is
      not batch-invariant (Pallas ones are; kernels/gmm_impls.py); backward runs the chosen ones.
      Needed (and set) by sampling.numerics='bitwise'; else only the preset's mismatch remains.
    row_tile: rows per tile of the batch-invariant path; another tile gives other bits, equal in
      both engines. Larger: fewer sequential tile iterations, more decode-row padding."""

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
    decode_block: int = 0
    decode_attention_impl: str = "blocks"
    router_z_loss_weight: float = 0.0
    router_aux_loss_weight: float = 0.0
    batch_invariant: bool = False
    row_tile: int = 32
    router_dtype: str = ""

    def __post_init__(self):
        check_positive_int(self, "vocab_size", "d_model", "num_layers", "num_heads",
                           "num_kv_heads", "head_dim", "num_experts", "top_k",
                           "expert_ffn_dim", "max_seq_len", "moe_tile", "attention_chunk",
                           "row_tile")
        check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
              f"must divide num_heads={self.num_heads}, got {self.num_kv_heads}")
        check(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        check(self.top_k <= self.num_experts, "top_k",
              f"must be <= num_experts={self.num_experts}, got {self.top_k}")
        check(fits_float32(self.rope_theta) and self.rope_theta > 0, "rope_theta",
              f"must be > 0 and finite in float32, the dtype RoPE computes in (at most "
              f"{FLOAT32_MAX:.4g}), got {self.rope_theta}")
        check(fits_float32(self.norm_eps) and 0 < self.norm_eps < 1, "norm_eps",
              f"must be in (0, 1) and a normal float32 (at least {FLOAT32_TINY:.4g}: RMSNorm "
              f"adds it in float32), got {self.norm_eps}")
        check(is_finite(self.init_std) and self.init_std > 0, "init_std",
              f"must be > 0, got {self.init_std}")
        for f in ("param_dtype", "compute_dtype"):
            check_choice(self, f, DTYPES)
        check(self.router_dtype in ("", *DTYPES), "router_dtype",
              f"must be '' (the compute dtype, at least float32) or one of {DTYPES}, got "
              f"{self.router_dtype!r}")
        check(self.dispatch in ("grouped", "dense"), "dispatch",
              f"must be 'grouped' or 'dense', got {self.dispatch!r}")
        for f in ("router_z_loss_weight", "router_aux_loss_weight"):
            v = getattr(self, f)
            check(is_finite(v) and v >= 0, f, f"must be >= 0, got {v}")
        check(self.remat in REMAT_POLICIES, "remat",
              f"must be one of {REMAT_POLICIES} ('full' was remat=true), got {self.remat!r}")
        check_choice(self, "gmm_impl", GMM_IMPLS)
        check_choice(self, "attention_impl", ATTENTION_IMPLS)
        check_choice(self, "kv_cache_layout", KV_CACHE_LAYOUTS)
        check(is_int(self.decode_block) and self.decode_block >= 0, "decode_block",
              f"must be an int >= 0 (slots per block; 0 = off), got {self.decode_block!r}")
        check_choice(self, "decode_attention_impl", DECODE_IMPLS)
        if DECODE_IMPLS[self.decode_attention_impl].ragged:
            check(self.decode_block > 0 and self.kv_cache_layout == "bksd",
                  "decode_attention_impl", f"{self.decode_attention_impl!r} reads the "
                  "cache in blocks of a head-major cache: set model.decode_block (e.g. 512) "
                  "and model.kv_cache_layout=bksd, or use 'blocks'")
        check(not self.expert_parallel or self.dispatch == "grouped", "expert_parallel",
              "needs dispatch='grouped' (the dense path runs every expert on every token)")
        check_bool(self, "tie_embeddings", "expert_parallel", "norm_topk_prob", "unroll_layers",
                   "batch_invariant")



@dataclasses.dataclass(frozen=True)
class SamplingConfig(Section):
    """The inference engine μ: decoding and numerics; EOS and padding ids are the tokenizer's.

    max_new_tokens: C, completion slots per row.
    temperature: logits are divided by it (> 0).
    top_k: keep the k most likely tokens (0 = off).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = off).
    numerics: the engine's preset (INFERENCE_NUMERICS, model/numerics.py). 'bitwise': 'exact' per
      token in both engines (sets model.batch_invariant): log μ = log π_old bit for bit.
    router_noise_std / act_fp8: mismatch dials (router-logit noise; per-token e4m3 activations).
    router_dtype: the sampler's router arithmetic (as model.router_dtype), over the preset's ('':
      keep it); 'float32' under 'fp8' (bfloat16 router) is prime-rl's full-precision router.
    max_batch: rows decoded at once over the mesh (0: all), more in slices of it (its KV cache
      bounds a pod's sampling batch), a row's sample unchanged (own key) up to prefill matmul
      rounding (docs/records/benchmarks.md). Divides the step's B responses, except as the slots
      of partial rollouts (rl.max_staleness >= 1), maybe > B (rl/inflight.slots).
    dispatch: the sampler's 'grouped' or 'dense' (as a server's MoE kernels differ; equal up to
      float reassociation); '': model.dispatch. Small models decode faster 'dense' on CPU.
    layout: decode weights' placement: 'train' the trainer's FSDP shardings, all-gathered per
      layer per decode step; 'serve' resharded once per sample call to sharding.SERVE_RULES
      (experts over every chip, the rest replicated, FP8 weights e4m3 + per-channel scales), so
      decode moves only activations; prefill stays 'train'. Equal up to float reassociation.
    continuous: continuous batching (stablerl_jax/sampling/continuous.py): max_batch slots (0:
      one per row), a finished slot taking the next pending response at once: the static
      sampler's responses (up to prefill rounding, continuous.py) in fewer decode steps."""

    max_new_tokens: int = 48
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    numerics: str = "fp8"
    router_noise_std: float = 0.0
    router_dtype: str = ""
    act_fp8: bool = False
    max_batch: int = 0
    dispatch: str = ""
    layout: str = "train"
    continuous: bool = False

    def __post_init__(self):
        check_positive_int(self, "max_new_tokens")
        check_choice(self, "layout", SAMPLER_LAYOUTS)
        check(is_int(self.max_batch) and self.max_batch >= 0, "max_batch",
              f"must be an int >= 0 (0 = every row at once), got {self.max_batch!r}")
        check(is_finite(self.temperature) and self.temperature > 0, "temperature",
              f"must be > 0, got {self.temperature}")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k",
              f"must be an int >= 0 (0 = off), got {self.top_k!r}")
        check(is_finite(self.top_p) and 0 < self.top_p <= 1, "top_p",
              f"must be in (0, 1] (1 = off), got {self.top_p}")
        check(self.numerics in INFERENCE_NUMERICS, "numerics",
              f"must be an inference preset {INFERENCE_NUMERICS} ('train' is the trainer's), "
              f"got {self.numerics!r}")
        check(is_finite(self.router_noise_std) and self.router_noise_std >= 0,
              "router_noise_std", f"must be a finite number >= 0, got {self.router_noise_std}")
        check_bool(self, "act_fp8", "continuous")
        check(self.router_dtype in ("", *DTYPES), "router_dtype",
              f"must be '' (the preset's) or one of {DTYPES}, got {self.router_dtype!r}")
        check(self.numerics != "bitwise" or (self.top_k == 0 and self.top_p == 1.0),
              "numerics", f"'bitwise' draws from the trainer's full softmax, so top_k={self.top_k}"
              f" / top_p={self.top_p} cannot apply; set sampling.top_k=0 sampling.top_p=1.0 "
              "or use 'exact'")
        check(self.dispatch in ("", "grouped", "dense"), "dispatch",
              f"must be '', 'grouped' or 'dense', got {self.dispatch!r}")

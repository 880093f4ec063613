"""The model and the sampling engine: `ModelConfig` (the decoder) and `SamplingConfig`
(how the inference engine decodes and computes)."""
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
        Under batch_invariant every policy is 'full': the backward pass recomputes each
        layer untiled from its input (model/invariant.py).
      dispatch: expert dispatch path: 'grouped' (sorted, dropless, fast) or 'dense'
        (every expert on every token, the reference).
      moe_tile: rows per tile of the grouped path (groups are padded to a multiple).
      gmm_impl: the grouped matmul of the grouped path: the name of a row of GMM_IMPLS
        (kernels/gmm_impls.py says what each row is; 'loop', the pure-JAX reference, is
        the default). The preset chooses; layers never look at the platform.
      expert_parallel: with a multi-device mesh, run the expert FFN under shard_map with
        each device holding only its `expert` shard of the experts: tokens are gathered
        over the `expert` mesh axis, each device runs its own experts and the partial
        outputs are reduce-scattered back (model/expert_parallel.py). False: every device
        gathers all experts' weights layer by layer and keeps its own tokens.
      unroll_layers: unroll the scan over layers (no per-layer slicing of stacked weights
        and residuals, one KV-cache buffer per layer: faster for a few small layers,
        compile time grows with depth).
      attention_impl: 'naive' (one [T, S] score matrix per head), 'chunked' (a scan over
        query chunks of `attention_chunk` rows, each rematerialized: memory O(chunk · S)
        instead of O(T · S), the same function) or 'causal' (without a KV cache, query
        blocks of `attention_chunk` rows unrolled, each against the keys up to its last
        row: the masked blocks above the diagonal are skipped, ≈ half the score work for
        a few hundred slots; with a cache it is 'naive'. The same function up to float
        reassociation).
      attention_chunk: query rows per chunk ('chunked') or per block ('causal').
      kv_cache_layout: the sampler's KV cache, per layer (KV_CACHE_LAYOUTS): 'bskd'
        ([B, S, KV, Dh]) or 'bksd' ([B, KV, S, Dh]: each (row, kv head) a contiguous
        [S, Dh] block, so a decode step's products read the cache without transposing it:
        faster on CPU; on TPU the blocked decode attention (decode_block) reads a block
        of it without a transpose).
      decode_block: a decode step's attention (one token per row against the KV cache)
        reads the cache in blocks of this many slots, only up to the slot it writes (an
        online softmax, flash-decoding's): its HBM traffic grows with the rollout instead
        of being all S slots on every step. 0: one softmax over every slot. The same
        function up to float reassociation; the prefill and the training engine never
        use it.
      decode_attention_impl: that blocked decode attention's implementation, the name of
        a row of DECODE_IMPLS (kernels/decode_attention_impls.py says what each row is;
        'blocks', the pure-JAX reference, is the default). A row marked ragged (each row
        reads its own blocks) needs decode_block > 0 and kv_cache_layout='bksd'.
      router_z_loss_weight: weight of the router z-loss in aux['router_loss'].
      router_aux_loss_weight: weight of the load-balancing loss in aux['router_loss'].
      router_dtype: the router's arithmetic in the training engine, and in the sampler
        where its preset does not set one ('exact', 'bitwise'): its matmul's operands in
        this dtype, accumulated, soft-maxed and ranked (top-k) in it or float32 if wider.
        '': the compute dtype widened to float32. 'float64' needs JAX_ENABLE_X64=1.
      batch_invariant: both engines compute every token's results independently of the
        call it is in (model/invariant.py): the sampler's log-probs, experts and gate
        weights then equal the trainer's bit for bit at equal weights and numerics.
        Replaces dispatch, attention_impl and decode_block by its own per-token paths,
        and gmm_impl by the reference 'loop' unless its row is batch-invariant (the
        Pallas kernels; kernels/gmm_impls.py), in the values; the trainer's backward pass
        runs the chosen ones. Required by sampling.numerics='bitwise' (whose override sets
        it); with another preset it removes every mismatch but that preset's own.
      row_tile: rows per tile of the batch-invariant path (its per-token ops and
        attention queries; a different tile gives other bits, the same in both engines).
        Larger tiles run fewer iterations of the sequential tile loop (an accelerator
        computes a tile's rows in parallel) and pad a decode step's rows to a whole tile.
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
    """The sampling engine (inference engine μ): how it decodes and how it computes.

    Attributes:
      max_new_tokens: C, completion slots per row.
      temperature: logits are divided by it (> 0).
      top_k: keep the k most likely tokens (0 = off).
      top_p: keep the smallest set of most likely tokens whose mass reaches top_p
        (1.0 = off).
      numerics: the engine's numerics preset (INFERENCE_NUMERICS, model/numerics.py).
        'bitwise' is 'exact' computed per token in both engines (model.batch_invariant,
        which it turns on): log μ equals the trainer's log π_old bit for bit.
      router_noise_std / act_fp8: extra mismatch knobs on top of it (seeded router-logit
        noise; per-token e4m3 activations).
      router_dtype: the sampler's router arithmetic (as model.router_dtype for the
        trainer), whatever the preset: e.g. 'float32' under 'fp8' (whose router is
        bfloat16) gives the full-precision router prime-rl runs; '' = the preset's.
      max_batch: rows decoded at once over the whole mesh; a larger batch is decoded as a
        sequence of slices of this many rows (its KV cache is the memory that bounds a
        pod's sampling batch). 0: every row at once. A row's sample does not depend on
        the slicing (each row draws from its own key), up to how the matmul kernels
        round a prefill of another batch size (docs/records/benchmarks.md). It divides the
        step's B responses, except under partial rollouts (rl.max_staleness >= 1), where
        it is the sampler's slots and may exceed B (rl/inflight.slots).
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
      continuous: continuous batching (stablerl_jax/sampling/continuous.py): max_batch slots
        (0: one per row), and a slot whose response is complete takes the next pending
        response at once, instead of idling until its slice's longest row stops. The
        static sampler's responses (up to the rounding of a prefill batch's size,
        continuous.py) in fewer decode steps; training rollouts and evaluation alike.
    EOS and padding ids are the tokenizer's.
    """

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

"""`LossConfig` (the surrogate loss), `OptimConfig`, `RLConfig` (the global-step loop;
`parse_eval_sets` reads its `eval_sets`) and `SFTConfig` (the cold start)."""
from __future__ import annotations

import dataclasses

from stablerl_jax.config.checks import (
    Section,
    check,
    check_bool,
    check_choice,
    check_positive_int,
    is_finite,
    is_int,
)
from stablerl_jax.config.choices import (
    ADVANTAGE_NAMES,
    AGGREGATIONS,
    CENTER_MODES,
    EVAL_SET_NAME,
    IS_CORRECTIONS,
    LOGPROB_IMPLS,
    LOSS_TABLE,
    OLD_POLICIES,
    OVERLONG_MODES,
    REPLAY_MODES,
    ROW_DENOMINATORS,
    SFT_FORMATS,
    TRUST_REGIONS,
)
from stablerl_jax.config.loss_table import loss_knobs, readers


@dataclasses.dataclass(frozen=True)
class LossConfig(Section):
    """Surrogate loss settings; the defaults are MiniRL exactly (docs/method.md §4, Eq. 7).

    name: a row of `LOSS_TABLE` (stablerl_jax/config/loss_table.py). A knob some row lists
      (`loss_table.loss_knobs`) set off its default is refused for a loss whose row lacks it.
    eps_low / eps_high: clip range on the staleness ratio r = π_θ/π_old.
    clip: apply the clipping mask (MiniRL) / clipped objective; False = "no clipping".
    use_is: apply the training–inference IS weight; False = "w/o train-infer IS".
    is_correction: the IS weight: 'none' 1; 'tis' truncated at tis_cap (C); 'mis' drops ratio >
      is_high; 'icepop' drops outside [is_low, is_high]; 'seq_product' / 'seq_geomean' one
      sequence-level weight, truncated at tis_cap.
    cap_target: 'full' caps π_θ/μ_old (MiniRL); 'engine' caps π_old/μ_old, × uncapped π_θ/π_old.
    aggregation: None: the `LOSS_TABLE` row's; else one of AGGREGATIONS. MiniRL "+ length
      normalization" is 'seq_mean_token_mean'.
    row_denominator: the rows a row-mean aggregation divides by (ROW_DENOMINATORS): 'scored'
      those with a scored token (an empty row, from rl.overlong=mask or a dynamic-sampling pad,
      counts nowhere); 'all' every mini-batch row, as verl (global_batch_size) and tunix. With e
      of B rows empty they differ by B/(B − e). Refused with token_mean (divides by tokens).
    advantage: baseline (`advantages.ADVANTAGES`); MiniRL uses group_mean.
    advantage_std_ddof: group_norm's std divides by G − ddof: 0 the population std (the paper's
      "std of the group", this project's stored results); 1 the sample std of verl and tunix,
      advantages √((G−1)/G) as large (×0.935 at G = 8).
    clip_ratio_c: verl's dual-clip for the PPO-clip losses (their `LOSS_TABLE` rows list it): for
      Â < 0 the clipped term is bounded below by c·Â, so a token with r > c gives c·Â and no
      gradient. 0 = off; verl uses 3.0; must be > 1 + eps_high.
    max_log_ratio: log-ratios are clipped to ±this before exp (no overflow).
    gspo_eps_low / gspo_eps_high: GSPO's (tiny) clip range on the sequence ratio.
    gspo_max_log_ratio: clamp of GSPO's sequence log-ratio (tunix, verl: 10).
    norm_length: T_norm of 'seq_mean_token_sum_norm' (Dr. GRPO: generation budget); 0: padded T.
    center: score centering around any loss (method/centering.py, docs/method.md §14): 'none';
      'exact' subtracts E_q[∇ log π] with the sampler's whole-vocabulary q; 'topk' with q's top
      center_k head and a tail shaped like π. center_k: K (1 <= K < model.vocab_size).
    trust_region: trust-region masking: a response whose largest per-token divergence between
      π_old and μ exceeds trust_region_delta (δ, > 0) gets Â = 0 in every loss. 'k1':
      log μ − log π_old; 'abs': |log π_old − log μ|; 'none': off."""

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
    row_denominator: str = "scored"
    advantage: str = "group_mean"
    advantage_std_ddof: int = 0
    clip_ratio_c: float = 0.0
    max_log_ratio: float = 20.0
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    gspo_max_log_ratio: float = 10.0
    norm_length: int = 0
    center: str = "none"
    center_k: int = 32
    trust_region: str = "none"
    trust_region_delta: float = 0.5

    def __post_init__(self):
        check_choice(self, "name", LOSS_TABLE)
        check_choice(self, "center", CENTER_MODES)
        check(is_int(self.center_k) and self.center_k >= 1, "center_k",
              f"must be an int >= 1 (the top-k head of q), got {self.center_k!r}")
        check(self.center == "topk" or self.center_k == 32, "center_k",
              f"only applies with loss.center=topk (got center={self.center!r}); set "
              "loss.center=topk or loss.center_k=32")
        check_choice(self, "trust_region", TRUST_REGIONS)
        check(is_finite(self.trust_region_delta) and self.trust_region_delta > 0,
              "trust_region_delta", f"must be a finite number > 0 (the largest per-token "
              f"divergence a response may have), got {self.trust_region_delta!r}")
        check(self.trust_region != "none" or self.trust_region_delta == 0.5,
              "trust_region_delta", "only applies with loss.trust_region=k1 or abs; set "
              "loss.trust_region or loss.trust_region_delta=0.5")
        check_choice(self, "is_correction", IS_CORRECTIONS)
        check(self.aggregation is None or self.aggregation in AGGREGATIONS, "aggregation",
              f"must be None or one of {AGGREGATIONS}, got {self.aggregation!r}")
        check_choice(self, "row_denominator", ROW_DENOMINATORS)
        aggregation = self.aggregation or LOSS_TABLE[self.name].aggregation
        check(self.row_denominator == "scored" or aggregation != "token_mean",
              "row_denominator", f"{self.row_denominator!r} picks the rows of a row mean; "
              f"loss {self.name!r} aggregates by token_mean, which divides by tokens; set "
              "loss.row_denominator=scored or loss.aggregation to one of "
              f"{tuple(a for a in AGGREGATIONS if a != 'token_mean')}")
        check_choice(self, "advantage", ADVANTAGE_NAMES)
        check(self.cap_target in ("full", "engine"), "cap_target",
              f"must be 'full' or 'engine', got {self.cap_target!r}")
        for f in ("eps_low", "gspo_eps_low"):
            v = getattr(self, f)
            check(is_finite(v) and 0 <= v < 1, f, f"must be in [0, 1), got {v}")
        for f in ("eps_high", "gspo_eps_high"):
            v = getattr(self, f)
            check(is_finite(v) and v >= 0, f, f"must be a finite number >= 0, got {v}")
        check(is_finite(self.tis_cap) and self.tis_cap >= 1, "tis_cap",
              f"must be a finite number >= 1, got {self.tis_cap}")
        check(is_finite(self.is_low) and is_finite(self.is_high)
              and 0 <= self.is_low < 1 < self.is_high, "is_low",
              f"need 0 <= is_low < 1 < is_high, got is_low={self.is_low}, is_high={self.is_high}")
        # exp(±max) and the squared weights of the metrics must stay finite in float32.
        check(is_finite(self.max_log_ratio) and 0 < self.max_log_ratio <= 40, "max_log_ratio",
              f"must be in (0, 40] so exp(2·max_log_ratio) fits float32, got {self.max_log_ratio}")
        check(is_finite(self.gspo_max_log_ratio) and 0 < self.gspo_max_log_ratio <= 40,
              "gspo_max_log_ratio", f"must be in (0, 40], got {self.gspo_max_log_ratio}")
        check(is_int(self.advantage_std_ddof) and self.advantage_std_ddof in (0, 1),
              "advantage_std_ddof",
              f"must be 0 (population std) or 1 (sample std, verl / tunix), got "
              f"{self.advantage_std_ddof!r}")
        check(is_finite(self.clip_ratio_c)
              and (self.clip_ratio_c == 0 or self.clip_ratio_c > 1 + self.eps_high),
              "clip_ratio_c", f"must be 0 (off) or > 1 + eps_high = {1 + self.eps_high} "
              f"(verl uses 3.0), got {self.clip_ratio_c}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for knob in loss_knobs(LOSS_TABLE):
            check(getattr(self, knob) == defaults[knob]
                  or knob in LOSS_TABLE[self.name].knobs, knob,
                  f"loss {self.name!r} does not read it (the losses that do: "
                  f"{readers(LOSS_TABLE, knob)}); set loss.{knob}={defaults[knob]!r}, or "
                  "loss.name to one of those")
        check(is_int(self.norm_length) and self.norm_length >= 0, "norm_length",
              f"must be an int >= 0 (0 = padded T), got {self.norm_length!r}")
        check_bool(self, "clip", "use_is")


@dataclasses.dataclass(frozen=True)
class OptimConfig(Section):
    """Global-norm gradient clipping, then AdamW. schedule: 'constant' after `warmup_frac` of the
    steps of linear warmup from 0, or 'cosine' decay to end_lr_frac · learning_rate after it."""

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
        check(is_finite(self.learning_rate) and self.learning_rate > 0, "learning_rate",
              f"must be a finite number > 0, got {self.learning_rate}")
        check(self.schedule in ("constant", "cosine"), "schedule",
              f"must be 'constant' or 'cosine', got {self.schedule!r}")
        for f in ("warmup_frac", "end_lr_frac"):
            v = getattr(self, f)
            check(is_finite(v) and 0 <= v <= 1, f, f"must be in [0, 1], got {v}")
        for f in ("b1", "b2"):
            v = getattr(self, f)
            check(is_finite(v) and 0 <= v < 1, f,
                  f"must be in [0, 1) (1 never forgets the first gradient), got {v}")
        # AdamW divides by sqrt(v) + eps: below ~1e-30 a zero second moment overflows.
        check(is_finite(self.eps) and self.eps >= 1e-30, "eps",
              f"must be a finite number >= 1e-30, got {self.eps}")
        check(is_finite(self.weight_decay) and self.weight_decay >= 0, "weight_decay",
              f"must be a finite number >= 0, got {self.weight_decay}")
        check(is_finite(self.grad_clip) and self.grad_clip > 0, "grad_clip",
              f"must be a finite number > 0, got {self.grad_clip}")


@dataclasses.dataclass(frozen=True)
class RLConfig(Section):
    """The global-step loop (docs/method.md §1): B/G prompts × G responses = B responses per
    step, N mini-batches (= optimizer steps) per step; evaluation and checkpoint cadence.

    replay: 'none' | 'r2' | 'r3' (docs/method.md §3). replay_weights: R3 only, beyond the paper:
      also replay the sampler's routing (combine) weights, fixed: no router gradient via them.
    microbatches: gradient accumulation over this many slices of each mini-batch in one jitted
      step (= one big batch: rl/accumulate.py); score: same slices; memory follows the slice.
    freeze_router: router frozen (NeMo-RL's GRPO default); needs model.router_*_loss_weight 0.
    eval_sets: named held-out sets "name:path,name:path", each path a JSONL or parquet file or a
      directory with test.jsonl or test.parquet; '': the task's test split, named 'test'.
    offline_rollouts: a rollout file to train on (interop/rollouts.py; vLLM, SGLang); '': sample.
    logprob_impl: the fused log-prob op, a row of LOGPROB_IMPLS (kernels/fused_logprob_impls.py;
      'chunked' runs everywhere); GPU with bf16 compute: 'pallas_gpu' (forward + backward 0.16×
      naive, 'chunked' 1.4×; docs/records/benchmarks.md).
    trim_bucket: score and update only slots some row used, the width rounded up to a multiple of
      this (same result; one compile per width); 0: off (max_prompt_len + max_new_tokens).
    score_in_update: with one mini-batch (on-policy), log π_old from the update's forward
      (stop-gradient), not a score pass at the same θ_old: one forward less (rl/step_fns.py);
      monitors are then 0 for an update skipped as non-finite.
    seed: every random choice of the run derives from (seed, step).
    max_consecutive_skips: stop with an error after this many non-finite updates in a row.
    overlong: what a truncated response (no stop id) trains on: 'keep' as finished; 'mask' no
      gradient (out of loss and denominators; advantages from the whole group, as verl / DAPO);
      'penalty' DAPO's soft overlong punishment: 0 up to max_new_tokens − overlong_buffer, linear
      to −overlong_penalty_factor at max_new_tokens (`overlong.length_penalty`).
    overlong_buffer: L_buf of 'penalty', in tokens (0 < L_buf <= sampling.max_new_tokens).
    overlong_penalty_factor: the penalty at max_new_tokens (> 0; DAPO: 1.0).
    dynamic_sampling: DAPO's (rl/dynamic.py, docs/method.md §9): drop equal-reward groups
      (Â = 0), refill with more rounds of prompts_per_step prompts; static sampler only.
    max_sampling_rounds: most rounds per step; a batch still short pads with empty responses (no
      scored token), and `dynamic/filled_frac` < 1 says so.
    log_samples: decoded prompt / response / reward rows per eval, special tokens shown, with
      `ended` (the stop token or 'truncated'), to samples.jsonl and TensorBoard text; 0: none.
    log_samples_every: also log training samples every this many steps (0: evals only).
    max_staleness: S, partial rollouts (rl/inflight.py, docs/method.md §8); 0: off. S >= 1: B + n
      responses in flight (n slots); a step takes the first Q groups done, the rest continue
      under new parameters, and a response with a token over S versions old is resampled.
    old_policy: π_old when S >= 1 (OLD_POLICIES). 'behavior': the trainer at each token's version
      (the last S kept, a batch scored once per version), so π_old / μ_old stays the mismatch and
      the lag sits in π_θ / π_old under the clip (Eq. 5). 'proximal' (AReaL's decoupled
      objective): the current parameters, so π_old / μ_old carries the lag too.
    pack_tokens: T, token-budget packing of score and update (stablerl_jax/packing.py); 0: off.
      T > 0: whole sequences first-fit decreasing into T-token rows as segments (RoPE restarts,
      no attention across); T >= task.max_prompt_len + sampling.max_new_tokens.
    pack_rows: packed rows per micro-batch (a multiple of the batch shards; 0: one per shard), so
      one forward holds pack_rows × pack_tokens tokens; step time follows tokens.
    attribution: split each scored token's log π_θ − log μ into precision, routing and staleness
      (stablerl_jax/method/attribution.py, docs/method.md §11), logging moments, covariances and
      token bins per step (`attr/…`, `attr_bin/…`); one more score forward.
    attribution_every: every this many steps a probe splits routing by layer (`attr_layer/…`, a
      forward per layer) and writes tokens and parts to attribution.jsonl; 0: never.
    attribution_rows: the probe's rows, a multiple of data*fsdp*expert; 0: the smallest one >= 8.
    drift_monitor: log the drift term per step (`drift/l1`, `drift/reward_weighted`,
      method/centering.py), the sampler's whole-vocabulary q recomputed in the score step (one
      more forward); with rl.attribution also its parts (`attr/drift_…`).
    phase_sync: sync after scoring, else its time may land in time/update (rl/costs.py)."""

    steps: int = 60
    prompts_per_step: int = 16
    group_size: int = 8
    num_minibatches: int = 1
    microbatches: int = 1
    replay: str = "none"
    replay_weights: bool = False
    freeze_router: bool = False
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
    phase_sync: bool = True
    seed: int = 0
    max_consecutive_skips: int = 16
    overlong: str = "keep"
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    log_samples: int = 4
    log_samples_every: int = 0
    max_staleness: int = 0
    old_policy: str = "behavior"
    pack_tokens: int = 0
    pack_rows: int = 0
    attribution: bool = False
    attribution_every: int = 10
    attribution_rows: int = 0
    drift_monitor: bool = False
    optim: OptimConfig = OptimConfig()

    def __post_init__(self):
        check_choice(self, "overlong", OVERLONG_MODES)
        check(is_int(self.overlong_buffer) and self.overlong_buffer >= 0
              and (self.overlong != "penalty" or self.overlong_buffer > 0), "overlong_buffer",
              f"must be an int > 0 with rl.overlong=penalty (the tokens before max_new_tokens "
              f"over which the penalty ramps), >= 0 otherwise, got {self.overlong_buffer!r}")
        check(is_finite(self.overlong_penalty_factor) and self.overlong_penalty_factor > 0,
              "overlong_penalty_factor", f"must be a number > 0 (DAPO: 1.0), got "
              f"{self.overlong_penalty_factor!r}")
        check(is_int(self.max_sampling_rounds) and self.max_sampling_rounds >= 1,
              "max_sampling_rounds", f"must be an int >= 1 (the rounds of prompts_per_step "
              f"prompts a step samples at most under rl.dynamic_sampling), got "
              f"{self.max_sampling_rounds!r}")
        for f in ("log_samples", "log_samples_every"):
            check(is_int(getattr(self, f)) and getattr(self, f) >= 0, f,
                  f"must be an int >= 0 (0 = off), got {getattr(self, f)!r}")
        check(is_int(self.steps) and self.steps >= 0, "steps",
              f"must be an int >= 0 (0: no RL stage; the run evaluates the initial policy "
              f"and exports it), got {self.steps!r}")
        check_positive_int(self, "prompts_per_step", "group_size", "num_minibatches",
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
        check(is_int(self.seed) and self.seed >= 0, "seed",
              f"must be an int >= 0, got {self.seed!r}")
        check(is_int(self.trim_bucket) and self.trim_bucket >= 0, "trim_bucket",
              f"must be an int >= 0 (0 = off), got {self.trim_bucket!r}")
        check_bool(self, "async_checkpoints", "phase_sync", "replay_weights", "score_in_update",
                   "dynamic_sampling", "attribution", "freeze_router",
                   "drift_monitor")
        check(not (self.drift_monitor and self.score_in_update and self.num_minibatches == 1),
              "drift_monitor", "compares q with the score step's π_old, which "
              "rl.score_in_update skips with one mini-batch; set rl.score_in_update=false "
              "or rl.drift_monitor=false")
        check(is_int(self.attribution_every) and self.attribution_every >= 0,
              "attribution_every", f"must be an int >= 0 (0 = no probe), got "
              f"{self.attribution_every!r}")
        probing = self.attribution and self.attribution_every
        check(is_int(self.attribution_rows) and self.attribution_rows >= 0 and (
            not probing or self.attribution_rows <= responses), "attribution_rows",
              f"must be an int >= 0 (0 = about 8, one per batch shard at least) and, with "
              f"the probe on, <= prompts_per_step*group_size = {responses}, got "
              f"{self.attribution_rows!r}")
        check(not self.replay_weights or self.replay == "r3", "replay_weights",
              f"replays the sampler's recorded weights, so it needs replay='r3', got "
              f"replay={self.replay!r}; set rl.replay=r3 or rl.replay_weights=false")
        check(isinstance(self.offline_rollouts, str), "offline_rollouts",
              f"must be a path string ('' = sample), got {self.offline_rollouts!r}")
        for f in ("pack_tokens", "pack_rows"):
            check(is_int(getattr(self, f)) and getattr(self, f) >= 0, f,
                  f"must be an int >= 0 (0 = off / one row per batch shard), got "
                  f"{getattr(self, f)!r}")
        check(not (self.pack_tokens and self.microbatches > 1), "microbatches",
              f"packing (rl.pack_tokens={self.pack_tokens}) micro-batches by token budget "
              f"(rl.pack_rows rows of pack_tokens); set rl.microbatches=1, got "
              f"{self.microbatches}")
        check(self.pack_tokens or not self.pack_rows, "pack_rows",
              "only applies with rl.pack_tokens > 0; set rl.pack_rows=0 or rl.pack_tokens")
        check(is_int(self.max_staleness) and self.max_staleness >= 0, "max_staleness",
              f"must be an int >= 0 (0 = no partial rollouts), got {self.max_staleness!r}")
        check(not (self.max_staleness and self.offline_rollouts), "max_staleness",
              f"partial rollouts continue our sampler's responses, so they need "
              f"rl.offline_rollouts='' (got {self.offline_rollouts!r}); set "
              "rl.max_staleness=0 to train on the file")
        check_choice(self, "old_policy", OLD_POLICIES)
        check(not (self.dynamic_sampling and self.max_staleness), "dynamic_sampling",
              f"drops and resamples whole groups of one step, which partial rollouts "
              f"(rl.max_staleness={self.max_staleness}) carry across steps; set "
              "rl.max_staleness=0 or rl.dynamic_sampling=false")
        check(not (self.dynamic_sampling and self.offline_rollouts), "dynamic_sampling",
              f"samples further prompts, which an offline rollout file "
              f"(rl.offline_rollouts={self.offline_rollouts!r}) cannot; set "
              "rl.offline_rollouts='' or rl.dynamic_sampling=false")
        parse_eval_sets(self.eval_sets)


def parse_eval_sets(spec) -> dict[str, str]:
    """`rl.eval_sets` "name:path,name:path" as {name: path} in order ({} for ''): names unique,
    [A-Za-z0-9_-]+; paths non-empty (split at the first ':', so a path may hold ':')."""
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
class SFTConfig(Section):
    """Cold-start supervised fine-tuning (rl/sft.py; the data: data/sft_data.py).

    steps: optimizer steps; 0: none (RL starts from a fresh init or the `--hf` checkpoint).
    data: a JSONL or parquet file, or a directory with train.jsonl or train.parquet, of
      `messages` records (chats, every assistant turn trained), `prompt` / `response` pairs or
      worked-solution math (gsm8k, math); '': the task's train split and solutions.
    format: 'auto' (detected from the first record's fields) or one of SFT_FORMATS.
    checkpoint_every: steps between resumable SFT saves (`<workdir>/sft_run/`); 0: never.
    microbatches: gradient accumulation over this many slices per batch (as rl.microbatches); the
      run stops with an error after `max_consecutive_skips` non-finite updates in a row."""

    steps: int = 300
    batch_size: int = 32
    microbatches: int = 1
    seed: int = 0
    max_consecutive_skips: int = 16
    data: str = ""
    format: str = "auto"
    checkpoint_every: int = 100
    optim: OptimConfig = OptimConfig(learning_rate=3e-3, schedule="cosine", warmup_frac=0.1,
                                     weight_decay=0.01)

    def __post_init__(self):
        check(is_int(self.steps) and self.steps >= 0, "steps",
              f"must be an int >= 0 (0 = no cold start), got {self.steps!r}")
        check_positive_int(self, "batch_size", "microbatches", "max_consecutive_skips")
        check(is_int(self.checkpoint_every) and self.checkpoint_every >= 0,
              "checkpoint_every", f"must be an int >= 0 (0 = never), got "
              f"{self.checkpoint_every!r}")
        check_choice(self, "format", SFT_FORMATS)
        check(self.batch_size % self.microbatches == 0, "microbatches",
              f"must divide batch_size = {self.batch_size}")
        check(is_int(self.seed) and self.seed >= 0, "seed",
              f"must be an int >= 0, got {self.seed!r}")

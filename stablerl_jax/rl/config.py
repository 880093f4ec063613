"""Experiment configuration: one frozen dataclass per concern, presets, key=value overrides.

An `ExperimentConfig` bundles model, task, sampling, loss, RL and SFT settings. Presets:
- `tiny`: runs SFT + RL on 2 CPU cores in minutes.
- `paper`: the settings of arXiv 2512.01374 §5 (Qwen3-30B-A3B-sized MoE, FP8 inference,
  G = 16, 1,024 responses per mini-batch, 32k responses) for a TPU pod; stated, not run
  here.
Overrides are `section.field=value` strings, e.g. `rl.num_minibatches=4 loss.clip=false`.
"""
from __future__ import annotations

import dataclasses
import typing

from stablerl_jax.config import ConfigError, LossConfig, ModelConfig, check, check_positive_int
from stablerl_jax.data import synthetic
from stablerl_jax.data.synthetic import TaskConfig
from stablerl_jax.model import numerics as nx
from stablerl_jax.rl.steps import REPLAY_MODES
from stablerl_jax.rollout import SamplingConfig


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The global-step loop (PAPER.md §1): B prompts × G responses, N mini-batches.

    inference: numerics preset of the sampling path ('exact', 'bf16', 'fp8');
    router_noise_std / act_fp8: extra mismatch knobs on top of it.
    replay: 'none' | 'r2' | 'r3'.
    mesh: (data, fsdp, expert) sizes; their product is the number of devices used.
    logprob_impl: the fused log-prob op ('naive', 'chunked', 'pallas'); 'chunked' runs
    everywhere, 'pallas' is the fast one on a GPU with bf16 compute (forward + backward
    0.16× naive there, where 'chunked' is 1.4×; docs/benchmarks.md).
    """

    steps: int = 60
    prompts_per_step: int = 16
    group_size: int = 8
    num_minibatches: int = 1
    replay: str = "none"
    inference: str = "fp8"
    router_noise_std: float = 0.0
    act_fp8: bool = False
    learning_rate: float = 1e-4
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    logprob_impl: str = "chunked"
    eval_every: int = 10
    eval_k: int = 4
    eval_problems: int = 64
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    async_checkpoints: bool = True
    seed: int = 0
    mesh: tuple = (1, 1, 1)

    def __post_init__(self):
        check_positive_int(self, "steps", "prompts_per_step", "group_size", "num_minibatches",
                           "eval_every", "eval_k", "eval_problems", "checkpoint_every",
                           "keep_checkpoints")
        check(self.replay in REPLAY_MODES, "replay",
              f"must be one of {REPLAY_MODES}, got {self.replay!r}")
        check(self.inference in nx.PRESETS and self.inference != "train", "inference",
              f"must be an inference preset {sorted(set(nx.PRESETS) - {'train'})}, "
              f"got {self.inference!r}")
        check(self.router_noise_std >= 0, "router_noise_std", "must be >= 0")
        check(self.learning_rate > 0, "learning_rate", f"must be > 0, got {self.learning_rate}")
        check(self.grad_clip > 0, "grad_clip", f"must be > 0, got {self.grad_clip}")
        check(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}")
        check(self.logprob_impl in ("naive", "chunked", "pallas"), "logprob_impl",
              f"must be 'naive', 'chunked' or 'pallas', got {self.logprob_impl!r}")
        responses = self.prompts_per_step * self.group_size
        check(responses % self.num_minibatches == 0, "num_minibatches",
              f"must divide prompts_per_step*group_size = {responses}")
        check(len(self.mesh) == 3 and all(isinstance(m, int) and m > 0 for m in self.mesh),
              "mesh", f"must be three positive ints (data, fsdp, expert), got {self.mesh}")
        dp = self.mesh[0] * self.mesh[1]
        check((responses // self.num_minibatches) % dp == 0, "mesh",
              f"data*fsdp = {dp} must divide the mini-batch size "
              f"{responses // self.num_minibatches}")

    @property
    def numerics(self) -> nx.Numerics:
        return nx.preset(self.inference, router_noise_std=self.router_noise_std,
                         act_fp8=self.act_fp8, noise_seed=self.seed)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Cold-start supervised fine-tuning on the task's worked solutions."""

    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_frac: float = 0.1
    seed: int = 0

    def __post_init__(self):
        check_positive_int(self, "steps", "batch_size")
        check(self.learning_rate > 0, "learning_rate", f"must be > 0, got {self.learning_rate}")
        check(0 <= self.warmup_frac <= 1, "warmup_frac",
              f"must be in [0, 1], got {self.warmup_frac}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    name: str = "run"
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    loss: LossConfig = LossConfig()
    rl: RLConfig = RLConfig()
    sft: SFTConfig = SFTConfig()

    def __post_init__(self):
        check(self.model.vocab_size == self.task.vocab_size, "model.vocab_size",
              f"must equal task.vocab_size={self.task.vocab_size} (the tokenizer's), "
              f"got {self.model.vocab_size}")
        need = self.task.max_prompt_len + self.sampling.max_new_tokens
        check(need <= self.model.max_seq_len, "model.max_seq_len",
              f"must be >= task.max_prompt_len + sampling.max_new_tokens = {need}, "
              f"got {self.model.max_seq_len}")


def tiny() -> ExperimentConfig:
    """SFT + RL on the synthetic task; minutes on 2 CPU cores."""
    # 'easy' (3 single-digit operands): the cold start lands at ~30 % avg@4, inside the
    # band where RL has signal; 'medium' starts near 10 % (docs/benchmarks.md).
    task = synthetic.preset("easy", style="steps", vocab_size=64, max_prompt_len=16,
                            max_solution_len=40)
    return ExperimentConfig(
        name="tiny",
        model=ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=16, num_experts=8, top_k=2, expert_ffn_dim=64,
                          max_seq_len=64, moe_tile=16),
        task=task,
        sampling=SamplingConfig(max_new_tokens=40, temperature=1.0, eos_id=3, pad_id=0),
        loss=LossConfig(),
        rl=RLConfig(steps=200, eval_every=20, checkpoint_every=20, eval_problems=128),
        sft=SFTConfig())


def paper() -> ExperimentConfig:
    """PAPER.md §5 at full scale, for a TPU pod (not runnable on a CPU).

    Qwen3-30B-A3B-shaped MoE (48 layers, 128 experts, top-8), FP8 inference vs a
    bf16-compute training engine, G = 16, 64 prompts = 1,024 responses per mini-batch
    (N = 1; set rl.prompts_per_step=64*N and rl.num_minibatches=N for the off-policy
    runs), 32k-token responses, avg@32 evaluation. The task is a local JSONL of 4,096
    verified math problems (task.jsonl_dir). A 151,936-entry vocabulary needs the model's
    own tokenizer behind the `Tokenizer` protocol in place of the in-process SentencePiece.
    Mesh (data, fsdp, expert) = (1, 32, 8): 256 chips.
    """
    task = TaskConfig(kind="gsm8k", jsonl_dir="data/math_4096", num_train=4096, num_test=512,
                      vocab_size=151_936, max_prompt_len=1024, max_solution_len=32_768)
    return ExperimentConfig(
        name="paper",
        model=ModelConfig(vocab_size=151_936, d_model=2048, num_layers=48, num_heads=32,
                          num_kv_heads=4, head_dim=128, num_experts=128, top_k=8,
                          expert_ffn_dim=768, rope_theta=1_000_000.0, max_seq_len=33_792,
                          compute_dtype="bfloat16", remat=True, moe_tile=512,
                          router_aux_loss_weight=0.0),
        task=task,
        sampling=SamplingConfig(max_new_tokens=32_768, temperature=1.0, eos_id=3, pad_id=0),
        loss=LossConfig(),
        rl=RLConfig(steps=1000, prompts_per_step=64, group_size=16, num_minibatches=1,
                    inference="fp8", learning_rate=1e-6, eval_every=20, eval_k=32,
                    eval_problems=512, checkpoint_every=10, mesh=(1, 32, 8)),
        sft=SFTConfig(steps=2000, batch_size=256, learning_rate=1e-5, warmup_frac=0.05))


PRESETS = {"tiny": tiny, "paper": paper}


def preset(name: str, overrides=()) -> ExperimentConfig:
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown {name!r}; choose one of {sorted(PRESETS)}")
    return apply_overrides(PRESETS[name](), overrides)


def _parse(value: str, current):
    if isinstance(current, bool):
        low = value.lower()
        if low not in ("true", "false", "1", "0"):
            raise ConfigError(f"expected true/false, got {value!r}")
        return low in ("true", "1")
    if isinstance(current, tuple):
        return tuple(int(v) for v in value.strip("()").split(",") if v.strip())
    if current is None:
        return None if value.lower() == "none" else value
    try:
        return type(current)(value)
    except ValueError as e:
        raise ConfigError(f"cannot parse {value!r} as {type(current).__name__}") from e


def apply_overrides(cfg: ExperimentConfig, overrides: typing.Sequence[str]) -> ExperimentConfig:
    """Apply `section.field=value` (or `name=value`) overrides; every result re-validates."""
    sections = [f.name for f in dataclasses.fields(cfg) if f.name != "name"]
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected section.field=value")
        if key == "name":
            cfg = dataclasses.replace(cfg, name=value)
            continue
        section, _, field = key.partition(".")
        if section not in sections or not field:
            raise ConfigError(f"override {key!r}: use section.field with section in {sections}")
        sub = getattr(cfg, section)
        names = [f.name for f in dataclasses.fields(sub)]
        if field not in names:
            raise ConfigError(f"override {key!r}: unknown field; {section} has {names}")
        try:
            parsed = _parse(value, getattr(sub, field))
        except ConfigError as e:
            raise ConfigError(f"override {key!r}: {e}") from None
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(sub, **{field: parsed})})
    return cfg

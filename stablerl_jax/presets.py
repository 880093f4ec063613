"""Named settings: task difficulties and experiment presets.

- `TASKS`: difficulty presets of the synthetic arithmetic task.
- `tiny`: SFT + RL on 2 CPU cores in minutes.
- `long`: `tiny` on the 'long' task (responses ten times longer).
- `paper`: the settings of arXiv 2512.01374 §4.2 (Qwen3-30B-A3B-sized MoE, FP8 inference,
  G = 16, 1,024 responses per mini-batch, 32k responses) for a TPU pod (v5p-256); stated
  and AOT-compiled (experiments/aot_compile.py), not run here.
- `moe1b`: a ≈1B-parameter bf16 MoE for one accelerator host (benchmarks, v5e-8 AOT).
`preset(name, overrides)` applies `section.field=value` overrides
(`config.apply_overrides`), e.g. `rl.num_minibatches=4 loss.clip=false`.
"""
from __future__ import annotations

from stablerl_jax.config import (ConfigError, ExperimentConfig, LossConfig, ModelConfig,
                                 OptimConfig, RLConfig, SamplingConfig, SFTConfig, TaskConfig,
                                 apply_overrides, check)
from stablerl_jax.config.choices import DECODE_IMPLS, GMM_IMPLS, LOGPROB_IMPLS

# Difficulty presets. The problem space must hold num_test / test_fraction problems or more
# (easy: 10^3 · 2^2 = 4,000 prompts, of which ~400 hash to test). Held-out accuracy after
# the `tiny` experiment's cold start (2-layer MoE, d_model 64, 300 SFT steps, sampling at
# temperature 1): easy ≈ 0.30, medium ≈ 0.11, hard ≈ 0.01 (see docs/records/benchmarks.md).
TASKS = {
    "easy": TaskConfig(num_operands=3, max_digits=1, num_train=3000, num_test=300),
    "medium": TaskConfig(num_operands=4, max_digits=1),
    "hard": TaskConfig(num_operands=4, max_digits=2, modulus=100, max_prompt_len=24),
    # Long responses: a start digit and two operations applied in turn mod 10 for 24–40
    # steps, worked one step at a time: 220–370 solution tokens.
    "long": TaskConfig(num_operands=3, max_digits=1, modulus=10, min_steps=24, max_steps=40,
                       max_prompt_len=24, max_solution_len=376),
}


def task(name: str, **overrides) -> TaskConfig:
    """A named difficulty preset, optionally with field overrides (e.g. style='terse')."""
    check(name in TASKS, "task preset", f"unknown {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name].replace(**overrides)


def tiny() -> ExperimentConfig:
    """SFT + RL on the synthetic task; minutes on 2 CPU cores."""
    # 'easy' (3 single-digit operands): the cold start lands at ~30 % avg@4, inside the
    # band where RL has signal; 'medium' starts near 10 % (docs/records/benchmarks.md).
    return ExperimentConfig(
        name="tiny",
        # Speed on 2 CPU cores (benchmarks/global_step.py): batched-tile grouped matmul,
        # unrolled layers, a dense-dispatch sampler with a head-major KV cache, rollouts
        # trimmed to used slots, π_old from the update's own forward when a step has one
        # mini-batch.
        model=ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=16, num_experts=8, top_k=2, expert_ffn_dim=64,
                          max_seq_len=64, moe_tile=64, gmm_impl="tiles", unroll_layers=True,
                          kv_cache_layout="bksd"),
        task=task("easy", style="steps", max_prompt_len=16, max_solution_len=40),
        sampling=SamplingConfig(max_new_tokens=40, temperature=1.0, numerics="fp8",
                                dispatch="dense"),
        loss=LossConfig(),
        # 300 steps, evaluated on the whole test split (300 problems): the main job's gain
        # is resolved at every seed, as another CPU's rounding is another trajectory
        # (experiments.main_job_seeds; docs/records/results.md, "The main job").
        rl=RLConfig(steps=300, eval_every=30, checkpoint_every=30, eval_problems=300,
                    trim_bucket=8, score_in_update=True,
                    optim=OptimConfig(learning_rate=1e-4)),
        sft=SFTConfig())


def long() -> ExperimentConfig:
    """`tiny`'s model and settings on the 'long' task: responses of 220–370 tokens, ten
    times the easy task's, with the context to hold them (docs/records/results.md, long responses)."""
    base = tiny()
    t = task("long")
    return base.replace(
        name="long",
        model=base.model.replace(max_seq_len=t.max_prompt_len + t.max_solution_len),
        task=t,
        sampling=base.sampling.replace(max_new_tokens=t.max_solution_len),
        # Each long step costs ten tiny ones: 200 steps, evaluated on 128 problems.
        rl=base.rl.replace(steps=200, eval_every=20, checkpoint_every=20, eval_problems=128),
        # 300 SFT steps leave the modular sums unlearned (held-out avg@4 0.04); 1,200 with
        # the same cosine schedule learn them.
        sft=base.sft.replace(steps=1200))


# The paper's recipe as launched (docs/guides/recipe.md): the user turn of the chat template, and
# the three eval sets, each a JSONL file in task.jsonl_dir (relative eval paths are looked
# up there first).
BOXED_PROMPT = ("{question}\nPlease reason step by step, and put your final answer within "
                "\\boxed{}.")
PAPER_EVAL_SETS = "aime24:aime24.jsonl,aime25:aime25.jsonl,hmmt25:hmmt25.jsonl"


def paper() -> ExperimentConfig:
    """The paper's setup (docs/method.md §7) at full scale, for a TPU pod (not runnable on a CPU).

    Qwen3-30B-A3B-shaped MoE (48 layers, 128 experts, top-8), FP8 inference vs a
    bf16-compute training engine, G = 16, 64 prompts = 1,024 responses per mini-batch
    (N = 1; set rl.prompts_per_step=64*N and rl.num_minibatches=N for the off-policy
    runs), 32k-token responses, avg@32 evaluation on AIME24, AIME25 and HMMT25. The task
    is a local JSONL of 4,096 verified math problems (task.jsonl_dir, any of the named
    formats: data/formats.py), beside aime24.jsonl, aime25.jsonl and hmmt25.jsonl (the
    eval sets). Start from the real checkpoint with
    `experiments.train --preset paper --hf DIR`: its weights (read into float32
    master weights), its own tokenizer for the 151,936-entry vocabulary
    (task.tokenizer_dir, data/hf_tokenizer.py), its chat template around the boxed-answer
    instruction, and its stop ids (generation_config.json). The checkpoint is taken as
    already cold-started (sft.steps = 0: RL starts from it); `sft.steps=2000
    sft.data=FILE` runs the cold start of the paper's §4.5 on it first (chat or
    prompt/response records, data/sft_data.py). Truncated responses (32k
    tokens, no stop id) get no gradient (rl.overlong=mask, DAPO's overlong filtering):
    their reward, read from cut text, is not the verified outcome the objective is about,
    and a length penalty would change the paper's binary reward.

    Pod layout, chosen so that every step fits a v5p-256 (128 chips, 95.7 GiB HBM each;
    the compiled table is in docs/records/benchmarks.md): mesh (data, fsdp, expert) =
    (1, 16, 8), batch split over all 128 chips; the update accumulates over 8
    micro-batches of 128 responses (one 33k-token response per chip at a time), the
    score step runs in the same slices; the sampler decodes all 1,024 rows in one pass
    (8 per chip, 3.1 GiB of bf16 KV cache each; the eval's 16,384 rows in 16 passes) in
    the serving layout (sampling.layout='serve': FP8 weights resident, one expert per
    chip, so a decode step moves only activations; a decode step's attention reads
    each row's cache in 512-slot blocks up to that row's own slot, model.decode_block, by
    the ragged Pallas kernel, model.decode_attention_impl, from a head-major cache);
    every layer rematerialized, attention in 512-query chunks, the grouped matmul is megablox (TPU), the experts
    sharded over `expert` (expert parallelism).
    """
    return ExperimentConfig(
        name="paper",
        model=ModelConfig(vocab_size=151_936, d_model=2048, num_layers=48, num_heads=32,
                          num_kv_heads=4, head_dim=128, num_experts=128, top_k=8,
                          expert_ffn_dim=768, rope_theta=1_000_000.0, max_seq_len=33_792,
                          compute_dtype="bfloat16", remat="full", moe_tile=128,
                          gmm_impl="megablox", expert_parallel=True,
                          attention_impl="chunked", attention_chunk=512, decode_block=512,
                          decode_attention_impl="pallas_tpu", kv_cache_layout="bksd",
                          router_aux_loss_weight=0.0),
        task=TaskConfig(kind="jsonl", jsonl_dir="data/math_4096", num_train=4096,
                        num_test=512, max_prompt_len=1024, max_solution_len=32_768,
                        chat_template=True, prompt_template=BOXED_PROMPT),
        sampling=SamplingConfig(max_new_tokens=32_768, temperature=1.0, numerics="fp8",
                                max_batch=1024, layout="serve"),
        loss=LossConfig(),
        rl=RLConfig(steps=1000, prompts_per_step=64, group_size=16, num_minibatches=1,
                    microbatches=8, eval_every=20, eval_k=32, eval_problems=512,
                    eval_sets=PAPER_EVAL_SETS, overlong="mask",
                    checkpoint_every=10, optim=OptimConfig(learning_rate=1e-6)),
        sft=SFTConfig(steps=0, batch_size=256, microbatches=2,
                      optim=OptimConfig(learning_rate=1e-5, schedule="cosine",
                                        warmup_frac=0.05, weight_decay=0.01)),
        mesh=(1, 16, 8))


def moe1b() -> ExperimentConfig:
    """A ≈1B-parameter MoE (16 layers, d_model 1024, 32 experts top-4) in bf16 on one
    accelerator host: the benchmark size of benchmarks/train_step.py and the v5e-8 AOT
    table (docs/records/benchmarks.md). 2k-token sequences, 64 responses per mini-batch, the
    sampler in the serving layout (4 experts per chip, weights resident)."""
    return ExperimentConfig(
        name="moe1b",
        model=ModelConfig(vocab_size=32_768, d_model=1024, num_layers=16, num_heads=16,
                          num_kv_heads=4, head_dim=64, num_experts=32, top_k=4,
                          expert_ffn_dim=512, max_seq_len=2048, compute_dtype="bfloat16",
                          remat="full", moe_tile=128, gmm_impl="megablox",
                          attention_impl="chunked", attention_chunk=512, decode_block=512,
                          kv_cache_layout="bksd"),
        task=TaskConfig(kind="gsm8k", jsonl_dir="data/math_4096", max_prompt_len=512,
                        max_solution_len=1536),
        sampling=SamplingConfig(max_new_tokens=1536, numerics="fp8", layout="serve"),
        loss=LossConfig(),
        rl=RLConfig(steps=100, prompts_per_step=8, group_size=8, microbatches=2,
                    eval_problems=64, eval_k=4, optim=OptimConfig(learning_rate=1e-6)),
        sft=SFTConfig(batch_size=64, microbatches=2),
        mesh=(1, 8, 1))


EXPERIMENT_PRESETS = {"tiny": tiny, "long": long, "paper": paper, "moe1b": moe1b}

# Where a recipe runs. A preset states what to train together with the layout it was
# sized for (`paper`: the v5p-256 mesh, TPU kernels, the sampler's pass size); a layout
# changes only these fields, never what is trained. 'preset' keeps the preset's own;
# 'single-host' fits one host (`single_host`).
LAYOUTS = ("preset", "single-host")
# (section, field, its table) of each kernel a config names (the tables import no JAX).
KERNEL_FIELDS = (("model", "gmm_impl", GMM_IMPLS),
                 ("model", "decode_attention_impl", DECODE_IMPLS),
                 ("rl", "logprob_impl", LOGPROB_IMPLS))


def single_host(cfg: ExperimentConfig, platform: str, devices: int) -> ExperimentConfig:
    """`cfg` laid out on one host's `devices` devices of `platform` ('cpu', 'gpu', 'tpu'):
    the mesh (1, devices, 1) over this host alone (parameters and batch split over fsdp,
    no expert parallelism), each kernel that does not compile for `platform` replaced by
    its field's default (the reference, which compiles everywhere), and the sampler
    decoding the whole batch in one pass (sampling.max_batch=0). Everything else (the
    model, dtypes, remat, micro-batches, the loss, the schedule) is the preset's."""
    default = ExperimentConfig()
    sections = {"model": {}, "rl": {}}
    for section, field, table in KERNEL_FIELDS:
        name = getattr(getattr(cfg, section), field)
        if platform not in table[name].backends:
            sections[section][field] = getattr(getattr(default, section), field)
    return cfg.replace(
        mesh=(1, devices, 1), mesh_dcn=(1, 1, 1),
        model=cfg.model.replace(expert_parallel=False, **sections["model"]),
        rl=cfg.rl.replace(**sections["rl"]),
        sampling=cfg.sampling.replace(max_batch=0))


def preset(name: str, overrides=(), *, layout: str = "preset", platform: str = "cpu",
           devices: int = 1) -> ExperimentConfig:
    """The named experiment preset in `layout` (LAYOUTS; 'single-host' on `devices`
    devices of `platform`) with `overrides` applied last (validated once, together)."""
    if name not in EXPERIMENT_PRESETS:
        raise ConfigError(f"preset: unknown {name!r}; choose one of {sorted(EXPERIMENT_PRESETS)}")
    check(layout in LAYOUTS, "layout", f"unknown {layout!r}; choose one of {list(LAYOUTS)}")
    cfg = EXPERIMENT_PRESETS[name]()
    if layout == "single-host":
        cfg = single_host(cfg, platform, devices)
    return apply_overrides(cfg, overrides)

"""A synthetic multi-step arithmetic task a CPU-sized MoE can learn by SFT, then by RL.

A problem is a chain of integers joined by + and -, evaluated left to right (optionally
mod m after every step). The solution is worked in one of three styles, then the final
answer line "#### N":

    prompt:    "7+5-9+2="
    'steps':   "7+5=12 12-9=3 3+2=5 #### 5"      each step restates its two operands
    'rewrite': "12-9+2=3+2=5 #### 5"            each step rewrites the rest of the chain
    'terse':   "#### 5"                         the answer alone (no worked solution)

    with modulus=100:  prompt "37+85-12 (mod 100)="  ->  'steps': "37+85=22 22-12=10 #### 10"

Difficulty knobs: `num_operands` (steps = operands − 1), `max_digits`, `operators`
('+-' or '+'), `modulus` (0 = plain integers). `PRESETS` names three settings.

Problems are a deterministic function of the config (seed included); a problem belongs to
the test split iff a stable hash of its prompt falls below `test_fraction`, so train and
test never share a prompt, whatever the sizes or seed. Record ids are "<split>-<index>",
the index zero-padded so that sorting ids restores generation order.

The TFDS builder defaults to file_format='array_record' (tfds' own default, tfrecord,
needs TensorFlow to write) and is read with `as_data_source()` / `tfds.data_source`, whose
array_record reader needs no TensorFlow either.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np
import tensorflow_datasets as tfds

from stablerl_jax.config import check, check_positive_int

STYLES = ("steps", "rewrite", "terse")
OPERATORS = ("+-", "+")
FIELDS = ("id", "prompt", "solution", "answer")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The RL task: data, tokenizer and prompt/solution lengths.

    kind: 'arithmetic' (this module) or 'gsm8k' (a local JSONL dir, see gsm8k.py).
    num_operands / max_digits / operators / modulus: arithmetic difficulty (see module doc).
    style: worked-solution style used for SFT: 'steps', 'rewrite' or 'terse'.
    num_train / num_test: records per split (arithmetic only; JSONL files set their own).
    test_fraction: share of the problem space hashed into the test split.
    seed: the generator's seed.
    vocab_size: SentencePiece vocabulary size (the model's vocab_size must equal it).
    max_prompt_len / max_solution_len: token budgets (longer records are an error).
    jsonl_dir: manual directory with train.jsonl / test.jsonl for kind='gsm8k'.
    skip_malformed: kind='gsm8k' only: skip (and count) malformed JSONL lines instead of
      failing on the first one.
    """

    kind: str = "arithmetic"
    num_operands: int = 4
    max_digits: int = 1
    operators: str = "+-"
    modulus: int = 0
    style: str = "steps"
    num_train: int = 4000
    num_test: int = 400
    test_fraction: float = 0.1
    seed: int = 0
    vocab_size: int = 64
    max_prompt_len: int = 16
    max_solution_len: int = 40
    jsonl_dir: str = ""
    skip_malformed: bool = False

    def __post_init__(self):
        check(self.kind in ("arithmetic", "gsm8k"), "kind",
              f"must be 'arithmetic' or 'gsm8k', got {self.kind!r}")
        check_positive_int(self, "num_operands", "max_digits", "num_train", "num_test",
                           "vocab_size", "max_prompt_len", "max_solution_len")
        check(self.num_operands >= 2, "num_operands", f"must be >= 2, got {self.num_operands}")
        check(self.max_digits <= 6, "max_digits", f"must be <= 6, got {self.max_digits}")
        check(self.operators in OPERATORS, "operators",
              f"must be one of {OPERATORS}, got {self.operators!r}")
        check(isinstance(self.modulus, int) and (self.modulus == 0 or self.modulus >= 2),
              "modulus", f"must be 0 (no modulus) or an int >= 2, got {self.modulus!r}")
        check(self.style in STYLES, "style", f"must be one of {STYLES}, got {self.style!r}")
        check(0 < self.test_fraction < 1, "test_fraction",
              f"must be in (0, 1), got {self.test_fraction}")
        check(isinstance(self.seed, int) and self.seed >= 0, "seed",
              f"must be an int >= 0, got {self.seed!r}")
        check(self.kind != "gsm8k" or bool(self.jsonl_dir), "jsonl_dir",
              "must name the directory holding train.jsonl / test.jsonl when kind='gsm8k'")

    def replace(self, **kw) -> "TaskConfig":
        return dataclasses.replace(self, **kw)


# Difficulty presets. The problem space must hold num_test / test_fraction problems or more
# (easy: 10^3 · 2^2 = 4,000 prompts, of which ~400 hash to test). Held-out accuracy after
# the `tiny` experiment's cold start (2-layer MoE, d_model 64, 300 SFT steps, sampling at
# temperature 1): easy ≈ 0.30, medium ≈ 0.11, hard ≈ 0.01 (see docs/benchmarks.md).
PRESETS = {
    "easy": TaskConfig(num_operands=3, max_digits=1, num_train=3000, num_test=300),
    "medium": TaskConfig(num_operands=4, max_digits=1),
    "hard": TaskConfig(num_operands=4, max_digits=2, modulus=100, max_prompt_len=24),
}


def preset(name: str, **overrides) -> TaskConfig:
    """A named difficulty preset, optionally with field overrides (e.g. style='terse')."""
    check(name in PRESETS, "task preset", f"unknown {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)


def make_problem(rng: np.random.Generator, cfg: TaskConfig):
    """(prompt, chain of partial results, answer) of one random problem."""
    nums = [int(n) for n in rng.integers(0, 10**cfg.max_digits, size=cfg.num_operands)]
    ops = [str(o) for o in rng.choice(list(cfg.operators), size=cfg.num_operands - 1)]
    expr = str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:]))
    prompt = expr + (f" (mod {cfg.modulus})" if cfg.modulus else "") + "="
    partials, acc = [], nums[0]
    for o, n in zip(ops, nums[1:]):
        acc = acc + n if o == "+" else acc - n
        if cfg.modulus:
            acc %= cfg.modulus
        partials.append(acc)
    return prompt, nums, ops, partials


def solution_text(nums: list[int], ops: list[str], partials: list[int], style: str) -> str:
    answer = f"#### {partials[-1]}"
    if style == "terse":
        return answer
    if style == "steps":
        accs = [nums[0]] + partials[:-1]
        return " ".join(f"{a}{o}{n}={p}" for a, o, n, p in
                        zip(accs, ops, nums[1:], partials)) + " " + answer
    # 'rewrite': step i shows partial i followed by the untouched rest of the chain.
    lines = [str(p) + "".join(f"{o}{n}" for o, n in zip(ops[i + 1:], nums[i + 2:]))
             for i, p in enumerate(partials)]
    return "=".join(lines) + " " + answer


def _in_test(prompt: str, test_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return h / 2**64 < test_fraction


def generate(cfg: TaskConfig, split: str) -> list[dict]:
    """Records {id, prompt, solution, answer} of one split, deterministic from cfg."""
    check(split in ("train", "test"), "split", f"must be 'train' or 'test', got {split!r}")
    want = {"train": cfg.num_train, "test": cfg.num_test}[split]
    rng = np.random.default_rng([cfg.seed, cfg.num_operands, cfg.max_digits, cfg.modulus,
                                 len(cfg.operators)])
    width = len(str(max(want - 1, 0)))
    space = 10 ** (cfg.max_digits * cfg.num_operands) * len(cfg.operators) ** (
        cfg.num_operands - 1)
    share = cfg.test_fraction if split == "test" else 1 - cfg.test_fraction
    if want > space * share:
        raise ValueError(f"task: cannot find {want} distinct {split} problems: only about "
                         f"{int(space * share)} of the {space} prompts with num_operands="
                         f"{cfg.num_operands}, max_digits={cfg.max_digits}, operators="
                         f"{cfg.operators!r} fall in this split; lower num_{split} or raise "
                         "the difficulty")
    out, seen, tries = [], set(), 0
    budget = int(20 * want / share) + 10_000
    while len(out) < want:
        tries += 1
        if tries > budget:
            raise ValueError(f"task: cannot find {want} distinct {split} problems with "
                             f"num_operands={cfg.num_operands}, max_digits={cfg.max_digits}, "
                             f"operators={cfg.operators!r} in {budget} draws; lower "
                             "num_train/num_test or raise the difficulty")
        prompt, nums, ops, partials = make_problem(rng, cfg)
        if prompt in seen or _in_test(prompt, cfg.test_fraction) != (split == "test"):
            continue
        seen.add(prompt)
        out.append({"id": f"{split}-{len(out):0{width}d}", "prompt": prompt,
                    "solution": solution_text(nums, ops, partials, cfg.style),
                    "answer": str(partials[-1])})
    return out


def config_name(task: TaskConfig) -> str:
    """A builder-config name that changes whenever the generated data would."""
    mod = f"_m{task.modulus}" if task.modulus else ""
    ops = "" if task.operators == "+-" else "_plus"
    return (f"ops{task.num_operands}_d{task.max_digits}{ops}{mod}_{task.style}_s{task.seed}"
            f"_n{task.num_train}-{task.num_test}_f{task.test_fraction}")


class ArithmeticConfig(tfds.core.BuilderConfig):
    def __init__(self, task: TaskConfig, name: str | None = None):
        super().__init__(name=name or config_name(task), version="1.0.0",
                         description=f"synthetic arithmetic: {task}")
        self.task = task


class Arithmetic(tfds.core.GeneratorBasedBuilder):
    """TFDS builder of the synthetic task; records: id, prompt, solution, answer.

    The named configs are `PRESETS`; any other `TaskConfig` is passed as
    `config=ArithmeticConfig(task)` (which is what `load_split` does).
    """

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, file_format: str = "array_record", **kwargs):
        # tfds defaults to tfrecord, whose writer needs TensorFlow; array_record does not,
        # so `tfds.data_source(...)` and `tfds.builder(...)` also work without it.
        super().__init__(file_format=file_format, **kwargs)
    BUILDER_CONFIGS = [ArithmeticConfig(t, name=n) for n, t in PRESETS.items()]

    def _info(self):
        text = tfds.features.Text()
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({f: text for f in FIELDS}))

    def _split_generators(self, dl_manager):
        return {s: self._generate_examples(s) for s in ("train", "test")}

    def _generate_examples(self, split):
        for rec in generate(self.builder_config.task, split):
            yield rec["id"], rec


def read_source(source) -> list[dict]:
    """All records of a TFDS data source as {field: str}, sorted by id."""
    raw = source.__getitems__(list(range(len(source)))) if len(source) else []
    recs = [{k: v.decode() if isinstance(v, bytes) else str(v) for k, v in r.items()}
            for r in raw]
    return sorted(recs, key=lambda r: r["id"])


def load_split(task: TaskConfig | str, split: str, data_dir: str) -> list[dict]:
    """Build (once) and read a split through the array_record data source.

    `task` is a TaskConfig or a preset name. Records come back sorted by id, each a dict
    of str: id, prompt, solution, answer. kind='gsm8k' reads the JSONL builder instead.
    """
    task = preset(task) if isinstance(task, str) else task
    check(split in ("train", "test"), "split", f"must be 'train' or 'test', got {split!r}")
    if task.kind == "gsm8k":
        from stablerl_jax.data.gsm8k import load_jsonl_split
        return load_jsonl_split(task, split, data_dir)
    os.makedirs(data_dir, exist_ok=True)
    builder = Arithmetic(config=ArithmeticConfig(task), data_dir=data_dir,
                         file_format="array_record")
    tfds.disable_progress_bar()  # the build takes seconds; its bars would drown the logs
    builder.download_and_prepare()
    return read_source(builder.as_data_source()[split])

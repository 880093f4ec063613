"""A synthetic multi-step arithmetic task a CPU-sized MoE can learn by SFT, then by RL.

A problem is a chain of single- or multi-digit integers joined by + and -, evaluated left
to right. The worked solution writes each partial result, then the final answer line:

    prompt:    "7+5-9+2="
    solution:  "7+5=12 12-9=3 3+2=5 #### 5"        (style 'steps')
               "#### 5"                             (style 'terse')

Difficulty knobs: `num_operands` (steps = operands − 1) and `max_digits`. Problems are a
deterministic function of (seed, index); a problem goes to the test split iff a stable
hash of its prompt falls in the test bucket, so the splits never share a prompt.

The TFDS builder writes array_record files and is read with `as_data_source()`, which
needs no TensorFlow.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np
import tensorflow_datasets as tfds

from stablerl_jax.config import check, check_positive_int

STYLES = ("steps", "terse")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The RL task: data, tokenizer and prompt/solution lengths.

    kind: 'arithmetic' (this module) or 'gsm8k' (a local JSONL dir, see gsm8k.py).
    test_fraction: share of the problem space hashed into the test split.
    vocab_size: SentencePiece vocabulary size (the model's vocab_size must equal it).
    max_prompt_len / max_solution_len: token budgets (longer records are an error).
    jsonl_dir: manual directory with train.jsonl / test.jsonl for kind='gsm8k'.
    """

    kind: str = "arithmetic"
    num_operands: int = 4
    max_digits: int = 1
    style: str = "steps"
    num_train: int = 4000
    num_test: int = 400
    test_fraction: float = 0.1
    seed: int = 0
    vocab_size: int = 64
    max_prompt_len: int = 16
    max_solution_len: int = 40
    jsonl_dir: str = ""

    def __post_init__(self):
        check(self.kind in ("arithmetic", "gsm8k"), "kind",
              f"must be 'arithmetic' or 'gsm8k', got {self.kind!r}")
        check_positive_int(self, "num_operands", "max_digits", "num_train", "num_test",
                           "vocab_size", "max_prompt_len", "max_solution_len")
        check(self.num_operands >= 2, "num_operands", f"must be >= 2, got {self.num_operands}")
        check(self.style in STYLES, "style", f"must be one of {STYLES}, got {self.style!r}")
        check(0 < self.test_fraction < 1, "test_fraction",
              f"must be in (0, 1), got {self.test_fraction}")
        check(self.kind != "gsm8k" or bool(self.jsonl_dir), "jsonl_dir",
              "must name the directory holding train.jsonl / test.jsonl when kind='gsm8k'")

    def replace(self, **kw) -> "TaskConfig":
        return dataclasses.replace(self, **kw)


def make_problem(rng: np.random.Generator, num_operands: int, max_digits: int):
    hi = 10**max_digits
    nums = rng.integers(0, hi, size=num_operands)
    ops = rng.choice(["+", "-"], size=num_operands - 1)
    prompt = str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:])) + "="
    steps, acc = [], int(nums[0])
    for o, n in zip(ops, nums[1:]):
        new = acc + int(n) if o == "+" else acc - int(n)
        steps.append(f"{acc}{o}{n}={new}")
        acc = new
    return prompt, steps, str(acc)


def solution_text(steps: list[str], answer: str, style: str) -> str:
    return (" ".join(steps) + " " if style == "steps" else "") + f"#### {answer}"


def _in_test(prompt: str, test_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return h / 2**64 < test_fraction


def generate(cfg: TaskConfig, split: str) -> list[dict]:
    """Records {id, prompt, solution, answer} of one split, deterministic from cfg."""
    want = {"train": cfg.num_train, "test": cfg.num_test}[split]
    rng = np.random.default_rng([cfg.seed, cfg.num_operands, cfg.max_digits])
    out, seen, tries = [], set(), 0
    while len(out) < want:
        tries += 1
        if tries > 50 * (cfg.num_train + cfg.num_test) + 10_000:
            raise ValueError(f"task: cannot find {want} distinct {split} problems with "
                             f"num_operands={cfg.num_operands}, max_digits={cfg.max_digits}; "
                             "lower num_train/num_test or raise the difficulty")
        prompt, steps, answer = make_problem(rng, cfg.num_operands, cfg.max_digits)
        if prompt in seen or _in_test(prompt, cfg.test_fraction) != (split == "test"):
            continue
        seen.add(prompt)
        out.append({"id": f"{split}-{len(out)}", "prompt": prompt,
                    "solution": solution_text(steps, answer, cfg.style), "answer": answer})
    return out


class ArithmeticConfig(tfds.core.BuilderConfig):
    def __init__(self, task: TaskConfig):
        name = (f"ops{task.num_operands}_d{task.max_digits}_{task.style}_s{task.seed}"
                f"_n{task.num_train}-{task.num_test}_f{task.test_fraction}")
        super().__init__(name=name, version="1.0.0", description="synthetic arithmetic")
        self.task = task


class Arithmetic(tfds.core.GeneratorBasedBuilder):
    """TFDS builder of the synthetic task; records: id, prompt, solution, answer."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        text = tfds.features.Text()
        return self.dataset_info_from_configs(features=tfds.features.FeaturesDict(
            {"id": text, "prompt": text, "solution": text, "answer": text}))

    def _split_generators(self, dl_manager):
        return {s: self._generate_examples(s) for s in ("train", "test")}

    def _generate_examples(self, split):
        for rec in generate(self.builder_config.task, split):
            yield rec["id"], rec


def _decode(rec: dict) -> dict:
    return {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in rec.items()}


def load_split(task: TaskConfig, split: str, data_dir: str) -> list[dict]:
    """Build (once) and read a split through the array_record data source."""
    if task.kind == "gsm8k":
        from stablerl_jax.data.gsm8k import load_jsonl_split
        return load_jsonl_split(task, split, data_dir)
    os.makedirs(data_dir, exist_ok=True)
    builder = Arithmetic(config=ArithmeticConfig(task), data_dir=data_dir,
                         file_format="array_record")
    tfds.disable_progress_bar()  # the build takes seconds; its bars would drown the logs
    builder.download_and_prepare()
    source = builder.as_data_source()[split]
    return [_decode(source[i]) for i in range(len(source))]

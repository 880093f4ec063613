"""A synthetic multi-step arithmetic task a CPU-sized MoE can learn by SFT, then by RL.

A problem is a chain of integers joined by + and -, evaluated left to right (optionally
mod m after every step); its solution, in one of three styles, ends "#### N":

    prompt:    "7+5-9+2="
    'steps':   "7+5=12 12-9=3 3+2=5 #### 5"      each step restates its two operands
    'rewrite': "12-9+2=3+2=5 #### 5"            each step rewrites the rest of the chain
    'terse':   "#### 5"                         the answer alone (no worked solution)
    with modulus=100:  prompt "37+85-12 (mod 100)="  ->  'steps': "37+85=22 22-12=10 #### 10"

Knobs (config.TaskConfig): `num_operands` (steps = operands − 1), `max_digits`,
`operators` ('+-' or '+'), `modulus` (0 = plain integers); `presets.TASKS` names four
settings ('long' is a long one). Long problems (`max_steps` > 0) apply num_operands − 1
operations to a start value cyclically, for a drawn number of steps in [min_steps,
max_steps] stated in the prompt; the 'steps' solution numbers steps by a countdown, each
reading only the one before and the one a cycle back (~9 tokens a step, 200–400 at 24–40):

    prompt:    "7+8-3 x4 (mod 10)="
    'steps':   "4:7+8=5 3:5-3=2 2:2+8=0 1:0-3=7 #### 7"
    'terse':   "#### 7"

Problems are a deterministic function of the config (seed included); a problem is in the
test split iff a stable hash of its prompt falls below `test_fraction`, so train and test
never share a prompt, whatever the sizes or seed. Ids "<split>-<index>" are zero-padded so
sorting restores generation order. Splits are array_record, read with `as_data_source()` /
`tfds.data_source` (`data.task.load_split`): neither needs TensorFlow.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import tensorflow_datasets as tfds

from stablerl_jax.config import STYLES, TaskConfig, check
from stablerl_jax.presets import TASKS

FIELDS = ("id", "prompt", "solution", "answer")


def partial_results(nums: list[int], ops: list[str], modulus: int) -> list[int]:
    """The chain evaluated left to right (mod `modulus` after every step if nonzero)."""
    partials, acc = [], nums[0]
    for o, n in zip(ops, nums[1:]):
        acc = acc + n if o == "+" else acc - n
        if modulus:
            acc %= modulus
        partials.append(acc)
    return partials


def make_problem(rng: np.random.Generator, cfg: TaskConfig):
    """(prompt, operands, operators, partial results) of one random problem."""
    nums = [int(n) for n in rng.integers(0, 10**cfg.max_digits, size=cfg.num_operands)]
    ops = [str(o) for o in rng.choice(list(cfg.operators), size=cfg.num_operands - 1)]
    expr = str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:]))
    prompt = expr + (f" (mod {cfg.modulus})" if cfg.modulus else "") + "="
    return prompt, nums, ops, partial_results(nums, ops, cfg.modulus)


def styles(cfg: TaskConfig) -> tuple[str, ...]:
    """The solution styles `cfg`'s problems have ('rewrite' has no long form)."""
    return tuple(s for s in STYLES if not (cfg.max_steps and s == "rewrite"))


def make_cycle_problem(rng: np.random.Generator, cfg: TaskConfig):
    """(prompt, operands, operators, partial results) of one long problem: its cycle
    unrolled over the drawn steps, so `solution_text` works it as a chain."""
    start = int(rng.integers(0, 10**cfg.max_digits))
    cycle_nums = [int(n) for n in rng.integers(0, 10**cfg.max_digits, size=cfg.num_operands - 1)]
    cycle_ops = [str(o) for o in rng.choice(list(cfg.operators), size=cfg.num_operands - 1)]
    steps = int(rng.integers(cfg.min_steps, cfg.max_steps + 1))
    cycle = "".join(f"{o}{n}" for o, n in zip(cycle_ops, cycle_nums))
    prompt = f"{start}{cycle} x{steps}" + (f" (mod {cfg.modulus})" if cfg.modulus else "") + "="
    ops = [cycle_ops[i % len(cycle_ops)] for i in range(steps)]
    nums = [start] + [cycle_nums[i % len(cycle_nums)] for i in range(steps)]
    return prompt, nums, ops, partial_results(nums, ops, cfg.modulus)


def solution_text(nums: list[int], ops: list[str], partials: list[int], style: str,
                  countdown: bool = False) -> str:
    """The worked solution; `countdown` numbers each step by the steps left (long problems)."""
    answer = f"#### {partials[-1]}"
    if style == "terse":
        return answer
    if style == "steps":
        accs = [nums[0]] + partials[:-1]
        left = range(len(partials), 0, -1)
        return " ".join((f"{k}:" if countdown else "") + f"{a}{o}{n}={p}" for k, a, o, n, p
                        in zip(left, accs, ops, nums[1:], partials)) + " " + answer
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
                                 len(cfg.operators)] + ([cfg.min_steps, cfg.max_steps]
                                                        if cfg.max_steps else []))
    width = len(str(max(want - 1, 0)))
    space = 10 ** (cfg.max_digits * cfg.num_operands) * len(cfg.operators) ** (
        cfg.num_operands - 1) * (cfg.max_steps - cfg.min_steps + 1 if cfg.max_steps else 1)
    make = make_cycle_problem if cfg.max_steps else make_problem
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
        prompt, nums, ops, partials = make(rng, cfg)
        if prompt in seen or _in_test(prompt, cfg.test_fraction) != (split == "test"):
            continue
        seen.add(prompt)
        out.append({"id": f"{split}-{len(out):0{width}d}", "prompt": prompt,
                    "solution": solution_text(nums, ops, partials, cfg.style,
                                              countdown=bool(cfg.max_steps)),
                    "answer": str(partials[-1])})
    return out


def config_name(task: TaskConfig) -> str:
    """A builder-config name that changes whenever the generated data would."""
    mod = f"_m{task.modulus}" if task.modulus else ""
    ops = "" if task.operators == "+-" else "_plus"
    cyc = f"_x{task.min_steps}-{task.max_steps}" if task.max_steps else ""
    return (f"ops{task.num_operands}_d{task.max_digits}{ops}{mod}{cyc}_{task.style}_s{task.seed}"
            f"_n{task.num_train}-{task.num_test}_f{task.test_fraction}")


class ArithmeticConfig(tfds.core.BuilderConfig):
    def __init__(self, task: TaskConfig, name: str | None = None):
        super().__init__(name=name or config_name(task), version="1.0.0",
                         description=f"synthetic arithmetic: {task}")
        self.task = task


class Arithmetic(tfds.core.GeneratorBasedBuilder):
    """TFDS builder of the synthetic task (records: id, prompt, solution, answer); named
    configs `presets.TASKS`, any `TaskConfig` as `config=ArithmeticConfig(task)` (`builder`)."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, file_format: str = "array_record", **kwargs):
        # tfds defaults to tfrecord, whose writer needs TensorFlow; array_record does not,
        # so `tfds.data_source(...)` and `tfds.builder(...)` also work without it.
        super().__init__(file_format=file_format, **kwargs)
    BUILDER_CONFIGS = [ArithmeticConfig(t, name=n) for n, t in TASKS.items()]

    def _info(self):
        text = tfds.features.Text()
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({f: text for f in FIELDS}))

    def _split_generators(self, dl_manager):
        return {s: self._generate_examples(s) for s in ("train", "test")}

    def _generate_examples(self, split):
        for rec in generate(self.builder_config.task, split):
            yield rec["id"], rec


def builder(task: TaskConfig, data_dir: str) -> Arithmetic:
    """The prepared builder of `task` (its array_record files built on first use)."""
    os.makedirs(data_dir, exist_ok=True)
    b = Arithmetic(config=ArithmeticConfig(task), data_dir=data_dir, file_format="array_record")
    tfds.disable_progress_bar()  # the build takes seconds; its bars would drown the logs
    b.download_and_prepare()
    return b

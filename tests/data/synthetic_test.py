"""The synthetic task and its TFDS builder."""
import re
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from stablerl_jax import presets
from stablerl_jax.config import ConfigError, TaskConfig
from stablerl_jax.data import synthetic
from stablerl_jax.data.task import read_source
from stablerl_jax.data.rewards import exact_match_reward
from stablerl_jax.data.tokenizer import SentencePieceTokenizer

SMALL = TaskConfig(num_train=200, num_test=40)


def _value(prompt: str, modulus: int) -> int:
    expr = prompt.split(" ")[0].rstrip("=")
    if " x" in prompt:  # a long problem: the cycle after the start, applied N times
        start, cycle = re.match(r"(\d+)(.*)", expr).groups()
        steps = int(re.search(r" x(\d+)", prompt).group(1))
        terms = re.findall(r"[+-]\d+", cycle)
        expr = start + "".join(terms[i % len(terms)] for i in range(steps))
    v = eval(expr)  # left-to-right +/-: Python agrees
    return v % modulus if modulus else v


def _steps(task: TaskConfig, prompt: str) -> int:
    return int(re.search(r" x(\d+)", prompt).group(1)) if task.max_steps else \
        task.num_operands - 1


def test_generation_is_deterministic_and_splits_disjoint():
    train = synthetic.generate(SMALL, "train")
    assert train == synthetic.generate(SMALL, "train")
    test = synthetic.generate(SMALL, "test")
    assert len(train) == 200 and len(test) == 40
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert synthetic.generate(SMALL.replace(seed=1), "train") != train
    ids = [r["id"] for r in train]
    assert ids == sorted(ids) and len(set(ids)) == 200 and ids[0] == "train-000"


@pytest.mark.parametrize("name", sorted(presets.TASKS))
def test_presets_disjoint_and_correct(name):
    task = presets.task(name, num_train=300, num_test=60)
    train, test = synthetic.generate(task, "train"), synthetic.generate(task, "test")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for rec in train + test:
        assert rec["answer"] == str(_value(rec["prompt"], task.modulus))
        assert exact_match_reward(rec["solution"], rec["answer"]) == 1.0
        assert rec["solution"].count("=") == _steps(task, rec["prompt"])
        if task.modulus:
            assert 0 <= int(rec["answer"]) < task.modulus
            assert rec["prompt"].endswith(f" (mod {task.modulus})=")


def test_the_split_of_a_prompt_does_not_depend_on_sizes_or_style():
    a = synthetic.generate(SMALL, "test")
    b = synthetic.generate(SMALL.replace(num_train=20, num_test=80, style="terse"), "test")
    bigger = {r["prompt"] for r in synthetic.generate(SMALL.replace(num_train=2000), "train")}
    assert not bigger & {r["prompt"] for r in a + b}
    # Styles change only the solution: same problems, same order.
    assert [r["prompt"] for r in a] == [r["prompt"] for r in b[:40]]


def test_solution_styles_by_hand():
    nums, ops, partials = [7, 5, 9, 2], ["+", "-", "+"], [12, 3, 5]
    assert synthetic.solution_text(nums, ops, partials, "steps") == \
        "7+5=12 12-9=3 3+2=5 #### 5"
    assert synthetic.solution_text(nums, ops, partials, "rewrite") == "12-9+2=3+2=5 #### 5"
    assert synthetic.solution_text(nums, ops, partials, "terse") == "#### 5"
    # mod 100: 37+85 = 122 -> 22; 22-30 = -8 -> 92.
    assert synthetic.solution_text([37, 85, 30], ["+", "-"], [22, 92], "steps") == \
        "37+85=22 22-30=92 #### 92"


def test_long_problems_by_hand():
    # 7, then +8, -3, +8, -3 (mod 10): 5, 2, 0, 7.
    nums, ops, partials = [7, 8, 3, 8, 3], ["+", "-", "+", "-"], [5, 2, 0, 7]
    assert synthetic.solution_text(nums, ops, partials, "steps", countdown=True) == \
        "4:7+8=5 3:5-3=2 2:2+8=0 1:0-3=7 #### 7"
    task = presets.task("long", num_train=100, num_test=20)
    for rec in synthetic.generate(task, "train"):
        steps = _steps(task, rec["prompt"])
        assert task.min_steps <= steps <= task.max_steps
        assert rec["solution"].startswith(f"{steps}:") and " 1:" in rec["solution"]
        assert re.fullmatch(r"\d[+-]\d[+-]\d x\d+ \(mod 10\)=", rec["prompt"])


def test_long_task_responses_are_ten_times_the_easy_ones():
    def mean_tokens(name):
        recs = synthetic.generate(presets.task(name, num_train=300), "train")
        tok = SentencePieceTokenizer.train([r["prompt"] + " " + r["solution"] for r in recs],
                                           presets.tiny().model.vocab_size)
        return np.mean([len(tok.encode(r["solution"])) for r in recs])
    long_, easy = mean_tokens("long"), mean_tokens("easy")
    assert 200 <= long_ <= 400 and long_ >= 10 * easy, (long_, easy)


def test_plus_only_operators():
    recs = synthetic.generate(SMALL.replace(operators="+"), "train")
    assert all("-" not in r["prompt"] and int(r["answer"]) >= 0 for r in recs)


@pytest.mark.parametrize("name", sorted(presets.TASKS))
def test_presets_fit_their_token_budgets(name):
    task = presets.TASKS[name]
    recs = synthetic.generate(task.replace(num_train=1000), "train")
    for style in synthetic.styles(task):
        recs += synthetic.generate(task.replace(num_train=200, style=style), "train")
    tok = SentencePieceTokenizer.train([r["prompt"] + " " + r["solution"] for r in recs],
                                       presets.tiny().model.vocab_size)
    # +1: prompt batches prepend BOS.
    assert max(len(tok.encode(r["prompt"])) + 1 for r in recs) <= task.max_prompt_len
    assert max(len(tok.encode(r["solution"])) for r in recs) <= task.max_solution_len


def test_named_builder_configs_are_the_task_presets(tmp_path):
    assert [c.name for c in synthetic.Arithmetic.BUILDER_CONFIGS] == list(presets.TASKS)
    want = synthetic.generate(presets.TASKS["easy"], "test")
    # The registered builder, by name, defaults to array_record: no TensorFlow needed.
    source = tfds.data_source("arithmetic/easy", split="test", data_dir=str(tmp_path / "a"))
    assert read_source(source) == want
    assert "tensorflow" not in sys.modules
    with pytest.raises(ConfigError, match="^task preset:"):
        presets.task("impossible")


@pytest.mark.parametrize("kw,field", [({"num_operands": 1}, "num_operands"),
                                      ({"style": "verbose"}, "style"),
                                      ({"test_fraction": 1.0}, "test_fraction"),
                                      ({"kind": "gsm8k"}, "jsonl_dir"),
                                      ({"kind": "mmlu"}, "kind"),
                                      ({"operators": "*"}, "operators"),
                                      ({"modulus": 1}, "modulus"),
                                      ({"max_digits": 9}, "max_digits"),
                                      ({"seed": -1}, "seed"),
                                      ({"max_steps": -1}, "max_steps"),
                                      ({"min_steps": 3}, "min_steps"),
                                      ({"min_steps": 9, "max_steps": 4}, "min_steps"),
                                      ({"min_steps": 2, "max_steps": 4, "style": "rewrite"},
                                       "style")])
def test_config_errors(kw, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        TaskConfig(**kw)


def test_too_many_problems_is_a_clear_error():
    # 2 one-digit operands: only 200 distinct prompts exist (caught before sampling).
    with pytest.raises(ValueError, match="cannot find 500 distinct train problems: only"):
        synthetic.generate(TaskConfig(num_operands=2, num_train=500), "train")
    with pytest.raises(ConfigError, match="^split:"):
        synthetic.generate(SMALL, "validation")


def test_answers_are_spread_out():
    # A task whose answers concentrate on a few values would be learnable by guessing.
    answers = np.array([int(r["answer"]) for r in synthetic.generate(SMALL, "train")])
    assert np.bincount(answers - answers.min()).max() / len(answers) < 0.15

"""The synthetic task and its TFDS builder."""
import sys

import pytest

from stablerl_jax.config import ConfigError
from stablerl_jax.data import synthetic
from stablerl_jax.data.rewards import exact_match_reward

SMALL = synthetic.TaskConfig(num_train=200, num_test=40)


def test_generation_is_deterministic_and_splits_disjoint():
    train = synthetic.generate(SMALL, "train")
    assert train == synthetic.generate(SMALL, "train")
    test = synthetic.generate(SMALL, "test")
    assert len(train) == 200 and len(test) == 40
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert synthetic.generate(SMALL.replace(seed=1), "train") != train


def test_worked_solutions_are_correct():
    for rec in synthetic.generate(SMALL, "train")[:50]:
        assert rec["answer"] == str(eval(rec["prompt"][:-1]))  # left-to-right +/-: Python agrees
        assert exact_match_reward(rec["solution"], rec["answer"]) == 1.0
        assert rec["solution"].count("=") == SMALL.num_operands - 1
    terse = synthetic.generate(SMALL.replace(style="terse"), "train")[0]
    assert terse["solution"].startswith("####")


def test_tfds_builder_reads_through_data_source_without_tensorflow(tmp_path):
    a = synthetic.load_split(SMALL, "train", str(tmp_path))
    b = synthetic.load_split(SMALL, "train", str(tmp_path))  # reuses the built files
    assert sorted(a, key=lambda r: r["id"]) == sorted(b, key=lambda r: r["id"])
    assert sorted(r["prompt"] for r in a) == sorted(r["prompt"] for r in
                                                    synthetic.generate(SMALL, "train"))
    assert set(a[0]) == {"id", "prompt", "solution", "answer"}
    assert list(tmp_path.glob("arithmetic/*/1.0.0/*.array_record*"))
    assert "tensorflow" not in sys.modules


@pytest.mark.parametrize("kw,field", [({"num_operands": 1}, "num_operands"),
                                      ({"style": "verbose"}, "style"),
                                      ({"test_fraction": 1.0}, "test_fraction"),
                                      ({"kind": "gsm8k"}, "jsonl_dir"),
                                      ({"kind": "mmlu"}, "kind")])
def test_config_errors(kw, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        synthetic.TaskConfig(**kw)


def test_too_many_problems_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot find"):
        synthetic.generate(synthetic.TaskConfig(num_operands=2, num_train=500), "train")

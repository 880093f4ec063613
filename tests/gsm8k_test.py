"""GSM8K-style JSONL from a manual directory written by the test."""
import json

import pytest

from stablerl_jax.data import gsm8k
from stablerl_jax.data.synthetic import TaskConfig, load_split


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


def test_builder_reads_jsonl_splits(tmp_path):
    manual = tmp_path / "manual"
    manual.mkdir()
    _write(manual / "train.jsonl", [{"question": "2 apples + 3 apples?", "answer": "2+3=5\n#### 5"},
                                    {"question": "Half of 1,000?", "answer": "#### 500"}])
    _write(manual / "test.jsonl", [{"question": "1+1?", "answer": "#### 2"}])
    task = TaskConfig(kind="gsm8k", jsonl_dir=str(manual))
    train = load_split(task, "train", str(tmp_path / "data"))
    assert sorted(r["answer"] for r in train) == ["5", "500"]
    assert {r["prompt"] for r in train} == {"2 apples + 3 apples?", "Half of 1,000?"}
    assert load_split(task, "test", str(tmp_path / "data"))[0]["answer"] == "2"


def test_malformed_line_names_line_number_or_is_counted(tmp_path):
    f = tmp_path / "train.jsonl"
    _write(f, [{"question": "q", "answer": "#### 1"}, "{not json", {"question": "q2"},
               {"question": "q3", "answer": "no final line"}, {"question": "q4", "answer": "#### 4"}])
    with pytest.raises(gsm8k.MalformedLineError, match=r"train.jsonl:2"):
        gsm8k.parse_jsonl(str(f))
    records, skipped = gsm8k.parse_jsonl(str(f), skip_malformed=True)
    assert [r["answer"] for r in records] == ["1", "4"] and skipped == 3

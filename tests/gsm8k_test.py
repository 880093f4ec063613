"""GSM8K-style JSONL from a manual directory written by the test."""
import json
import sys

import pytest

from stablerl_jax.data import gsm8k
from stablerl_jax.config import TaskConfig
from stablerl_jax.data.task import load_split


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


def _manual(tmp_path, train_rows):
    manual = tmp_path / "manual"
    manual.mkdir(exist_ok=True)
    _write(manual / "train.jsonl", train_rows)
    _write(manual / "test.jsonl", [{"question": "1+1?", "answer": "#### 2"}])
    return manual


def test_builder_reads_jsonl_splits(tmp_path):
    manual = _manual(tmp_path, [
        {"question": "2 apples + 3 apples?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
        {"question": "Half of 1,000?", "answer": "#### 500"}])
    task = TaskConfig(kind="gsm8k", jsonl_dir=str(manual))
    train = load_split(task, "train", str(tmp_path / "data"))
    assert train == [
        {"id": "train-0000001", "prompt": "2 apples + 3 apples?", "solution": "2+3=5\n#### 5",
         "answer": "5"},
        {"id": "train-0000002", "prompt": "Half of 1,000?", "solution": "#### 500",
         "answer": "500"}]
    assert load_split(task, "test", str(tmp_path / "data"))[0]["answer"] == "2"
    assert list((tmp_path / "data").glob("jsonl_math/*/1.0.0/*.array_record*"))
    assert "tensorflow" not in sys.modules


def test_editing_the_files_rebuilds(tmp_path):
    manual = _manual(tmp_path, [{"question": "a", "answer": "#### 1"}])
    task = TaskConfig(kind="gsm8k", jsonl_dir=str(manual))
    assert [r["answer"] for r in load_split(task, "train", str(tmp_path / "d"))] == ["1"]
    _manual(tmp_path, [{"question": "a", "answer": "#### 7"}])
    assert [r["answer"] for r in load_split(task, "train", str(tmp_path / "d"))] == ["7"]


def test_malformed_line_names_line_number_or_is_counted(tmp_path):
    f = tmp_path / "train.jsonl"
    _write(f, [{"question": "q", "answer": "#### 1"}, "{not json", {"question": "q2"},
               {"question": "q3", "answer": "no final line"}, "[1, 2]",
               {"question": "q4", "answer": "#### 4"}, {"question": 5, "answer": "#### 5"}])
    with pytest.raises(gsm8k.MalformedLineError, match=r"train.jsonl:2"):
        gsm8k.parse_jsonl(str(f))
    records, skipped = gsm8k.parse_jsonl(str(f), skip_malformed=True)
    assert [r["answer"] for r in records] == ["1", "4"] and skipped == 5
    assert [r["id"] for r in records] == ["train-0000001", "train-0000006"]


def test_builder_fails_on_malformed_or_counts_when_skipping(tmp_path):
    manual = _manual(tmp_path, [{"question": "q", "answer": "#### 1"}, "oops",
                                {"question": "q2"}])
    with pytest.raises(gsm8k.MalformedLineError, match=r"train.jsonl:2"):
        load_split(TaskConfig(kind="gsm8k", jsonl_dir=str(manual)), "train",
                   str(tmp_path / "d"))
    task = TaskConfig(kind="gsm8k", jsonl_dir=str(manual), skip_malformed=True)
    assert len(load_split(task, "train", str(tmp_path / "d"))) == 1
    assert gsm8k.skipped_counts(str(manual), str(tmp_path / "d")) == {"train": 2, "test": 0}


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.jsonl: no such file"):
        gsm8k.parse_jsonl(str(tmp_path / "train.jsonl"))

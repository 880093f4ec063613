"""Math JSONL from a manual directory written by the test: GSM8K, MATH, DAPO-Math, AIME,
prompt/answer and custom layouts, format detection, answers normalized at load."""
import json
import sys

import pytest

from stablerl_jax.data import jsonl
from stablerl_jax.config import TaskConfig
from stablerl_jax.data.formats import Mapping
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
    task = TaskConfig(kind="jsonl", jsonl_dir=str(manual))
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
    with pytest.raises(jsonl.MalformedLineError, match=r"train.jsonl:2"):
        jsonl.parse_jsonl(str(f))
    records, skipped, fmt = jsonl.parse_jsonl(str(f), skip_malformed=True)
    assert [r["answer"] for r in records] == ["1", "4"] and skipped == 5 and fmt == "gsm8k"
    assert [r["id"] for r in records] == ["train-0000001", "train-0000006"]


def test_builder_fails_on_malformed_or_counts_when_skipping(tmp_path):
    manual = _manual(tmp_path, [{"question": "q", "answer": "#### 1"}, "oops",
                                {"question": "q2"}])
    with pytest.raises(jsonl.MalformedLineError, match=r"train.jsonl:2"):
        load_split(TaskConfig(kind="gsm8k", jsonl_dir=str(manual)), "train",
                   str(tmp_path / "d"))
    task = TaskConfig(kind="gsm8k", jsonl_dir=str(manual), skip_malformed=True)
    assert len(load_split(task, "train", str(tmp_path / "d"))) == 1
    assert jsonl.skipped_counts(str(manual), str(tmp_path / "d")) == {"train": 2, "test": 0}


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.jsonl: no such file"):
        jsonl.parse_jsonl(str(tmp_path / "train.jsonl"))


# (format, one record as the public data sets write it, question, solution, answer)
LAYOUTS = [
    ("gsm8k", {"question": "Tom has 48 apples and gives half away. How many are left?",
               "answer": "He gives 48/2=<<48/2=24>>24.\n#### 24"},
     "Tom has 48 apples and gives half away. How many are left?", "He gives 48/2=24.\n#### 24",
     "24"),
    ("math", {"problem": "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "level": "Level 1",
              "type": "Algebra", "solution": "We get $\\boxed{\\frac{3}{4}}$."},
     "Compute $\\frac{1}{2}+\\frac{1}{4}$.", "We get $\\boxed{\\frac{3}{4}}$.", "\\frac{3}{4}"),
    ("math", {"problem": "What is $2^{10}$?", "solution": "$2^{10} = \\boxed{1024}$",
              "answer": "1024", "subject": "Algebra", "unique_id": "test/algebra/1.json"},
     "What is $2^{10}$?", "$2^{10} = \\boxed{1024}$", "1024"),
    ("dapo", {"data_source": "math_dapo", "ability": "MATH",
              "prompt": [{"role": "user", "content": "Solve: x + 1 = 3. Answer: $Answer"}],
              "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
              "extra_info": {"index": "a1"}},
     "Solve: x + 1 = 3. Answer: $Answer", "", "2"),
    ("aime", {"id": 60, "problem": "Find the remainder when 2024 is divided by 1000.",
              "answer": 24, "url": "https://example.org/aime"},
     "Find the remainder when 2024 is divided by 1000.", "", "24"),
    ("aime", {"question": "How many positive divisors does 12 have?", "answer": "6"},
     "How many positive divisors does 12 have?", "", "6"),
    ("prompt_answer", {"prompt": "What is 3 * 4?", "answer": "\\boxed{12}"},
     "What is 3 * 4?", "", "12"),
]


@pytest.mark.parametrize("fmt, obj, question, solution, answer", LAYOUTS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(LAYOUTS)])
def test_each_layout_is_detected_and_normalized(tmp_path, capsys, fmt, obj, question,
                                                solution, answer):
    f = tmp_path / "test.jsonl"
    _write(f, [obj, obj])
    parsed = jsonl.parse_jsonl(str(f))
    assert parsed.format == fmt and parsed.skipped == 0
    assert parsed.records[1] == {"id": "test-0000002", "prompt": question,
                                 "solution": solution, "answer": answer}
    # Naming the format reads the same; naming another one is a line error.
    assert jsonl.parse_jsonl(str(f), mapping=Mapping(fmt)).records == parsed.records
    other = "gsm8k" if fmt != "gsm8k" else "math"
    with pytest.raises(jsonl.MalformedLineError, match=rf"test.jsonl:1: .*format '{other}'"):
        jsonl.parse_jsonl(str(f), mapping=Mapping(other))


def test_custom_fields_and_no_fitting_format(tmp_path):
    f = tmp_path / "train.jsonl"
    _write(f, [{"Q": "Add 2 and 2.", "A": "4", "work": "2+2=4"}])
    with pytest.raises(jsonl.MalformedLineError) as e:
        jsonl.parse_jsonl(str(f))
    msg = str(e.value)
    assert f"{f}:1" in msg and "['A', 'Q', 'work']" in msg and "task.format=custom" in msg
    parsed = jsonl.parse_jsonl(str(f), mapping=Mapping("custom", "Q", "A", "work"))
    assert parsed.records == [{"id": "train-0000001", "prompt": "Add 2 and 2.",
                               "solution": "2+2=4", "answer": "4"}]
    _write(f, [{"problem": "p", "solution": "\\boxed{1}", "question": "q",
                "answer": "#### 1"}])
    with pytest.raises(jsonl.MalformedLineError, match=r"several formats \['gsm8k', 'math'\]"):
        jsonl.parse_jsonl(str(f))


def test_a_byte_order_mark_is_accepted(tmp_path):
    f = tmp_path / "test.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps({"problem": "p", "answer": "7"}).encode()
                  + b"\n")
    assert jsonl.parse_jsonl(str(f)).records[0]["answer"] == "7"


def test_eval_only_directory_and_single_file(tmp_path):
    manual = tmp_path / "aime"
    manual.mkdir()
    _write(manual / "test.jsonl", [{"problem": "p", "answer": "204"}])
    task = TaskConfig(kind="jsonl", jsonl_dir=str(manual))
    assert [r["answer"] for r in load_split(task, "test", str(tmp_path / "d"))] == ["204"]
    with pytest.raises(FileNotFoundError, match="no train.jsonl"):
        load_split(task, "train", str(tmp_path / "d"))
    one = TaskConfig(kind="jsonl", jsonl_dir=str(manual / "test.jsonl"))
    assert [r["answer"] for r in load_split(one, "test", str(tmp_path / "e"))] == ["204"]
    assert jsonl.split_files(str(manual / "test.jsonl")) == {"test": str(manual / "test.jsonl")}
    with pytest.raises(FileNotFoundError, match="no train.jsonl or test.jsonl"):
        jsonl.split_files(str(tmp_path))


def test_the_format_is_part_of_the_fingerprint(tmp_path):
    manual = tmp_path / "m"
    manual.mkdir()
    _write(manual / "test.jsonl", [{"P": "p", "A": "\\boxed{3}", "S": "s"}])
    files = jsonl.split_files(str(manual))
    assert (jsonl.fingerprint(files, Mapping("custom", "P", "A"))
            != jsonl.fingerprint(files, Mapping("custom", "P", "A", "S")))
    task = TaskConfig(kind="jsonl", jsonl_dir=str(manual), format="custom", prompt_field="P",
                      answer_field="A", solution_field="S")
    assert load_split(task, "test", str(tmp_path / "d"))[0]["solution"] == "s"


def test_json_nested_beyond_the_recursion_limit_is_a_malformed_line():
    # json.loads raises RecursionError there; a line that deep is no record.
    with pytest.raises(ValueError, match="nested deeper than the reader follows"):
        jsonl.load_object(b"[" * 100_000 + b"]" * 100_000)
    obj = jsonl.load_object(b'{"a": ' + b"[" * 50 + b"]" * 50 + b"}")  # shallow: fine
    assert obj["a"] == json.loads(b"[" * 50 + b"]" * 50)

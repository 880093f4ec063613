"""Parquet data (data/parquet.py) in the layouts the public sets ship: DAPO-Math-17k and
the verl-converted AIME in verl's layout (chat `prompt`, `reward_model` struct), AIME 2024
as its Hugging Face copies have it. Every file is written here with pyarrow. A parquet
file reads into the records the same rows give as JSONL, as the task's splits, eval sets
and cold-start data; a system message in verl's prompt survives the chat template; a
missing column or a corrupt file is one error naming the file."""
import json
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_fixtures import write_jsonl, write_parquet, write_qwen_tokenizer

from stablerl_jax import presets
from stablerl_jax.config import TaskConfig
from stablerl_jax.data import jsonl, parquet, sft_data
from stablerl_jax.data.formats import Mapping
from stablerl_jax.data.hf_tokenizer import HFTokenizer
from stablerl_jax.data.task import TaskData, load_split

DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your "
               "response should be of the form Answer: $Answer (without quotes) where "
               "$Answer is the answer to the problem.\n\n{}\n\nRemember to put your answer "
               "on its own line after \"Answer:\".")
DAPO_PROBLEMS = [("In triangle $ABC$, $AB = 5$ and $BC = 12$. Find $AC^2 + 9$.", "34"),
                 ("What is the sum of the first $10$ positive integers?", "55"),
                 ("Find the remainder when $2^{10}$ is divided by $7$.", "2")]
UUIDS = ["9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079", "b426d104-244d-4831-a2c4-cd756b61700a",
         "6ff0b17f-7e5c-4ae9-b5e9-63ebecd2b9f7"]
SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
AIME = [("Find the number of ordered pairs $(x, y)$ of integers with $x + y = 3$ and "
         "$0 \\le x \\le 3$.", 4, "There are $\\boxed{4}$ pairs."),
        ("Find $6 \\cdot 7$.", 42, "$6 \\cdot 7 = \\boxed{42}$.")]


def dapo_rows(wording=DAPO_PROMPT):
    """DAPO-Math-17k as published in verl's layout (`wording`: its user message)."""
    return [{"data_source": "math_dapo",
             "prompt": [{"role": "user", "content": wording.format(problem)}],
             "ability": "MATH",
             "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": uid}}
            for (problem, answer), uid in zip(DAPO_PROBLEMS, UUIDS)]


def verl_aime_rows():
    """AIME 2024 converted to verl's layout, with a system message before the problem."""
    return [{"data_source": "aime24",
             "prompt": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": problem}],
             "ability": "MATH", "reward_model": {"ground_truth": str(answer), "style": "rule"},
             "extra_info": {"index": i, "split": "test"}}
            for i, (problem, answer, _) in enumerate(AIME)]


def hf_aime_rows():
    """AIME 2024 as Hugging Face copies have it: id, problem, solution, answer, url."""
    return [{"id": 60 + i, "problem": p, "solution": s, "answer": str(a),
             "url": "https://artofproblemsolving.com/wiki/index.php/"
                    f"2024_AIME_I_Problems/Problem_{i + 1}",
             "year": 2024} for i, (p, a, s) in enumerate(AIME)]


def _both(root, name, rows):
    """The same rows as `<root>/parquet/<name>.parquet` and `<root>/jsonl/<name>.jsonl`."""
    for fmt in ("parquet", "jsonl"):
        (root / fmt).mkdir(exist_ok=True)
    return (write_parquet(root / "parquet" / f"{name}.parquet", rows),
            write_jsonl(root / "jsonl" / f"{name}.jsonl", rows))


def test_a_parquet_directory_or_file_gives_the_records_its_jsonl_gives(tmp_path):
    _both(tmp_path, "train", dapo_rows())
    _both(tmp_path, "test", verl_aime_rows())
    splits = {}
    for fmt in ("parquet", "jsonl"):
        task = TaskConfig(kind="jsonl", jsonl_dir=str(tmp_path / fmt))
        splits[fmt] = [load_split(task, s, str(tmp_path / f"d_{fmt}"))
                       for s in ("train", "test")]
    assert splits["parquet"] == splits["jsonl"]
    train, test = splits["parquet"]
    assert train == [{"id": f"train-000000{i + 1}", "prompt": DAPO_PROMPT.format(p),
                      "solution": "", "answer": a} for i, (p, a) in enumerate(DAPO_PROBLEMS)]
    # A chat holding more than the question keeps it, system message first.
    assert [r["answer"] for r in test] == ["4", "42"] and test[1]["prompt"] == AIME[1][0]
    assert json.loads(test[1]["chat"]) == [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": AIME[1][0]}]
    # One file is the test split.
    one = {fmt: load_split(TaskConfig(kind="jsonl", jsonl_dir=str(
        tmp_path / fmt / f"test.{fmt}")), "test", str(tmp_path / f"e_{fmt}"))
        for fmt in ("parquet", "jsonl")}
    assert one["parquet"] == one["jsonl"] == test


def test_aime_2024_as_hugging_face_copies_ship_it(tmp_path):
    pq_file, jsonl_file = _both(tmp_path, "aime24", hf_aime_rows())
    parsed = jsonl.parse_jsonl(pq_file)
    assert parsed == jsonl.parse_jsonl(jsonl_file)
    assert parsed.format == "math" and [r["answer"] for r in parsed.records] == ["4", "42"]
    # The capitalized copy (ID, Problem, Solution, Answer as int64) fits no named format:
    # the error names the file, its row, its columns and the fix; custom fields read it.
    caps = write_parquet(tmp_path / "caps.parquet", [
        {"ID": f"2024-I-{i + 1}", "Problem": p, "Solution": s, "Answer": a}
        for i, (p, a, s) in enumerate(AIME)])
    with pytest.raises(jsonl.MalformedLineError) as e:
        jsonl.parse_jsonl(caps)
    msg = str(e.value)
    assert f"{caps} row 1" in msg and "['Answer', 'ID', 'Problem', 'Solution']" in msg
    assert "task.format=custom" in msg
    custom = jsonl.parse_jsonl(caps, mapping=Mapping("custom", "Problem", "Answer", "Solution"))
    assert custom.records[1] == {"id": "caps-0000002", "prompt": AIME[1][0],
                                 "solution": AIME[1][2], "answer": "42"}


def test_both_files_of_a_split_are_refused_naming_both(tmp_path):
    write_parquet(tmp_path / "train.parquet", dapo_rows())
    write_jsonl(tmp_path / "train.jsonl", dapo_rows())
    write_jsonl(tmp_path / "test.jsonl", dapo_rows())
    write_parquet(tmp_path / "test.parquet", dapo_rows())
    cases = [("task.jsonl_dir", lambda: jsonl.split_files(str(tmp_path))),
             ("rl.eval_sets", lambda: TaskData.create(
                 TaskConfig(kind="jsonl", jsonl_dir=str(tmp_path / "test.jsonl")), 512,
                 str(tmp_path / "d"), f"aime:{tmp_path}", require_train=False)),
             ("sft.data", lambda: sft_data.data_file(str(tmp_path)))]
    for setting, load in cases:
        split = "test" if setting == "rl.eval_sets" else "train"
        with pytest.raises(ValueError) as e:
            load()
        msg = str(e.value)
        assert msg.startswith(f"{setting}: both ") and "\n" not in msg, msg
        for ext in ("jsonl", "parquet"):
            assert str(tmp_path / f"{split}.{ext}") in msg, msg


@pytest.fixture
def qwen_dir(tmp_path):
    path = tmp_path / "qwen"
    path.mkdir()
    write_qwen_tokenizer(path)
    return path


def _qwen_task(qwen_dir, data_dir, **kw):
    return TaskConfig(kind="jsonl", jsonl_dir=str(data_dir), tokenizer_dir=str(qwen_dir),
                      chat_template=True, max_prompt_len=1024, **kw)


def _chatml(*turns):
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns) + \
        "<|im_start|>assistant\n"


def test_eval_sets_from_parquet_and_a_system_message_survives_the_template(tmp_path,
                                                                          qwen_dir):
    data_dir = tmp_path / "dapo"
    data_dir.mkdir()
    write_parquet(data_dir / "train.parquet", dapo_rows())
    write_parquet(data_dir / "aime24.parquet", verl_aime_rows())  # relative: in jsonl_dir
    aime25 = tmp_path / "aime25"
    aime25.mkdir()
    write_parquet(aime25 / "test.parquet", [{"problem": "Find $2 + 2$.", "answer": 4,
                                             "id": "2025-I-1"}])
    task = _qwen_task(qwen_dir, data_dir)
    sets = f"aime24:aime24.parquet,aime25:{aime25}"
    data = TaskData.create(task, 512, str(tmp_path / "d"), sets)
    assert list(data.evals) == ["aime24", "aime25"]
    assert [r["answer"] for r in data.evals["aime24"]] == ["4", "42"]
    assert data.evals["aime25"][0]["answer"] == "4"
    aime = data.evals["aime24"][1]
    # The record's own system message, then its question, then the generation prompt:
    # what Qwen3's template writes for the chat verl stored.
    assert aime["prompt"] == _chatml(("system", SYSTEM), ("user", AIME[1][0]))
    assert aime["question"] == AIME[1][0] and "chat" not in aime
    assert data.train[0]["prompt"] == _chatml(("user", DAPO_PROMPT.format(DAPO_PROBLEMS[0][0])))
    # task.system_prompt fills in where the record has no system message of its own; the
    # record's wins where it has one. task.prompt_template wraps the last user message.
    brief = TaskData.create(task.replace(system_prompt="Be brief.",
                                         prompt_template="Q: {question}"),
                            512, str(tmp_path / "d"), sets)
    assert brief.train[0]["prompt"] == _chatml(
        ("system", "Be brief."), ("user", "Q: " + DAPO_PROMPT.format(DAPO_PROBLEMS[0][0])))
    assert brief.evals["aime24"][1]["prompt"] == _chatml(("system", SYSTEM),
                                                         ("user", "Q: " + AIME[1][0]))
    assert brief.evals["aime25"][0]["prompt"] == _chatml(("system", "Be brief."),
                                                         ("user", "Q: Find $2 + 2$."))


def test_the_chat_renders_as_transformers_renders_it(tmp_path, qwen_dir):
    transformers = pytest.importorskip(
        "transformers", reason="the interop extra (transformers) is not installed")
    data_dir = tmp_path / "aime"
    data_dir.mkdir()
    write_parquet(data_dir / "test.parquet", verl_aime_rows())
    data = TaskData.create(_qwen_task(qwen_dir, data_dir), 512, str(tmp_path / "d"),
                           require_train=False)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(qwen_dir))
    want = [hf.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
            for r in verl_aime_rows()]
    assert [r["prompt"] for r in data.evals["test"]] == want


CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "<think>\n3 + 4 = 7\n</think>\n\n\\boxed{7}"}]


def _sft_cfg(qwen_dir, data):
    cfg = presets.preset("tiny", ["task.kind=jsonl", "task.jsonl_dir=d",
                                  "task.chat_template=true", f"task.tokenizer_dir={qwen_dir}",
                                  "model.max_seq_len=256", "task.max_prompt_len=64",
                                  "task.max_solution_len=64"])
    return cfg.replace(sft=cfg.sft.replace(data=data))


def test_cold_start_data_from_parquet_encodes_as_from_jsonl(tmp_path, qwen_dir):
    tok = HFTokenizer.from_dir(str(qwen_dir))
    data = types.SimpleNamespace(tokenizer=tok, train=[],
                                 cfg=TaskConfig(kind="jsonl", jsonl_dir="d"))
    # A message with a key the others lack: parquet gives the others that key as null.
    named = dict(CHAT[1], name="student")
    shapes = {"messages": [{"messages": CHAT}, {"messages": [named, CHAT[2]]}],
              "prompt_response": [{"prompt": "What is 1 + 1?", "response": "\\boxed{2}"},
                                  {"prompt": "What is 2 + 3?", "response": "\\boxed{5}"}]}
    for fmt, rows in shapes.items():
        (tmp_path / fmt).mkdir()
        pq_file, jsonl_file = _both(tmp_path / fmt, "train", rows)
        got = sft_data.load(_sft_cfg(qwen_dir, pq_file), data)
        want = sft_data.load(_sft_cfg(qwen_dir, jsonl_file), data)
        assert got.format == want.format == fmt and len(got.examples) == 2
        for a, b in zip(got.examples, want.examples):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
        # A directory holding train.parquet is the same data.
        in_dir = sft_data.load(_sft_cfg(qwen_dir, str(tmp_path / fmt / "parquet")), data)
        assert in_dir.source == pq_file and len(in_dir.examples) == 2
    with pytest.raises(parquet.ParquetError) as e:  # a named format the file lacks
        sft_data.load(_sft_cfg(qwen_dir, pq_file).replace(sft=_sft_cfg(
            qwen_dir, pq_file).sft.replace(format="messages")), data)
    msg = str(e.value)
    assert pq_file in msg and "'messages'" in msg and "['prompt', 'response']" in msg
    assert "sft.format" in msg


def test_a_missing_column_names_the_file_its_columns_and_what_is_read(tmp_path):
    f = write_parquet(tmp_path / "train.parquet", dapo_rows())
    columns = "['data_source', 'prompt', 'ability', 'reward_model', 'extra_info']"
    for skip in (False, True):  # the file's fault, not a row's: never skipped
        with pytest.raises(parquet.ParquetError) as e:
            jsonl.parse_jsonl(f, skip, mapping=Mapping("math"))
        msg = str(e.value)
        assert msg.startswith(f"{f}: format 'math' reads the column 'solution'"), msg
        assert columns in msg and "task.format" in msg and "\n" not in msg
    with pytest.raises(parquet.ParquetError, match=r"'custom' reads the column 'question'"
                                                   r".*task.prompt_field"):
        jsonl.parse_jsonl(f, mapping=Mapping("custom", "question", "answer"))
    # Through the task's builder, as a training run meets it.
    task = TaskConfig(kind="jsonl", jsonl_dir=str(tmp_path), format="aime")
    with pytest.raises(parquet.ParquetError, match=r"train.parquet: format 'aime' reads the "
                                                   r"column 'question'"):
        load_split(task, "train", str(tmp_path / "d"))


def test_a_malformed_row_is_named_by_its_number_or_skipped(tmp_path):
    rows = dapo_rows()
    rows[1]["reward_model"] = {"ground_truth": None, "style": "rule"}
    f = write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(jsonl.MalformedLineError, match=rf"{f} row 2: malformed record of "
                                                       r"format 'dapo' .*ground_truth"):
        jsonl.parse_jsonl(f)
    parsed = jsonl.parse_jsonl(f, skip_malformed=True)
    assert parsed.skipped == 1 and [r["id"] for r in parsed.records] == ["train-0000001",
                                                                          "train-0000003"]


def test_a_corrupt_parquet_file_is_one_line_naming_it(tmp_path):
    good = write_parquet(tmp_path / "good.parquet", dapo_rows())
    with open(good, "rb") as fh:
        data = fh.read()
    cases = {"not parquet": b"question,answer\n1+1,2\n", "empty": b"",
             "truncated": data[:len(data) // 2], "no footer": data[:-12]}
    for name, content in cases.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.parquet"
        bad.write_bytes(content)
        with pytest.raises(parquet.ParquetError) as e:
            jsonl.parse_jsonl(str(bad))
        msg = str(e.value)
        assert msg.startswith(f"{bad}: not a readable parquet file") and "\n" not in msg, name
    manual = tmp_path / "m"
    manual.mkdir()
    (manual / "train.parquet").write_bytes(data[:-12])
    with pytest.raises(parquet.ParquetError, match="train.parquet: not a readable parquet"):
        load_split(TaskConfig(kind="jsonl", jsonl_dir=str(manual)), "train",
                   str(tmp_path / "d"))


def test_rows_of_several_row_groups_keep_their_order(tmp_path):
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]
    f = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(f), row_group_size=2)
    assert pq.ParquetFile(str(f)).num_row_groups == 3
    assert [(n, dict(r)) for n, r in parquet.rows(str(f))] == list(enumerate(rows, 1))


@pytest.mark.slow  # a checkpoint built with torch and one RL step on it: minutes on 2 cores
@pytest.mark.interop
def test_the_paper_recipe_trains_and_evaluates_on_parquet(tmp_path):
    pytest.importorskip("torch", reason="the interop extra (torch) is not installed")
    pytest.importorskip("transformers", reason="the interop extra (transformers) is not "
                        "installed")
    from hf_fixtures import write_recipe_dirs

    from experiments import train
    from stablerl_jax.runs.metrics_io import read_metrics

    ckpt, _, _ = write_recipe_dirs(tmp_path)
    data = tmp_path / "dapo"
    data.mkdir()
    # The problems alone as the user message: DAPO's wording would not fit the tiny
    # checkpoint's 256 positions with this tokenizer's few merges.
    write_parquet(data / "train.parquet", dapo_rows("{}"))
    write_parquet(data / "aime24.parquet", verl_aime_rows())
    work = tmp_path / "run"
    train.main([
        "--workdir", str(work), "--preset", "paper", "--hf", str(ckpt), "--quiet",
        "--compile-cache=", "mesh=1,1,1", "model.compute_dtype=float32",
        "model.remat=none", "model.gmm_impl=tiles", "model.expert_parallel=false",
        "model.attention_impl=naive", "model.decode_attention_impl=blocks",
        "model.unroll_layers=true", "task.max_prompt_len=200",
        "task.max_solution_len=32", "sampling.max_new_tokens=8", "sampling.max_batch=0",
        "sampling.dispatch=dense", "sft.steps=0", "rl.steps=1", "rl.prompts_per_step=2",
        "rl.group_size=2", "rl.microbatches=1", "rl.score_in_update=true",
        "rl.eval_every=1", "rl.eval_k=2", "rl.eval_problems=2", "rl.checkpoint_every=1",
        "rl.log_samples=2", f"task.jsonl_dir={data}", "rl.eval_sets=aime24:aime24.parquet"])
    rows = read_metrics(str(work))
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["eval/aime24/avg@k"] is not None
    aime = [s for s in read_metrics(f"{work}/samples.jsonl") if s["split"] == "eval/aime24"]
    assert aime and all(s["prompt"].startswith(f"<|im_start|>system\n{SYSTEM}")
                        for s in aime), aime

"""The data front door: load_split dispatches on the task kind and reads array_record
through the TFDS data source (no TensorFlow); TaskData trains the tokenizer once with the
model's vocab_size and hands out typed SFT batches; with a Qwen3-style tokenizer it renders
the chat template, filters over-long prompts at load, and reads named eval sets."""
import json
import os
import sys

import numpy as np
import pytest
from hf_fixtures import write_qwen_tokenizer

from stablerl_jax.config import TaskConfig
from stablerl_jax.data import rewards, synthetic
from stablerl_jax.data.task import TaskData, load_split

SMALL = TaskConfig(num_train=200, num_test=40)


def test_load_split_reads_through_data_source_without_tensorflow(tmp_path):
    a = load_split(SMALL, "train", str(tmp_path))
    b = load_split(SMALL, "train", str(tmp_path))  # reuses the built files
    assert a == b == synthetic.generate(SMALL, "train")  # sorted by id = generation order
    assert load_split(SMALL, "test", str(tmp_path)) == synthetic.generate(SMALL, "test")
    assert set(a[0]) == {"id", "prompt", "solution", "answer"}
    assert list(tmp_path.glob("arithmetic/*/1.0.0/*.array_record*"))
    assert "tensorflow" not in sys.modules


def test_task_data_tokenizer_and_batches(tmp_path):
    data = TaskData.create(SMALL, 48, str(tmp_path))
    assert data.tokenizer.vocab_size <= 48  # the model's vocab_size bounds the tokenizer
    assert (tmp_path / "spm_arithmetic_48_4_1.model").exists()
    assert list(data.evals) == ["test"] and data.filtered == {"train": 0, "test": 0}
    assert data.tokenizer.stop_ids == (data.tokenizer.eos_id,)
    again = TaskData.create(SMALL, 48, str(tmp_path))  # reuses splits and tokenizer
    assert again.tokenizer.model_proto == data.tokenizer.model_proto
    tokens, mask, answers = data.prompt_batch(data.train[:2], group_size=3)
    assert tokens.shape[0] == 6 and answers[:3] == [data.train[0]["answer"]] * 3
    np.testing.assert_array_equal(data.train_indices(0, 4, seed=1),
                                  data.train_indices(0, 4, seed=1))


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


BOXED = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."
MATH_TRAIN = [{"problem": f"What is {a} + {a}?", "solution": f"{a}+{a}=\\boxed{{{2 * a}}}"}
              for a in range(1, 6)]


@pytest.fixture
def qwen_task(tmp_path):
    """A Qwen3-style tokenizer, MATH train/test splits with one over-long problem, and two
    eval sets: an AIME-style directory and a single prompt/answer file."""
    tok_dir, data = tmp_path / "qwen", tmp_path / "math"
    tok_dir.mkdir()
    data.mkdir()
    write_qwen_tokenizer(tok_dir)
    long_q = {"problem": "x " * 80 + "?", "solution": "\\boxed{1}"}
    _jsonl(data / "train.jsonl", MATH_TRAIN[:3] + [long_q] + MATH_TRAIN[3:])
    _jsonl(data / "test.jsonl", MATH_TRAIN[:2])
    aime = tmp_path / "aime24"
    aime.mkdir()
    _jsonl(aime / "test.jsonl", [{"problem": "Find 6 * 7.", "answer": 42},
                                 {"problem": "Find " + "1 + " * 40 + "1.", "answer": 41}])
    single = _jsonl(tmp_path / "hmmt.jsonl", [{"prompt": "Half of 1?", "answer": "0.5"}])
    task = TaskConfig(kind="jsonl", jsonl_dir=str(data), tokenizer_dir=str(tok_dir),
                      chat_template=True, system_prompt="You are a helpful assistant.",
                      prompt_template=BOXED, max_prompt_len=64)
    return task, f"aime24:{aime},hmmt:{single}"


def test_rendered_filtered_sets_and_counts(tmp_path, qwen_task, capsys):
    task, sets = qwen_task
    data = TaskData.create(task, 512, str(tmp_path / "d"), sets)
    assert list(data.evals) == ["aime24", "hmmt"]  # the order named
    assert data.filtered == {"train": 1, "aime24": 1, "hmmt": 0}
    out = capsys.readouterr().out
    assert "train read as format 'math'" in out and "'aime24'" in out and "'aime'" in out
    assert "train: dropped 1 of 6 prompts longer than task.max_prompt_len=64" in out
    assert [r["answer"] for r in data.train] == ["2", "4", "6", "8", "10"]
    assert [r["answer"] for r in data.evals["aime24"]] == ["42"]
    assert data.evals["hmmt"][0]["answer"] == "0.5"
    # Every prompt is the final rendered text; batches tokenize it as is.
    prompt = data.train[0]["prompt"]
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    assert prompt.endswith("within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    tokens, mask, _ = data.prompt_batch(data.train, group_size=2)
    assert tokens.shape == (10, 64) and mask.sum(1).max() <= 64
    assert data.response_prefix == "" and data.tokenizer.stop_ids[0] == data.tokenizer.eos_id
    # Without named sets, the task's own test split is the one set 'test'.
    plain = TaskData.create(task, 512, str(tmp_path / "d"))
    assert list(plain.evals) == ["test"] and len(plain.evals["test"]) == 2
    assert plain.filtered == {"train": 1, "test": 0}


def test_a_set_left_empty_refuses_to_start(tmp_path, qwen_task):
    task, sets = qwen_task
    with pytest.raises(ValueError) as e:
        TaskData.create(task.replace(max_prompt_len=30), 512, str(tmp_path / "d"), sets)
    msg = str(e.value)
    assert "every one of the 6 train prompts" in msg and "raise task.max_prompt_len" in msg
    assert task.jsonl_dir in msg


def test_eval_only_directory(tmp_path, qwen_task):
    task, _ = qwen_task
    os.remove(os.path.join(task.jsonl_dir, "train.jsonl"))
    with pytest.raises(FileNotFoundError, match="no train.jsonl, and a training run needs"):
        TaskData.create(task, 512, str(tmp_path / "d"))
    data = TaskData.create(task, 512, str(tmp_path / "d"), require_train=False)
    assert data.train == [] and len(data.evals["test"]) == 2


def test_a_prompt_that_opens_think_is_scored_after_it(tmp_path, qwen_task):
    task, _ = qwen_task
    cfg_file = os.path.join(task.tokenizer_dir, "tokenizer_config.json")
    with open(cfg_file) as f:
        tcfg = json.load(f)
    tcfg["chat_template"] = "{{ messages[-1].content }}<|im_start|>assistant\n<think>\n"
    with open(cfg_file, "w") as f:
        json.dump(tcfg, f)
    data = TaskData.create(task.replace(system_prompt=""), 512, str(tmp_path / "d"))
    assert data.response_prefix == "<think>"
    texts = data.scored_texts(["still thinking \\boxed{2}", "ok</think>\n\\boxed{2}"])
    assert rewards.rewards(texts, ["2", "2"], data.reward_kind).tolist() == [0.0, 1.0]


def test_the_loop_passes_eval_sets_and_needs_no_train_split_offline(tmp_path, qwen_task):
    from rl_helpers import tiny_cfg

    from stablerl_jax.rl import loop
    task, sets = qwen_task
    os.remove(os.path.join(task.jsonl_dir, "train.jsonl"))
    cfg = tiny_cfg()
    cfg = cfg.replace(model=cfg.model.replace(vocab_size=512, max_seq_len=128), task=task,
                      rl=cfg.rl.replace(eval_sets=sets, offline_rollouts="rollouts.npz"))
    data = loop.task_data(cfg, str(tmp_path / "run"))
    assert data.train == [] and list(data.evals) == ["aime24", "hmmt"]
    with pytest.raises(FileNotFoundError, match="no train.jsonl"):
        loop.task_data(cfg.replace(rl=cfg.rl.replace(offline_rollouts="")),
                       str(tmp_path / "run"))


def test_a_train_only_directory_needs_named_eval_sets(tmp_path, qwen_task):
    task, sets = qwen_task
    os.remove(os.path.join(task.jsonl_dir, "test.jsonl"))
    with pytest.raises(FileNotFoundError, match="no test.jsonl.*rl.eval_sets"):
        TaskData.create(task, 512, str(tmp_path / "d"))
    data = TaskData.create(task, 512, str(tmp_path / "d"), sets)
    assert len(data.train) == 5 and list(data.evals) == ["aime24", "hmmt"]

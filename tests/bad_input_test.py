"""Bad input, one case per row: each is refused with an error that names the field (or
file, line, tensor) and says what to change, and nothing is written. Cases through the
command line run `experiments.train` and check that the workdir was not created."""
import json
import os
import shutil
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from rl_helpers import tiny_cfg
from safetensors.numpy import load_file, save_file

from experiments import train
from stablerl_jax import presets
from stablerl_jax.config import ConfigError, TaskConfig
from stablerl_jax.data import jsonl
from stablerl_jax.data.task import load_split
from stablerl_jax.interop.rollouts import write_rollouts
from stablerl_jax.rl import loop, preflight, sft
from stablerl_jax.runs.workdir import LOCK_FILE

# (case, overrides, the message must contain these)
OVERRIDES = [
    ("unknown field", ["rl.bogus=1"], ["unknown field 'bogus'", "rl has"]),
    ("unknown section", ["bogus.steps=1"], ["unknown field 'bogus'", "section"]),
    ("not key=value", ["rl.steps"], ["expected section.field=value"]),
    ("ill-typed int", ["rl.steps=abc"], ["rl.steps", "cannot parse 'abc'"]),
    ("ill-typed bool", ["loss.clip=maybe"], ["loss.clip", "true/false"]),
    ("section as a value", ["rl.optim=1"], ["is a section", "rl.optim.learning_rate"]),
    ("zero size", ["rl.prompts_per_step=0"], ["rl.prompts_per_step", "positive int"]),
    ("negative size", ["model.d_model=-4"], ["model.d_model", "positive int"]),
    ("mini-batches that do not divide", ["rl.num_minibatches=3"],
     ["rl.num_minibatches", "must divide"]),
    ("unknown loss", ["loss.name=ppo"], ["loss.name", "minirl"]),
    ("unknown replay", ["rl.replay=r4"], ["rl.replay", "'r2'"]),
    ("unknown numerics", ["sampling.numerics=fp4"], ["sampling.numerics", "fp8"]),
    ("train numerics for the sampler", ["sampling.numerics=train"],
     ["sampling.numerics", "inference preset"]),
    ("NaN learning rate", ["rl.optim.learning_rate=nan"], ["rl.optim.learning_rate"]),
    ("negative learning rate", ["rl.optim.learning_rate=-1e-4"],
     ["rl.optim.learning_rate", "> 0"]),
    ("infinite SFT learning rate", ["sft.optim.learning_rate=inf"],
     ["sft.optim.learning_rate", "finite"]),
    ("adam b1 = 1", ["rl.optim.b1=1"], ["rl.optim.b1", "[0, 1)"]),
    ("adam b2 = NaN", ["rl.optim.b2=nan"], ["rl.optim.b2"]),
    ("NaN weight decay", ["rl.optim.weight_decay=nan"], ["rl.optim.weight_decay", "finite"]),
    ("adam eps underflows", ["rl.optim.eps=1e-45"], ["rl.optim.eps", ">= 1e-30"]),
    ("clip range", ["loss.eps_low=1.5"], ["loss.eps_low", "[0, 1)"]),
    ("IS cap below 1", ["loss.tis_cap=0.5"], ["loss.tis_cap", ">= 1"]),
    ("infinite router noise", ["sampling.router_noise_std=inf"],
     ["sampling.router_noise_std", "finite"]),
    ("group of one", ["rl.group_size=1"], ["rl.group_size", ">= 2"]),
    ("negative seed", ["rl.seed=-1"], ["rl.seed", ">= 0"]),
    ("mesh not ints", ["mesh=a,b"], ["mesh", "comma-separated ints"]),
    ("mesh of two axes", ["mesh=2,2"], ["mesh", "three positive ints"]),
    ("mesh larger than the devices", ["mesh=1,1,16"], ["mesh=(1, 1, 16)", "devices"]),
    ("unknown overlong mode", ["rl.overlong=drop"], ["rl.overlong", "'mask'"]),
    ("overlong penalty without a buffer", ["rl.overlong=penalty"],
     ["rl.overlong_buffer", "> 0 with rl.overlong=penalty"]),
    ("overlong buffer beyond the response", ["rl.overlong=penalty",
                                             "rl.overlong_buffer=1000"],
     ["rl.overlong_buffer", "<= sampling.max_new_tokens"]),
    ("zero overlong penalty", ["rl.overlong_penalty_factor=0"],
     ["rl.overlong_penalty_factor", "> 0"]),
    ("negative sample count", ["rl.log_samples=-1"], ["rl.log_samples", ">= 0"]),
    ("sequence longer than the model", ["sampling.max_new_tokens=100"],
     ["model.max_seq_len", "max_new_tokens"]),
    ("gsm8k without its directory", ["task.kind=gsm8k"], ["task.jsonl_dir"]),
    ("Arabic-Indic digits", ["rl.steps=٣"], ["rl.steps", "not ASCII", "digits 0-9"]),
    ("full-width digits", ["rl.optim.learning_rate=１e-3"],
     ["rl.optim.learning_rate", "not ASCII"]),
    ("more eval problems than the test split", ["rl.eval_problems=100000"],
     ["rl.eval_problems", "must be <= task.num_test="]),
    ("negative staleness bound", ["rl.max_staleness=-1"], ["rl.max_staleness", ">= 0"]),
    ("partial rollouts of an offline file", ["rl.max_staleness=1",
                                             "rl.offline_rollouts=r.npz"],
     ["rl.max_staleness", "rl.offline_rollouts=''"]),
    ("unknown old policy", ["rl.max_staleness=1", "rl.old_policy=newest"],
     ["rl.old_policy", "'proximal'"]),
    ("sampler slots splitting a group", ["rl.max_staleness=1", "sampling.max_batch=4"],
     ["sampling.max_batch", "multiple of rl.group_size"]),
    ("zero sampling rounds", ["rl.dynamic_sampling=true", "rl.max_sampling_rounds=0"],
     ["rl.max_sampling_rounds", "must be an int >= 1", "got 0"]),
    ("negative sampling rounds", ["rl.max_sampling_rounds=-2"],
     ["rl.max_sampling_rounds", "must be an int >= 1", "got -2"]),
    ("dynamic sampling with partial rollouts", ["rl.dynamic_sampling=true",
                                                "rl.max_staleness=1"],
     ["rl.dynamic_sampling", "set rl.max_staleness=0 or rl.dynamic_sampling=false"]),
    ("dynamic sampling of an offline file", ["rl.dynamic_sampling=true",
                                             "rl.offline_rollouts=r.npz"],
     ["rl.dynamic_sampling", "set rl.offline_rollouts='' or rl.dynamic_sampling=false"]),
    ("packed rows shorter than a sequence", ["rl.pack_tokens=20"],
     ["rl.pack_tokens", "longest possible sequence", "got 20"]),
    ("packing with padded micro-batches", ["rl.pack_tokens=4096", "rl.microbatches=2"],
     ["rl.microbatches", "set rl.microbatches=1"]),
    # Packing beyond what a batch can fill: had been an OverflowError, an out-of-memory
    # traceback (1.1e16 bytes) and a TypeError.
    ("packed rows of 2**31 - 1 tokens", ["rl.pack_tokens=2147483647"],
     ["rl.pack_tokens: 2,147,483,647 tokens is more than a packed row can ever fill",
      "set it between 56 and 7168"]),
    ("packed rows of ten million tokens", ["rl.pack_tokens=10000000"],
     ["rl.pack_tokens: 10,000,000 tokens", "set it between 56 and 7168"]),
    ("2**31 - 1 packed rows", ["rl.pack_tokens=200", "rl.pack_rows=2147483647"],
     ["rl.pack_rows: 2,147,483,647 packed rows", "set rl.pack_rows <= 35"]),
    ("a rope_theta float32 cannot hold", ["model.rope_theta=1e39"],
     ["model.rope_theta", "finite in float32"]),
    ("a million sampling rounds", ["rl.dynamic_sampling=true",
                                   "rl.max_sampling_rounds=1000000"],
     ["rl.max_sampling_rounds", "1000000 rounds", "more than the train split's",
      "set rl.max_sampling_rounds="]),
    ("unknown fields allowed to change", ["--allow-config-change", "rl.bogus_field,zz.top"],
     ["--allow-config-change", "['rl.bogus_field', 'zz.top']"]),
    # Found by tests/fuzz_test.py, read as (1, 1, 1) (the empty entry dropped); fixed in
    # config/experiment.py. A trailing comma, as in (2,), is still read.
    ("mesh with an empty entry", ["mesh=1,,1,1"],
     ["'mesh': '1,,1,1' has an empty entry", "comma-separated ints"]),
    ("mesh with an empty first entry", ["mesh=,1,1,1"],
     ["'mesh': ',1,1,1' has an empty entry", "comma-separated ints"]),
    ("mesh with a blank entry", ["mesh=1, ,1,1"],
     ["'mesh': '1, ,1,1' has an empty entry", "comma-separated ints"]),
]


@pytest.mark.parametrize("case, overrides, needles", OVERRIDES, ids=[c[0] for c in OVERRIDES])
def test_bad_overrides_write_nothing(tmp_path, capsys, case, overrides, needles):
    workdir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--workdir", str(workdir), "--quiet", "--compile-cache=", *overrides])
    assert e.value.code == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, (case, err)
    assert not workdir.exists()


def test_a_workdir_that_is_a_file(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(SystemExit):
        train.main(["--workdir", str(path), "--quiet", "--compile-cache="])
    assert "is a file" in capsys.readouterr().err and path.read_text() == "x"


def test_a_read_only_workdir(tmp_path, monkeypatch, capsys):
    # Permission bits do not stop root (who runs these tests in CI), so the check itself
    # is exercised: os.access says the parent is not writable.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(SystemExit):
        train.main(["--workdir", str(tmp_path / "run"), "--quiet", "--compile-cache="])
    assert "not writable" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# JSONL data: (case, file content, the message must contain)
JSONL = [
    ("no format fits", b'{"question": "1+1?"}\n', "no known format fits the fields "
     "['question']"),
    ("missing field", b'{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n',
     "missing field 'answer'"),
    ("not an object", b'[1, 2]\n', "expected a JSON object"),
    ("bad JSON", b'{"question": \n', "malformed record"),
    ("no final answer line", b'{"question": "q", "answer": "#### 2"}\n'
     b'{"question": "q", "answer": "two"}\n', "#### N"),
    ("an undefined answer", b'{"question": "q", "answer": "#### \\\\frac{1}{0}"}\n',
     "or is undefined"),
    ("an answer math-verify cannot read", b'{"question": "q", "answer": "x #### banana"}\n',
     "'banana' is not a number"),
    ("invalid UTF-8", b'{"question": "\xff\xfe", "answer": "#### 2"}\n', "utf-8"),
    ("a huge line", b'{"question": "' + b"9" * (jsonl.MAX_LINE_BYTES + 10)
     + b'", "answer": "#### 2"}\n', "MAX_LINE_BYTES"),
    ("an empty file", b"", "no records"),
]


@pytest.mark.parametrize("case, content, needle", JSONL, ids=[c[0] for c in JSONL])
def test_bad_jsonl_names_file_and_line(tmp_path, case, content, needle):
    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        jsonl.parse_jsonl(str(path))
    msg = str(e.value)
    assert needle in msg and str(path) in msg, msg
    if content:
        lines = content.count(b"\n")
        assert f"{path}:{lines}" in msg  # the line
        if lines == 1:
            # skip_malformed skips it (and the split, left empty, is then an error itself).
            with pytest.raises(ValueError, match="no records"):
                jsonl.parse_jsonl(str(path), skip_malformed=True)


def test_a_missing_data_dir(tmp_path):
    task = TaskConfig(kind="gsm8k", jsonl_dir=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="task.jsonl_dir"):
        load_split(task, "train", str(tmp_path / "data"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A completed 1-step run (and its cold start) to resume from."""
    root = tmp_path_factory.mktemp("bad_resume")
    cfg = tiny_cfg(steps=1, eval_every=1)
    loop.run(cfg, str(root / "run"), progress=False)
    return cfg, root / "run"


def _snapshot(path):
    """Every file's name, size and mtime; but the lock file, which a refused run also
    takes and releases (stablerl_jax/runs/workdir.py)."""
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*") if p.name != LOCK_FILE)


@pytest.mark.integration
def test_resuming_with_another_model_config_is_refused(finished_run):
    cfg, workdir = finished_run
    before = _snapshot(workdir)
    other = cfg.replace(model=cfg.model.replace(d_model=48), rl=cfg.rl.replace(steps=2))
    with pytest.raises(ValueError) as e:
        loop.run(other, str(workdir), progress=False)
    msg = str(e.value)
    assert "model.d_model: 32 -> 48" in msg and "--allow-config-change model.d_model" in msg
    assert "rl.steps" not in msg  # how long a run lasts may change
    assert _snapshot(workdir) == before


# Found by tests/fuzz_test.py as AttributeError / TypeError; fixed in rl/preflight.py.
@pytest.mark.integration
@pytest.mark.parametrize("stored", [False, [], "config", 3],
                         ids=["false", "[]", "a string", "a number"])
def test_a_stored_config_that_is_not_an_object_is_refused(finished_run, tmp_path, stored):
    cfg, workdir = finished_run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    (copy / LOCK_FILE).unlink(missing_ok=True)
    meta_file = copy / "checkpoints" / "1" / "meta" / "metadata"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "config": stored}))
    before = _snapshot(copy)
    with pytest.raises(ValueError) as e:
        loop.run(cfg, str(copy), progress=False)
    msg = str(e.value)
    assert msg.startswith(f"{copy}: the stored config is a JSON {type(stored).__name__}, "
                          "not an object") and "use a new workdir" in msg, msg
    assert _snapshot(copy) == before


@pytest.mark.integration
def test_the_only_checkpoint_corrupted_is_refused(finished_run, tmp_path):
    cfg, workdir = finished_run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    step_dir = copy / "checkpoints" / "1"
    data = max((p for p in step_dir.rglob("*") if p.is_file() and "state" in p.parts),
               key=lambda p: p.stat().st_size)
    data.write_bytes(bytes(data.stat().st_size))
    with pytest.raises(ValueError, match="no checkpoint restores"):
        loop.run(cfg, str(copy), progress=False)
    assert (copy / "checkpoints" / "1.corrupt").is_dir()  # kept for inspection


def test_a_cold_start_with_other_settings_is_refused(tmp_path):
    cfg = tiny_cfg()
    workdir = tmp_path / "run"
    (workdir / "sft").mkdir(parents=True)
    (workdir / "sft" / "commit_success.txt").write_text("")
    other = cfg.replace(model=cfg.model.replace(d_model=48))
    (workdir / "sft.json").write_text(json.dumps(sft.sft_settings(other)))
    with pytest.raises(ValueError, match=r"sft was trained with other settings \(model.d_model\)"):
        sft.cold_start(cfg, data=None, workdir=str(workdir), progress=False)


def _jsonl_cfg(path, **task):
    cfg = tiny_cfg()
    return cfg.replace(task=cfg.task.replace(kind="jsonl", jsonl_dir=str(path), **task))


def _only_data_written(workdir):
    return sorted(os.listdir(workdir)) == ["data"]  # the data cache; no run was started


def test_a_set_whose_every_answer_is_unreadable_is_refused_with_the_count(tmp_path):
    manual = tmp_path / "m"
    manual.mkdir()
    bad = "".join(json.dumps({"question": f"q{i}", "answer": "#### \\frac{1}{0}"}) + "\n"
                  for i in range(3))
    (manual / "train.jsonl").write_text(bad)
    (manual / "test.jsonl").write_text(bad)
    with pytest.raises(ValueError) as e:
        loop.task_data(_jsonl_cfg(manual, skip_malformed=True), str(tmp_path / "run"))
    msg = str(e.value)
    assert "train.jsonl: no records (3 malformed line(s) skipped)" in msg
    assert "math-verify can read" in msg and _only_data_written(tmp_path / "run")


def test_a_huge_question_is_filtered_and_counted_and_a_bom_accepted(tmp_path, capsys):
    manual = tmp_path / "m"
    manual.mkdir()
    ok = json.dumps({"question": "1 + 2 = ?", "answer": "#### 3"}) + "\n"
    # A million characters the tokenizer covers (uncovered ones would merge into one unk).
    huge = json.dumps({"question": "1 + 2 = ?" * 111_112, "answer": "#### 9"}) + "\n"
    (manual / "train.jsonl").write_bytes(b"\xef\xbb\xbf" + (ok + huge + ok).encode())
    (manual / "test.jsonl").write_text(ok)
    data = loop.task_data(_jsonl_cfg(manual, skip_malformed=True), str(tmp_path / "run"))
    assert data.filtered == {"train": 1, "test": 0} and len(data.train) == 2
    assert "train: dropped 1 of 3 prompts longer than task.max_prompt_len=16" in \
        capsys.readouterr().out
    # Every prompt left fits a batch: no step can meet an over-long one.
    tokens, _, _ = data.prompt_batch(data.train, group_size=2)
    assert tokens.shape == (4, 16)


def test_a_split_left_empty_by_the_length_filter_is_refused(tmp_path):
    manual = tmp_path / "m"
    manual.mkdir()
    (manual / "train.jsonl").write_text(json.dumps({"question": "1 + 2 = ?",
                                                    "answer": "#### 3"}) + "\n")
    (manual / "test.jsonl").write_text(json.dumps({"question": "1 + 2 + 3 + 4 + 5 = ?",
                                                   "answer": "#### 15"}) + "\n")
    with pytest.raises(ValueError) as e:
        loop.task_data(_jsonl_cfg(manual, max_prompt_len=8), str(tmp_path / "run"))
    msg = str(e.value)
    assert "every one of the 1 test prompts is longer than task.max_prompt_len=8" in msg
    assert "raise task.max_prompt_len" in msg and str(manual) in msg
    assert _only_data_written(tmp_path / "run")
def test_eval_problems_beyond_a_jsonl_test_split_are_refused():
    # A JSONL split's size is known once it is read: checked then, before any training.
    data = SimpleNamespace(evals={"test": [{"prompt": "q", "answer": "1"}] * 3})
    cfg = tiny_cfg().replace(task=TaskConfig(kind="gsm8k", jsonl_dir="x"))
    with pytest.raises(ConfigError, match=r"rl.eval_problems=8: the test split holds 3 "
                                          r"problems; set rl.eval_problems=3 or fewer"):
        preflight.check_eval_problems(cfg, data)
    preflight.check_eval_problems(cfg, SimpleNamespace(evals={"test": [{}] * 8}))  # enough


def test_named_eval_sets_smaller_than_the_cap_are_evaluated_whole_and_said_so(capsys):
    # A benchmark is its own size (AIME: 30 problems); rl.eval_problems only caps it.
    data = SimpleNamespace(evals={"aime24": [{}] * 30, "big": [{}] * 100})
    cfg = tiny_cfg().replace(task=TaskConfig(kind="gsm8k", jsonl_dir="x"))
    cfg = cfg.replace(rl=cfg.rl.replace(eval_sets="aime24:a.jsonl,big:b.jsonl",
                                        eval_problems=64))
    preflight.check_eval_problems(cfg, data)
    assert ("eval sets: aime24 30 of 30 problems, big 64 of 100 problems"
            in capsys.readouterr().out)


# Entry points: a user error is one line on stderr and exit status 2; --traceback shows
# the full traceback instead.
def _one_line(capsys, argv, *needles):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert "--traceback for the full traceback" in err
    return err


def _history(workdir, steps, summary=False, checkpoint=False):
    workdir.mkdir(parents=True)
    (workdir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in steps))
    if summary:
        (workdir / "summary.json").write_text("{}")
    if checkpoint:
        (workdir / "checkpoints" / "2").mkdir(parents=True)


@pytest.mark.parametrize("steps, summary, checkpoint, replace, refused", [
    ((0,), False, False, False, False),       # killed before its first checkpoint: restarts
    ((0, 1, 2, 3, 4), False, False, False, False),  # the save of step 2 may be unfinished
    (tuple(range(6)), False, False, False, True),   # step 2's save was done, and is gone
    ((), True, False, False, True),           # a finished run's summary
    ((0, 1, 2), True, True, False, False),    # a checkpoint: the resume path decides
    ((0, 1, 2), True, False, True, False),    # --replace-history
], ids=["step 0", "before the first checkpoint", "checkpoint gone", "summary",
        "checkpoint kept", "replace"])
def test_a_workdirs_history_is_replaced_only_when_asked(tmp_path, steps, summary, checkpoint,
                                                         replace, refused):
    cfg = tiny_cfg(checkpoint_every=2)
    _history(tmp_path / "run", steps, summary, checkpoint)
    if not refused:
        preflight.check_history(cfg, str(tmp_path / "run"), replace)
        return
    with pytest.raises(ValueError) as e:
        preflight.check_history(cfg, str(tmp_path / "run"), replace)
    assert "holds another run's history" in str(e.value)
    assert "--replace-history" in str(e.value) and "another --workdir" in str(e.value)


@pytest.mark.integration
def test_a_finished_run_without_its_checkpoints_keeps_its_history(tmp_path, capsys):
    """A finished run's checkpoints/ deleted, then the command run again with a setting
    changed: one line and exit 2 before any work, its metrics and summary unchanged
    (through the library too); --replace-history starts over there."""
    work = tmp_path / "run"
    argv = ["--workdir", str(work), "--quiet", "--compile-cache=", "sft.steps=0",
            "rl.steps=2", "rl.eval_every=2", "rl.checkpoint_every=1", "task.num_train=64",
            "task.num_test=16", "rl.prompts_per_step=4", "rl.group_size=2",
            "rl.eval_problems=8", "rl.eval_k=1"]
    train.main(argv)
    shutil.rmtree(work / "checkpoints")
    kept = {f: (work / f).read_bytes() for f in ("metrics.jsonl", "summary.json")}
    changed = [*argv, "rl.optim.learning_rate=5e-4"]
    _one_line(capsys, changed, f"{work} holds another run's history (metrics.jsonl: 3 rows "
              "to step 2, summary.json)", "--replace-history")
    cfg = presets.preset("tiny", changed[4:])
    with pytest.raises(ValueError, match="holds another run's history"):
        loop.run(cfg, str(work), progress=False)
    assert {f: (work / f).read_bytes() for f in kept} == kept
    summary = train.main([*changed, "--replace-history"])  # trained again, checkpointed
    assert summary["steps"] == 2 and sorted(os.listdir(work / "checkpoints")) == ["1", "2"]


def test_a_corrupt_cold_start_settings_file_is_one_line(tmp_path, capsys):
    workdir = tmp_path / "run"
    (workdir / "sft").mkdir(parents=True)
    (workdir / "sft" / "commit_success.txt").write_text("")
    (workdir / "sft.json").write_text('{"model.d_model": 6')
    argv = ["--workdir", str(workdir), "--quiet", "--compile-cache="]
    _one_line(capsys, argv, f"{workdir / 'sft.json'}: not valid JSON", "delete it")
    with pytest.raises(ValueError, match="sft.json: not valid JSON"):
        train.main([*argv, "--traceback"])
    assert not (workdir / "checkpoints").exists() and not (workdir / "metrics.jsonl").exists()




def _damaged(src, dest, change):
    """A copy of the checkpoint `src` with one tensor of layer 1 changed."""
    shutil.copytree(src, dest)
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    file = dest / index["weight_map"][name]
    tensors = load_file(str(file))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(file), metadata={"format": "pt"})
    return dest, name, file.name


@pytest.mark.parametrize("case", ["nan", "inf", "float16", "int32"])
def test_bad_hf_weights_are_refused_naming_tensor_and_file(tmp_path, capsys, hf_dir, case):
    def change(w):
        if case in ("nan", "inf"):
            w = w.copy()
            w[3, 2] = np.nan if case == "nan" else -np.inf
            return w
        return w.astype(case)
    path, name, file = _damaged(hf_dir, tmp_path / "ckpt", change)
    workdir = tmp_path / "run"
    needles = ([f"tensor {name} in {file} holds NaN or inf"] if case in ("nan", "inf") else
               [f"tensor {name} in {file} is {case}", "torch_dtype is float32"])
    _one_line(capsys, ["--workdir", str(workdir), "--quiet", "--compile-cache=",
                       "--hf", str(path)], *needles)
    assert not (workdir / "checkpoints").exists() and not (workdir / "metrics.jsonl").exists()


@pytest.mark.integration
def test_a_read_only_checkpoint_directory_is_one_line(tmp_path, capsys, monkeypatch,
                                                      hf_dir):
    workdir = tmp_path / "run"
    access = os.access  # root ignores permission bits: make the check itself say no
    monkeypatch.setattr(os, "access", lambda p, mode: not str(p).endswith("checkpoints")
                        and access(p, mode))
    _one_line(capsys, ["--workdir", str(workdir), "--quiet", "--compile-cache=",
                       "--hf", str(hf_dir)], "checkpoints' is not writable")
    assert not (workdir / "metrics.jsonl").exists()


# Offline rollout files: every value is checked when the file is opened.
ROLLOUT_CASES = [  # (case, change(arrays), record, field, the message must contain)
    ("token id beyond the vocabulary", lambda a: a["completion_ids"].__setitem__(
        slice(9, 10), 64), "completion_ids", "token id 64 is outside [0, model.vocab_size=64)"),
    ("negative prompt token", lambda a: a["prompt_ids"].__setitem__(slice(20, 21), -1),
     "prompt_ids", "token id -1"),
    ("NaN logp_mu", lambda a: a["logp_mu"].__setitem__(slice(9, 10), np.nan), "logp_mu",
     "nan is not a log-probability"),
    ("positive logp_mu", lambda a: a["logp_mu"].__setitem__(slice(9, 10), 0.5), "logp_mu",
     "0.5 is not a log-probability"),
    ("NaN reward", lambda a: a["rewards"].__setitem__(slice(1, 2), np.nan), "rewards",
     "nan is not finite"),
    ("negative completion length", lambda a: a["completion_lens"].__setitem__(
        slice(1, 2), -1), "completion_lens", "-1 is below 0"),
    ("completion longer than the slots", "long", "completion_lens", "17 is not in [1, 16]"),
    ("expert id beyond the experts", lambda a: a["routes"].__setitem__(
        (slice(30, 31), 1, 0), 8), "routes", "outside [0, model.num_experts=8)"),
    ("expert id -2", lambda a: a["routes"].__setitem__((slice(30, 31), 0, 1), -2),
     "routes", "outside [0, model.num_experts=8)"),
]


@pytest.mark.parametrize("case, change, field, needle", ROLLOUT_CASES,
                         ids=[c[0] for c in ROLLOUT_CASES])
def test_bad_offline_rollouts_are_refused_at_open(tmp_path, case, change, field, needle):
    cfg = tiny_cfg(replay="r3", steps=1)
    rng = np.random.default_rng(0)
    recs = [{"prompt_ids": rng.integers(4, 60, 5), "completion_ids": rng.integers(4, 60, c),
             "logp_mu": -rng.uniform(0.1, 2, c),
             "routes": np.stack([rng.permutation(8)[:2] for _ in range(4 + c) for _ in "LL"])
             .reshape(4 + c, 2, 2), "reward": float(i % 2)}
            for i, c in enumerate([4, 17 if change == "long" else 4] + [4] * 6)]
    path = tmp_path / "rollouts.npz"
    write_rollouts(str(path), recs, group_size=2)
    if change != "long":
        arrays = dict(np.load(path))
        change(arrays)
        np.savez(path, **arrays)
    cfg = cfg.replace(rl=cfg.rl.replace(offline_rollouts=str(path)))
    with pytest.raises(ValueError) as e:
        loop.open_offline(cfg)
    msg = str(e.value)
    assert str(path) in msg and f"field {field!r}" in msg and needle in msg, msg
    # The record: response 1 for per-response fields; entries 9, 20 and 30 fall in
    # responses 2, 4 and 3 (4 completion, 5 prompt and 8 route tokens per response).
    record = {"completion_ids": 2, "prompt_ids": 4, "logp_mu": 2, "routes": 3}.get(field, 1)
    assert f"record {record} (response index)" in msg, msg


# Hostile files (offline rollouts, JSONL, linked logs) through the command line: exit
# status 2, one line naming the file (field, line) and the fix, and nothing outside the
# workdir changed (the hostile file included).
def _outside(root, workdir):
    """Name, size, mtime and link target of every path under `root` but in `workdir`."""
    return sorted((str(p), p.lstat().st_size, p.lstat().st_mtime_ns,
                   os.readlink(p) if p.is_symlink() else None)
                  for p in root.rglob("*") if workdir not in (p, *p.parents))


def _refused_outside_untouched(capsys, tmp_path, overrides, *needles):
    workdir = tmp_path / "run"
    before = _outside(tmp_path, workdir)
    err = _one_line(capsys, ["--workdir", str(workdir), "--quiet", "--compile-cache=",
                             *overrides], *needles)
    assert _outside(tmp_path, workdir) == before
    ckpts = workdir / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())  # no step trained
    return err


def _rollouts(path, group_size=2, **fields):
    """A valid rollout file (8 responses, groups of `group_size`) with `fields` set."""
    rng = np.random.default_rng(0)
    write_rollouts(str(path), [{"prompt_ids": rng.integers(4, 60, 5),
                                "completion_ids": rng.integers(4, 60, 4),
                                "logp_mu": -rng.uniform(0.1, 2, 4), "reward": float(i % 2)}
                               for i in range(8)], group_size=group_size)
    if fields:
        np.savez(path, **{**dict(np.load(path)), **fields})  # object arrays are pickled
    return path


def _cut(path):
    data = _rollouts(path).read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


BAD_ROLLOUT_FILES = [  # (case, make(tmp_path) -> path, the line must contain)
    (".npy instead of .npz", lambda t: (np.save(t / "r.npy", np.zeros(3)), t / "r.npy")[1],
     ["a single .npy array", "not an .npz archive", "write_rollouts"]),
    ("truncated zip", lambda t: _cut(t / "r.npz"),
     ["not a readable .npz archive (BadZipFile", "write_rollouts"]),
    ("empty file", lambda t: ((t / "r.npz").write_bytes(b""), t / "r.npz")[1],
     ["not a readable .npz archive (EOFError", "write_rollouts"]),
    ("a text file", lambda t: (t / "r.npz").write_text("prompt_ids,1,2\n") and t / "r.npz",
     ["neither .npz nor .npy data, and never unpickled", "write_rollouts"]),
    ("group_size 0", lambda t: _rollouts(t / "r.npz", group_size=0),
     ["field 'group_size' is 0", "must be >= 1", "write_rollouts(..., group_size=G)"]),
    ("group_size [2, 2]", lambda t: _rollouts(t / "r.npz", group_size=np.array([2, 2])),
     ["field 'group_size' has shape (2,)", "write_rollouts(..., group_size=G)"]),
    ("pickled object array", lambda t: _rollouts(
        t / "r.npz", answers=np.array(["1", 2] * 4, dtype=object)),
     ["field 'answers' cannot be read (an object array: pickled Python objects, never "
      "unpickled)", "plain numeric or str array", "write_rollouts"]),
    ("lengths as strings", lambda t: _rollouts(t / "r.npz", prompt_lens=np.array(["5"] * 8)),
     ["field 'prompt_lens' has dtype <U1", "integers", "write_rollouts"]),
    ("routes of rank 2", lambda t: _rollouts(t / "r.npz", routes=np.zeros((64, 2), np.int32)),
     ["field 'routes' has shape (64, 2)", "3 dimension(s)", "write_rollouts"]),
    ("no such file", lambda t: t / "absent.npz", ["no such file", "rl.offline_rollouts"]),
]


@pytest.mark.parametrize("case, make, needles", BAD_ROLLOUT_FILES,
                         ids=[c[0] for c in BAD_ROLLOUT_FILES])
def test_hostile_rollout_files_are_one_line_naming_the_file(tmp_path, capsys, case, make,
                                                            needles):
    path = make(tmp_path)
    _refused_outside_untouched(capsys, tmp_path, ["sft.steps=0",
                                                  f"rl.offline_rollouts={path}"],
                               f"{path}: ", *needles)


def _deep(path):
    path.mkdir()
    ok = json.dumps({"question": "1 + 2 = ?", "answer": "#### 3"}) + "\n"
    (path / "train.jsonl").write_text(ok + "[" * 100_000 + "]" * 100_000 + "\n" + ok)
    (path / "test.jsonl").write_text(ok)
    return path


def test_a_line_nested_100000_deep_is_one_line_or_skipped_and_counted(tmp_path, capsys):
    manual = _deep(tmp_path / "m")
    _refused_outside_untouched(
        capsys, tmp_path, ["sft.steps=0", "task.kind=jsonl", f"task.jsonl_dir={manual}"],
        f"{manual / 'train.jsonl'}:2: malformed record", "nested deeper than the reader "
        "follows", "pass skip_malformed=True")
    data = loop.task_data(_jsonl_cfg(manual, skip_malformed=True), str(tmp_path / "run2"))
    assert len(data.train) == 2
    assert jsonl.parse_jsonl(str(manual / "train.jsonl"), skip_malformed=True).skipped == 1
    # The generic path (another record reader: cold-start chats) shares load_object.
    from stablerl_jax.data import sft_data
    with pytest.raises(ValueError, match=r"train.jsonl:2: malformed record .* nested deeper"):
        jsonl.parse_jsonl(str(manual / "train.jsonl"), record=sft_data.read_record)
    assert jsonl.parse_jsonl(str(manual / "train.jsonl"), skip_malformed=True,
                             record=sft_data.read_record).skipped == 1


def _far_dates(values):
    """A parquet date32 column of `values` days after 1970-01-01 (3,000,000: year 10183,
    past Python's datetime.date)."""
    import pyarrow as pa

    return pa.array(values, pa.int32()).cast(pa.date32())


def test_a_parquet_cell_python_cannot_hold_is_a_malformed_row(tmp_path, capsys):
    # Found by tests/fuzz_test.py (parquet surface) as pyarrow's OverflowError, a traceback
    # for the whole file, even where no format reads the column; fixed in data/parquet.py.
    import pyarrow as pa
    import pyarrow.parquet as pq

    manual = tmp_path / "m"
    manual.mkdir()
    pq.write_table(pa.table({"question": ["1 + 2 = ?", "2 + 2 = ?"],
                             "answer": _far_dates([3_000_000, 3])}),
                   str(manual / "train.parquet"))
    pq.write_table(pa.table({"question": ["1 + 2 = ?"], "answer": ["3"]}),
                   str(manual / "test.parquet"))
    _refused_outside_untouched(
        capsys, tmp_path, ["sft.steps=0", "task.kind=jsonl", f"task.jsonl_dir={manual}"],
        f"{manual / 'train.parquet'} row 1: malformed record", "field 'answer' must be a "
        "string, got Unreadable", "pass skip_malformed=True")
    with pytest.raises(ValueError, match=r"train.parquet: no records \(2 malformed"):
        jsonl.parse_jsonl(str(manual / "train.parquet"), skip_malformed=True)
    # In a column no format reads (verl's extra_info, say) it does not matter.
    pq.write_table(pa.table({"question": ["1 + 2 = ?", "2 + 2 = ?"], "answer": ["3", "4"],
                             "created": _far_dates([3, 3_000_000])}),
                   str(manual / "train.parquet"))
    parsed = jsonl.parse_jsonl(str(manual / "train.parquet"))
    assert [r["answer"] for r in parsed.records] == ["3", "4"] and parsed.skipped == 0


def test_a_reference_hash_line_holding_a_word_is_a_malformed_record(tmp_path, capsys):
    manual = tmp_path / "m"
    manual.mkdir()
    ok = json.dumps({"question": "1 + 2 = ?", "answer": "#### 3"}) + "\n"
    (manual / "train.jsonl").write_text(
        ok + json.dumps({"question": "q", "answer": "so #### eleventy 5"}) + "\n")
    (manual / "test.jsonl").write_text(ok)
    _refused_outside_untouched(
        capsys, tmp_path, ["sft.steps=0", "task.kind=jsonl", f"task.jsonl_dir={manual}"],
        f"{manual / 'train.jsonl'}:2: malformed record", "'eleventy 5' is not a number")


LINKED_LOGS = [("metrics.jsonl", ["sft.steps=0"]), ("samples.jsonl", ["sft.steps=0"]),
               ("minibatches.jsonl", ["sft.steps=0"]),
               ("sft_run/metrics.jsonl", ["sft.steps=1"])]


@pytest.mark.integration
@pytest.mark.parametrize("log, overrides", LINKED_LOGS, ids=[c[0] for c in LINKED_LOGS])
@pytest.mark.parametrize("dangling", [False, True], ids=["to a file", "dangling"])
def test_a_linked_log_is_one_line_and_its_target_untouched(tmp_path, capsys, log,
                                                           overrides, dangling):
    # The run rewrites its logs by rename on start and resume, which would replace the
    # link and leave its target stale: refused, the link and its target as they were.
    target = tmp_path / "elsewhere" / "log.jsonl"
    target.parent.mkdir()
    if not dangling:
        target.write_text(json.dumps({"step": 0, "reward": 0.5}) + "\n")
    link = tmp_path / "run" / log
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    _refused_outside_untouched(capsys, tmp_path, overrides,
                               f"{link} is a symbolic link (to '{target}')",
                               "replace the link by a regular file")
    assert link.is_symlink() and os.readlink(link) == str(target)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert log == "metrics.jsonl" or not metrics.exists() or metrics.stat().st_size == 0


# A --hf config.json at odds with itself or with its weights, and int settings beyond
# int32: exit status 2, one line naming the field, the file and the fix, nothing outside
# the workdir changed (the checkpoint included).
def _drop_head_dim(hf):
    hf.pop("head_dim")
    return {**hf, "num_attention_heads": 0}


HF_CONFIGS = [  # (case, change(config.json dict) or the file's text, the line must contain)
    ("more layers than the weights", lambda hf: {**hf, "num_hidden_layers": 3},
     ["num_hidden_layers is 3, but the weights hold 2", "set num_hidden_layers to 2"]),
    ("a million layers", lambda hf: {**hf, "num_hidden_layers": 10**6},
     ["num_hidden_layers is 1000000, but the weights hold 2", "set num_hidden_layers to 2"]),
    ("a fractional layer count", lambda hf: {**hf, "num_hidden_layers": 2.7},
     ["num_hidden_layers: must be an int >= 1", "got 2.7", "correct it in config.json"]),
    ("an integral float layer count", lambda hf: {**hf, "num_hidden_layers": 2.0},
     ["num_hidden_layers: must be an int >= 1", "got 2.0", "correct it in config.json"]),
    ("an infinite vocabulary", lambda hf: {**hf, "vocab_size": float("inf")},
     ["vocab_size: must be an int >= 1", "got inf", "correct it in config.json"]),
    ("a vocabulary as a list", lambda hf: {**hf, "vocab_size": [64]},
     ["vocab_size: must be an int >= 1", "got [64]", "correct it in config.json"]),
    ("zero heads without head_dim", _drop_head_dim,
     ["num_attention_heads: must be an int >= 1", "got 0", "correct it in config.json"]),
    ("vocab rows that disagree", lambda hf: {**hf, "vocab_size": 65},
     ["vocab_size is 65, but the weights hold 64", "model.embed_tokens.weight",
      "set vocab_size to 64"]),
    ("an expert count that disagrees", lambda hf: {**hf, "num_experts": 16},
     ["num_experts is 16, but the weights hold 8", "set num_experts to 8"]),
    ("a string for a bool", lambda hf: {**hf, "tie_word_embeddings": "false"},
     ["tie_word_embeddings: must be true or false", "correct it in config.json"]),
    ("not JSON", '{"vocab_size": 64,', ["config.json: not valid JSON",
                                        "restore the checkpoint's file"]),
    # Each float setting is checked in float32, the dtype the model computes it in: a
    # rope_theta that overflows it had trained on with a numpy warning and a rising loss.
    ("a rope_theta float32 cannot hold", lambda hf: {**hf, "rope_theta": 1e39},
     ["rope_theta: is 1e+39, which float32", "cannot hold", "correct it in config.json"]),
    ("an rms_norm_eps that is 0 in float32", lambda hf: {**hf, "rms_norm_eps": 1e-50},
     ["rms_norm_eps: is 1e-50, which float32", "correct it in config.json"]),
    ("a router_aux_loss_coef beyond float32", lambda hf: {**hf, "router_aux_loss_coef": 1e300},
     ["router_aux_loss_coef: is 1e+300", "correct it in config.json"]),
]


@pytest.mark.parametrize("case, change, needles", HF_CONFIGS, ids=[c[0] for c in HF_CONFIGS])
def test_a_bad_hf_config_json_is_one_line_naming_field_and_file(tmp_path, capsys, hf_dir,
                                                                case, change, needles):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_dir, ckpt)
    source = ckpt / "config.json"
    source.write_text(change if isinstance(change, str) else
                      json.dumps(change(json.loads(source.read_text()))))
    _refused_outside_untouched(capsys, tmp_path, ["--hf", str(ckpt)], f"{source}: ",
                               *needles)


def _index_moving(name):
    """A change of the shard index that places tensor `name` in another shard."""
    def change(index):
        files = sorted(set(index["weight_map"].values()))
        other = next(f for f in files if f != index["weight_map"][name])
        return {**index, "weight_map": {**index["weight_map"], name: other}}
    return change


GATE = "model.layers.0.mlp.gate.weight"
# Found by tests/fuzz_test.py: an index that is not an object as AttributeError, one that
# places a tensor in a shard that does not hold it as safetensors' SafetensorError (a
# traceback at the command line); fixed in interop/hf_checkpoint.py.
HF_INDEXES = [  # (case, change(index dict) or the file's text, the named file, needles)
    ("null", "null", "model.safetensors.index.json",
     ["must be a JSON object whose weight_map maps each tensor name to a file name",
      "restore the checkpoint's index"]),
    ("a list", "[]", "model.safetensors.index.json", ["must be a JSON object"]),
    ("a string", '"weights"', "model.safetensors.index.json", ["must be a JSON object"]),
    ("a tensor placed in the wrong shard", _index_moving(GATE), None,
     [f"holds no tensor {GATE}, which", "model.safetensors.index.json places there",
      "restore the checkpoint's index"]),
]


@pytest.mark.parametrize("case, change, named, needles", HF_INDEXES,
                         ids=[c[0] for c in HF_INDEXES])
def test_a_bad_hf_shard_index_is_one_line_naming_the_file(tmp_path, capsys, hf_dir, case,
                                                         change, named, needles):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_dir, ckpt)
    source = ckpt / "model.safetensors.index.json"
    index = json.loads(source.read_text())
    source.write_text(change if isinstance(change, str) else json.dumps(change(index)))
    if named is None:  # the shard the index wrongly names
        named = [f for f in sorted(set(index["weight_map"].values()))
                 if f != index["weight_map"][GATE]][0]
    _refused_outside_untouched(capsys, tmp_path, ["--hf", str(ckpt)], f"{ckpt / named}: ",
                               *needles)


@pytest.mark.parametrize("override", ["sft.steps=3000000000", "rl.prompts_per_step=2147483648",
                                      "task.seed=-2147483649", "mesh=1,1,4294967296"])
def test_an_int_setting_beyond_int32_is_refused(tmp_path, capsys, override):
    workdir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--workdir", str(workdir), "--quiet", "--compile-cache=", override])
    assert e.value.code == 2
    field, value = override.split("=")
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(err) == 1 and f"{field}: {value.split(',')[-1]} is outside int32 " \
        "[-2147483648, 2147483647]" in err[0] and "use a value within it" in err[0], err
    assert not workdir.exists() and os.listdir(tmp_path) == []


# A checkpoint's chat template is code: a hostile one, found by a `--hf` run with
# task.chat_template=true as the checkpoint's tokenizer_config.json "chat_template" or its
# chat_template.jinja, is refused when the data loads (before any training) with one line
# naming that file and the bound (data/template_sandbox.py, RenderLimits).
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"
HOSTILE_TEMPLATES = [  # (file, template, the line must contain)
    pytest.param("tokenizer_config.json", NESTED.replace("BODY", "x"),
                 ["builds the rendered text of ~4,194,30", "> 4,194,304 (RenderLimits.chars)"],
                 id="nested range(100000) loops"),
    pytest.param("chat_template.jinja", "{{ ('x'*6*10**9)|length }}",
                 ["builds a string of ~6,000,000,000 characters > 4,194,304 "
                  "(RenderLimits.chars)"], id="a string of 6e9 characters"),
    pytest.param("tokenizer_config.json", NESTED.replace("BODY", ""),
                 ["ran past the time limit of 1 s per render (RenderLimits.seconds)"],
                 id="nested loops that render nothing"),
    pytest.param("chat_template.jinja", NESTED.replace("BODY", ""),
                 ["ran past the time limit of 10 s per render (RenderLimits.seconds)"],
                 id="nested loops that render nothing, 10 s", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("file, template, needles", HOSTILE_TEMPLATES)
def test_a_hostile_chat_template_is_one_line_naming_its_file(tmp_path, capsys, monkeypatch,
                                                            hf_dir, file, template, needles):
    from hf_fixtures import CHATML_TEMPLATE, write_qwen_tokenizer

    from stablerl_jax.data import chat_template
    from stablerl_jax.data.template_sandbox import RenderLimits
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_dir, ckpt)
    write_qwen_tokenizer(ckpt, chat_template=template if file == "tokenizer_config.json"
                         else CHATML_TEMPLATE)
    if file == "chat_template.jinja":
        (ckpt / file).write_text(template)  # wins over tokenizer_config.json's
    if "1 s per render" in needles[0]:  # the time bound, shortened from 10 s for the suite
        monkeypatch.setattr(chat_template, "task_template", lambda task: (
            chat_template.ChatTemplate.from_dir(task.tokenizer_dir, RenderLimits(seconds=1))))
    _refused_outside_untouched(capsys, tmp_path, ["--hf", str(ckpt), "sft.steps=0",
                                                  "task.chat_template=true"],
                               f"{ckpt / file}: the chat template ", *needles,
                               "fix the template or set task.chat_template=false")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

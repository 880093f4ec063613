"""A run survives being killed: SIGKILL mid-run and mid-checkpoint-write, then the same
command again, ends with the same parameters and the same metrics rows as a run never
interrupted; two runs with one seed write identical metrics. Ctrl-C at any point of a
checkpoint save ends the run within a stated bound, with one line, and the resume is
exact. Its workdir stays whole: a second run there is refused (a dead one's lock taken
over), a torn or shortened metrics log, a copied step directory, a failed save and a
checkpoint directory another program filled each end in the same run or in a one-line
refusal (exit 2) that changes nothing; a symlinked checkpoint directory resumes like a
plain one. The child process is tests/reliability_child.py."""
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

from stablerl_jax.model import transformer as tf
from stablerl_jax.rl.engine import Engine
from stablerl_jax.rl.inflight import Inflight
from stablerl_jax.runs import lock as run_lock
from stablerl_jax.runs.checkpoint import (
    CANCEL_WAIT_S,
    INTERRUPT_WAIT_S,
    LOG_FILE,
    Checkpointer,
)
from stablerl_jax.runs.lock import LOCK_FILE, WorkdirBusy
from stablerl_jax.runs.metrics_io import outcome, read_metrics

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


def _like(staleness=0):
    """The checkpointed state's structure (the values are irrelevant)."""
    cfg = config(staleness)
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    like = eng.init_state(tf.init_params(jax.random.key(0), cfg.model))._asdict()
    if staleness:  # the carried queue (and the past versions) are checkpointed too
        inflight = Inflight.create(cfg, PAD_ID)
        like.update(inflight=inflight.state_dict(), history=[like["params"]] * staleness)
    return like


def _final_params(workdir, staleness=0):
    like = _like(staleness)
    ck = Checkpointer(os.path.join(workdir, "checkpoints"))
    step, state, _ = ck.restore_latest(like)
    ck.close()
    assert step == STEPS
    return jax.tree.map(np.asarray, state)


def _assert_same_run(a, b, staleness=0):
    rows_a, rows_b = outcome(read_metrics(a)), outcome(read_metrics(b))
    assert [r["step"] for r in rows_b] == list(range(STEPS + 1))  # no gap, no duplicate
    assert rows_b == rows_a
    assert read_metrics(os.path.join(b, "minibatches.jsonl")) == read_metrics(
        os.path.join(a, "minibatches.jsonl"))
    jax.tree.map(np.testing.assert_array_equal, _final_params(b, staleness),
                 _final_params(a, staleness))


@pytest.mark.integration
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
# (tests/rl/inflight_test.py)
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
    assert sorted(os.listdir(in_save / "checkpoints")) == ["3", "4"]  # the remains removed
    # The summary's results (its `cost` holds wall times: rl/costs.py).
    results = lambda w: {k: v for k, v in json.loads((w / "summary.json").read_text()).items()
                         if k != "cost"}
    assert results(in_save) == results(full)


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


@pytest.mark.integration
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


# Ctrl-C: checkpoint.py's bound on the wait for the save in flight and its cancellation,
# plus 5 s for the process to end (its last device step, the one line, interpreter exit).
INTERRUPT_BOUND_S = INTERRUPT_WAIT_S + CANCEL_WAIT_S + 5


def _interrupt_in_save(workdir, data_dir, cache, aim, delay):
    """Start a run and SIGINT it `delay` seconds after its checkpoint save of step `aim`
    starts; returns (seconds from the signal to the exit, exit status, stderr)."""
    err_path = f"{workdir}.stderr"
    env = dict(os.environ, STABLERL_TEST_JAX_CACHE=str(cache), JAX_PLATFORMS="cpu")
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, CHILD, str(workdir), str(data_dir), "--say-saves"], env=env,
            stdout=subprocess.PIPE, stderr=err)
        for line in proc.stdout:  # ends early if the run does
            if line.split() == [b"SAVE", str(aim).encode()]:
                break
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        try:
            proc.wait(timeout=INTERRUPT_BOUND_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # its threads' stacks, into the stderr file
            time.sleep(3)
            proc.kill()
            proc.wait()
        took = time.monotonic() - sent
        proc.stdout.close()
    with open(err_path, encoding="utf-8", errors="replace") as f:
        return took, proc.returncode, f.read()


def _interrupted_runs(tmp_path, reference, runs: int, seed: int) -> float:
    """`runs` runs, each SIGINTed at a random point of a random step's checkpoint save:
    each exits within INTERRUPT_BOUND_S with status 130 and one line (no traceback), its
    newest complete step restores bit for bit (the interrupted step, or the one before),
    and nothing outside its workdir changes; the same command after the last one ends
    equal to the uninterrupted run. Returns the longest time from a signal to an exit."""
    full, data, cache = reference
    like = _like()
    ck = Checkpointer(str(full / "checkpoints"))
    expected = {step: ck.restore(step, like)[0] for step in ck.all_steps()}  # steps 3, 4
    ck.close()
    data_before = _snapshot(data)
    rng = np.random.default_rng(seed)
    worst = 0.0
    for i in range(runs):
        aim = int(rng.integers(1, STEPS + 1))
        # Half aim at the blocking part of orbax's save (its first ~0.1 s), half anywhere
        # in the save or just after it.
        delay = float(rng.uniform(0, 0.1 if i % 2 == 0 else 0.6))
        workdir = tmp_path / f"run{i}"
        took, rc, err = _interrupt_in_save(workdir, data, cache, aim, delay)
        where = f"run {i}, SIGINT {delay:.3f} s into the save of step {aim}"
        assert took <= INTERRUPT_BOUND_S, f"{where}: exit {took:.1f} s after it:\n{err[-8000:]}"
        worst = max(worst, took)
        assert rc == 130, f"{where}: exit status {rc}\n{err[-3000:]}"
        last = err.strip().splitlines()[-1]
        assert last == ("reliability_child.py: interrupted; run the same command again to "
                        "resume from the last complete checkpoint"), f"{where}:\n{err[-3000:]}"
        for noise in ("Traceback", "Exception ignored", "ERROR:"):
            assert noise not in err, f"{where}:\n{err[-3000:]}"
        ck = Checkpointer(str(workdir / "checkpoints"))
        steps = ck.all_steps()
        restored = ck.restore_latest(like)
        ck.close()
        names = os.listdir(workdir / "checkpoints")
        assert not [n for n in names if n.split(".")[-1].rstrip("0123456789") in (
            "corrupt", "incomplete", "unusable")], f"{where}: {names}"  # nothing set aside
        # The cancelled save's temporary directory is known as its remains, and removed.
        assert not [n for n in names if ".orbax-checkpoint-tmp" in n], f"{where}: {names}"
        if restored is None:  # interrupted before its first save committed
            assert aim == 1 and steps == [], f"{where}: {steps}"
        else:
            step = restored[0]
            assert step == steps[-1] >= aim - 1, f"{where}: restored {step} of {steps}"
            if step in expected:
                jax.tree.map(np.testing.assert_array_equal, restored[1], expected[step])
        assert sorted(os.listdir(tmp_path)) == sorted(
            [f"run{j}" for j in range(i + 1)] + [f"run{j}.stderr" for j in range(i + 1)])
    assert _snapshot(data) == data_before
    _run(workdir, data, cache)  # the same command after the last interrupt
    _assert_same_run(full, workdir)
    print(f"{runs} interrupts: the longest took {worst:.2f} s from SIGINT to exit")
    return worst


@pytest.mark.integration
def test_ctrl_c_during_a_save_ends_the_run_in_bounded_time(tmp_path, reference):
    _interrupted_runs(tmp_path, reference, runs=3, seed=0)


@pytest.mark.slow  # 20 subprocess runs; the default suite runs 3 (above)
def test_ctrl_c_during_a_save_ends_the_run_in_bounded_time_20_times(tmp_path, reference):
    _interrupted_runs(tmp_path, reference, runs=20, seed=1)


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


@pytest.mark.integration
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


@pytest.mark.integration
def test_a_lock_of_a_dead_run_is_taken_over(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from stablerl_jax.runs import lock; "
         "lock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(120)",
         str(tmp_path)], stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT))
    assert holder.stdout.readline().strip() == b"held"
    with pytest.raises(WorkdirBusy, match=f"in use by pid {holder.pid} on host "
                                          f"'{socket.gethostname()}' \\(started 20"):
        run_lock.acquire(str(tmp_path))
    holder.kill()
    holder.wait()
    with caplog.at_level("WARNING"):
        path = run_lock.acquire(str(tmp_path))
    assert f"taking over the lock of pid {holder.pid}" in caplog.text
    assert "that process is gone" in caplog.text
    assert json.loads(open(path).read())["pid"] == os.getpid()
    assert run_lock.acquire(str(tmp_path)) == path  # re-entrant within a process
    run_lock.release(path)
    assert json.loads(open(path).read())["pid"] == os.getpid()  # still held once
    run_lock.release(path)
    assert open(path).read() == ""


def _cut_metrics(workdir, row):
    """Cut metrics.jsonl in the middle of row `row` (what follows is lost)."""
    path = workdir / "metrics.jsonl"
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(lines[:row]) + b"\n" + lines[row][: len(lines[row]) // 2])


@pytest.mark.integration
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
    log = workdir / LOG_FILE
    _one_line_error(out, f"checkpoint {workdir / 'checkpoints' / '3'} could not be saved",
                    "File too large", "free disk space", "run the same command again",
                    f"(orbax's log of the failure: {log})")
    # Orbax's tracebacks (a few per failed save) are in the log, not on the terminal.
    assert "Traceback" not in out and "ERROR:" not in out, out[-3000:]
    assert "Traceback" in log.read_text() and "File too large" in log.read_text()
    assert os.listdir(tmp_path) == ["full_disk"]  # nothing written outside the workdir
    assert not (workdir / "checkpoints" / "3").exists()  # never a half-written step
    assert (workdir / "checkpoints" / "3.orbax-checkpoint-tmp").is_dir()
    _run(workdir, data, cache)  # the same command, with room on the disk
    _assert_same_run(full, workdir)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "4"]  # the remains removed


def _contents(path):
    """Every entry under `path`: name, kind, bytes and mtime."""
    out = []
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        out.append((str(p.relative_to(path)), p.is_dir(), st.st_mtime_ns,
                    p.read_bytes() if p.is_file() else None))
    return out


@pytest.mark.integration
def test_a_checkpoint_directory_another_program_filled_is_left_untouched(tmp_path, reference):
    """`checkpoints/` a symlink to a directory that already holds step-named folders the
    run did not write: they are named in one warning and never renamed, deleted or
    overwritten; the save of step 1, whose name one of them holds, stops the run (exit 2,
    one line)."""
    _, data, cache = reference
    theirs = tmp_path / "shared_disk"
    for name in ("1", "2", "3", "7"):
        (theirs / name / "part").mkdir(parents=True)
        (theirs / name / "part" / "weights.bin").write_bytes(os.urandom(4096))
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "checkpoints").symlink_to(theirs)
    before = _contents(theirs)
    rc, out = _finish(_start(workdir, data, cache))
    assert rc == 2, out[-3000:]
    where = workdir / "checkpoints" / "1"
    _one_line_error(out, f"checkpoint {where} could not be saved: {where} exists and was not "
                    "written by these checkpoints", "move it out of")
    warned = [line for line in out.splitlines() if "did not write" in line]
    assert len(warned) == 1 and warned[0].endswith(
        "left untouched: 1, 2, 3, 7 (a save of a step named there stops the run instead of "
        "overwriting it)"), out[-3000:]
    assert _contents(theirs) == before  # byte for byte, not even touched
    assert sorted(os.listdir(tmp_path)) == ["run", "shared_disk"]


@pytest.mark.integration
def test_a_symlinked_checkpoint_directory_resumes_like_a_plain_one(tmp_path, reference):
    """`checkpoints/` a symlink to an empty directory on another disk: killed mid-run and
    resumed, the run ends equal bit for bit to the uninterrupted one, writing its steps
    there and nothing else outside the workdir."""
    full, data, cache = reference
    disk = tmp_path / "bigger_disk" / "ckpts"
    disk.mkdir(parents=True)
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "checkpoints").symlink_to(disk)
    _kill_after_row(workdir, data, cache, step=2)
    rc, out = _finish(_start(workdir, data, cache))
    assert rc == 0, out[-3000:]
    assert "did not write" not in out and "Traceback" not in out
    _assert_same_run(full, workdir)
    assert (workdir / "checkpoints").is_symlink()
    assert sorted(os.listdir(disk)) == [str(STEPS - 1), str(STEPS)]
    assert sorted(os.listdir(tmp_path)) == ["bigger_disk", "run"]
    assert os.listdir(tmp_path / "bigger_disk") == ["ckpts"]

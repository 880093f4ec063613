"""The run lock of a workdir in a Cloud Storage bucket (runs/lock.py over
runs/storage_gcs.py), against the emulator (tests/conftest.py), which honors the
generation preconditions the lock relies on: a second run is refused naming the holder,
a dead run's lock and a stale one are taken over (and the stale holder stops), and of
runs racing for one lock one wins. The holders are separate processes."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from stablerl_jax.runs import lock as run_lock
from stablerl_jax.runs import storage_gcs
from stablerl_jax.runs.lock import LOCK_FILE, WorkdirBusy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _holder(workdir, heartbeat_s=60.0):
    """A process that takes the lock of `workdir`, prints 'held', and then checks every
    50 ms that it still holds it: it prints the error and exits 3 once it does not."""
    code = ("import sys, time; from stablerl_jax.runs import lock as w; "
            "w.HEARTBEAT_S = float(sys.argv[2]); w.acquire(sys.argv[1]); "
            "print('held', flush=True)\n"
            "for _ in range(2400):\n"
            "    try: w.check_held()\n"
            "    except w.WorkdirBusy as e: print(e, flush=True); sys.exit(3)\n"
            "    time.sleep(0.05)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, workdir, str(heartbeat_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.stdout.readline().strip() == b"held"
    return proc


def _holder_of(lock: str) -> dict:
    return json.loads(storage_gcs.read_object(lock).data)


@pytest.mark.integration  # the storage emulator is a process
def test_a_second_run_is_refused_and_a_dead_runs_lock_is_taken_over(bucket, caplog):
    run = f"{bucket}/run"
    holder = _holder(run)
    lock = f"{run}/{LOCK_FILE}"
    with pytest.raises(WorkdirBusy, match=f"^workdir '{run}' is in use by pid {holder.pid} "
                                          f"on host '{socket.gethostname()}' \\(started 20"
                                          r".*another --workdir$") as e:
        run_lock.acquire(run)
    assert "\n" not in str(e.value)
    assert _holder_of(lock)["pid"] == holder.pid  # untouched
    holder.kill()  # SIGKILL: no release, the object stays
    holder.wait()
    with caplog.at_level("WARNING"):
        path = run_lock.acquire(run)
    assert path == lock
    assert f"taking over the lock of pid {holder.pid}" in caplog.text
    assert "that process is gone" in caplog.text
    assert _holder_of(lock)["pid"] == os.getpid()
    assert run_lock.acquire(run + "/") == path  # re-entrant within a process
    run_lock.release(path)
    assert _holder_of(lock)["pid"] == os.getpid()  # still held once
    run_lock.release(path)
    assert storage_gcs.read_object(lock) is None  # released: deleted


@pytest.mark.integration  # the storage emulator is a process
def test_a_stale_lock_is_taken_over_and_its_holder_stops(bucket, caplog, monkeypatch):
    """A live holder that stops renewing (SIGSTOP: a hung process) is taken over once its
    lock is older than STALE_AFTER_S; resumed, it finds out at its next renewal and
    stops, without touching the new holder's lock."""
    run = f"{bucket}/run"
    monkeypatch.setattr(run_lock, "STALE_AFTER_S", 1.0)
    holder = _holder(run, heartbeat_s=0.2)
    try:
        with pytest.raises(WorkdirBusy, match="lock renewed 0 s ago"):
            run_lock.acquire(run)  # alive and renewing: refused
        holder.send_signal(signal.SIGSTOP)
        time.sleep(1.6)
        with caplog.at_level("WARNING"):
            path = run_lock.acquire(run)
        assert f"taking over the lock of pid {holder.pid} on host" in caplog.text
        assert re.search(r"its lock was last renewed \d+ s ago \(> 1 s\)", caplog.text)
        ours = storage_gcs.read_object(path)
        holder.send_signal(signal.SIGCONT)
        out, _ = holder.communicate(timeout=60)
        assert holder.returncode == 3, out
        assert (f"workdir '{run}': the run lock was taken over by pid {os.getpid()} on host"
                in out.decode()), out
        assert storage_gcs.read_object(path).generation == ours.generation  # not clobbered
        run_lock.check_held()  # ours is still held
        run_lock.release(path)
        assert storage_gcs.read_object(path) is None
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.integration  # the storage emulator is a process
def test_of_runs_racing_for_one_lock_one_wins(bucket):
    """Three processes take the lock at once: the create-if-absent precondition lets one
    win; the others are refused naming it."""
    run = f"{bucket}/run"
    code = ("import sys; from stablerl_jax.runs import lock as w\n"
            "try: w.acquire(sys.argv[1]); print('won', flush=True); sys.stdin.read()\n"
            "except w.WorkdirBusy as e: print(e, flush=True)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, run], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT))
             for _ in range(3)]
    lines = [p.stdout.readline().decode().strip() for p in procs]
    for p in procs:
        p.communicate(b"")
    winner = [p.pid for p, line in zip(procs, lines) if line == "won"]
    assert len(winner) == 1, lines
    assert all(f"is in use by pid {winner[0]} on host" in line for line in lines
               if line != "won"), lines

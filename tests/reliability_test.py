"""A run survives being killed: SIGKILL mid-run and mid-checkpoint-write, then the same
command again, ends with the same parameters and the same metrics rows as a run never
interrupted; two runs with one seed write identical metrics. The child process is
tests/reliability_child.py."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
from reliability_child import STEPS, config
from rl_helpers import EOS_ID, PAD_ID

from stablerl_jax.checkpoint import Checkpointer
from stablerl_jax.metrics_io import read_metrics
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl.engine import Engine

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reliability_child.py")


def _start(workdir, data_dir, cache, *extra):
    env = dict(os.environ, STABLERL_TEST_JAX_CACHE=str(cache), JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, CHILD, str(workdir), str(data_dir), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(errors="replace")


def _run(workdir, data_dir, cache, *extra):
    rc, out = _finish(_start(workdir, data_dir, cache, *extra))
    assert rc == 0, out[-3000:]


def _kill_after_row(workdir, data_dir, cache, step):
    """Start a run and SIGKILL it as soon as its metrics row `step` is on disk."""
    proc = _start(workdir, data_dir, cache)
    path = os.path.join(workdir, "metrics.jsonl")
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] >= step for r in read_metrics(path)):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    rc, out = _finish(proc)
    assert rc == -signal.SIGKILL, f"the run ended on its own (rc {rc}):\n{out[-2000:]}"


def _final_params(workdir):
    cfg = config()
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    like = eng.init_state(tf.init_params(jax.random.key(0), cfg.model))
    ck = Checkpointer(os.path.join(workdir, "checkpoints"))
    step, state, _ = ck.restore_latest(like._asdict())
    ck.close()
    assert step == STEPS
    return jax.tree.map(np.asarray, state)


def _assert_same_run(a, b):
    rows_a, rows_b = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in rows_b] == list(range(STEPS + 1))  # no gap, no duplicate
    assert rows_b == rows_a
    assert read_metrics(os.path.join(b, "minibatches.jsonl")) == read_metrics(
        os.path.join(a, "minibatches.jsonl"))
    jax.tree.map(np.testing.assert_array_equal, _final_params(b), _final_params(a))


def test_killed_runs_resume_to_the_uninterrupted_run(tmp_path):
    data, cache = tmp_path / "data", tmp_path / "jax_cache"
    full = tmp_path / "full"
    _run(full, data, cache)
    # Determinism: the same command twice writes the same metrics, bit for bit.
    again = tmp_path / "again"
    _run(again, data, cache)
    assert read_metrics(again) == read_metrics(full)

    # SIGKILL mid-run, after step 2's row, then the same command again.
    mid = tmp_path / "mid"
    _kill_after_row(mid, data, cache, step=2)
    _run(mid, data, cache)
    _assert_same_run(full, mid)

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


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    """Whatever is wrong with the newest step (truncated, zero-filled, a flipped byte, a
    missing file, garbage metadata), the resume uses the newest step that restores with
    matching checksums, says so, and moves the bad step aside."""
    data, cache = tmp_path / "data", tmp_path / "jax_cache"
    _run(tmp_path / "finished", data, cache)
    cfg = config()
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    like = eng.init_state(tf.init_params(jax.random.key(0), cfg.model))._asdict()
    for damage in ("truncate", "zero", "flip", "delete", "metadata"):
        ckpts = tmp_path / damage
        shutil.copytree(tmp_path / "finished" / "checkpoints", ckpts)
        _damage(ckpts / str(STEPS), damage)
        ck = Checkpointer(str(ckpts))
        caplog.clear()
        with caplog.at_level("WARNING"):
            step, _, _ = ck.restore_latest(like)
        ck.close()
        assert step == STEPS - 1, damage
        assert (ckpts / f"{STEPS}.corrupt").is_dir()
        assert "does not restore" in caplog.text, damage

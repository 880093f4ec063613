"""One experiment across processes (jax.distributed, Gloo on CPU): 2 processes × 4 CPU
devices run the tiny preset on a (data=2, fsdp=2, expert=2) mesh (expert parallel, the
sampler in its serving layout: weights resharded across the processes once per sample
call) and end where one process with 8 devices ends; a 2-process run resumes from its checkpoint; a process whose peer dies
stops with a clear error instead of hanging. The runs are float64 so that the comparison
is about the program, not about the order of float32 sums in the two collectives."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import cpu_devices
from multihost_child import config
from rl_helpers import EOS_ID, PAD_ID
from tolerance import assert_close, backward_chain

from stablerl_jax.model import transformer as tf
from stablerl_jax.rl.engine import Engine
from stablerl_jax.rl.inflight import Inflight
from stablerl_jax.runs.checkpoint import Checkpointer
from stablerl_jax.runs.metrics_io import outcome, read_metrics

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_child.py")
pytestmark = pytest.mark.slow  # ~3 minutes of processes on 2 cores


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(workdir, steps, num_processes, cache, staleness=0):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_X64="1",
               STABLERL_TEST_JAX_CACHE=str(cache),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // num_processes}")
    port = str(_port())
    return [subprocess.Popen([sys.executable, CHILD, str(workdir), str(steps), str(i),
                              str(num_processes), port, str(staleness)], env=env,
                             stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
            for i in range(num_processes)]


def _wait(procs, timeout=600):
    out = []
    for p in procs:
        o, _ = p.communicate(timeout=timeout)
        out.append((p.returncode, o.decode(errors="replace")))
    return out


def _run(workdir, steps, num_processes, cache, staleness=0):
    for rc, out in _wait(_start(workdir, steps, num_processes, cache, staleness)):
        assert rc == 0, out[-3000:]


def _final_params(workdir, steps, staleness=0):
    """The parameters of a run's last checkpoint (float64), restored in this process onto
    the run's (2, 2, 2) mesh of 8 CPU devices."""
    with jax.enable_x64(True):
        cfg = config(steps, staleness)
        eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID, devices=cpu_devices())
        like = eng.init_state(tf.init_params(jax.random.key(0), cfg.model))._asdict()
        if staleness:  # the carried queue and past versions are in the checkpoint too
            like.update(inflight=Inflight.create(cfg, PAD_ID).state_dict(),
                        history=[like["params"]] * staleness)
        ck = Checkpointer(os.path.join(workdir, "checkpoints"))
        state, _ = ck.restore(steps, like)
        ck.close()
        return jax.tree.map(np.asarray, state["params"])


def _assert_same_run(single, multi, steps, staleness=0):
    """Metrics rows (sampled counts and rewards exact, the rest within the float64 bound
    of sums over the two collectives' orders) and final parameters of the two runs."""
    want, got = outcome(read_metrics(single)), outcome(read_metrics(multi))
    assert [r["step"] for r in got] == list(range(steps + 1))  # no step lost or repeated
    cfg = config(steps, staleness)
    n = backward_chain(cfg.model, cfg.task.max_prompt_len + cfg.sampling.max_new_tokens,
                       8 * 32) + 16
    for w, g in zip(want, got):
        assert set(w) == set(g)
        for k in w:
            if w[k] is None or g[k] is None:
                assert w[k] == g[k], k
            elif k.startswith(("eval/", "reward", "response_length", "async/")):
                assert g[k] == w[k], k  # counts of sampled tokens and rewards: exact
            else:  # ratios of sums of ≤ 400-sized per-token terms (steps_test)
                assert_close(g[k], w[k], n=n, dtype="float64", scale=400.0, err_msg=k)
    for a, b in zip(jax.tree.leaves(_final_params(multi, steps, staleness)),
                    jax.tree.leaves(_final_params(single, steps, staleness))):
        assert_close(a, b, n=3 * n, dtype="float64", cond=256, scale="max")


def test_two_processes_equal_one_and_resume(tmp_path):
    cache = tmp_path / "jax_cache"
    single, multi = tmp_path / "single", tmp_path / "multi"
    _run(single, 3, 1, cache)
    _run(multi, 2, 2, cache)  # stops after 2 steps ...
    rows = read_metrics(multi)
    assert [r["step"] for r in rows] == [0, 1, 2]
    _run(multi, 3, 2, cache)  # ... and resumes from its checkpoint for the third
    _assert_same_run(single, multi, 3)
    # Only the first process wrote the run's files.
    assert json.loads((multi / "summary.json").read_text())["steps"] == 3
    assert len(read_metrics(os.path.join(multi, "minibatches.jsonl"))) == 3


def test_partial_rollouts_on_two_processes_equal_one(tmp_path):
    # rl.max_staleness=1: each process holds the whole carried queue and samples its
    # block of it; 2 × 4 devices end where 1 × 8 ends, through a resume.
    cache = tmp_path / "jax_cache"
    single, multi = tmp_path / "single", tmp_path / "multi"
    _run(single, 4, 1, cache, staleness=1)
    _run(multi, 2, 2, cache, staleness=1)
    _run(multi, 4, 2, cache, staleness=1)
    # Responses carried over from step 3 (the first with lengths short of the cap).
    assert max(r.get("async/staleness_max", 0) for r in read_metrics(single)) == 1
    _assert_same_run(single, multi, 4, staleness=1)


def test_a_dead_peer_stops_the_run_with_a_clear_error(tmp_path):
    procs = _start(tmp_path / "run", 200, 2, tmp_path / "jax_cache")
    deadline = time.time() + 600
    while time.time() < deadline and not read_metrics(str(tmp_path / "run")):
        assert all(p.poll() is None for p in procs), _wait(procs)
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.time()
    rc, out = _wait(procs[:1], timeout=180)[0]
    procs[1].wait()
    assert rc != 0 and time.time() - t0 < 120
    assert "another task died" in out or "heartbeat" in out.lower(), out[-3000:]

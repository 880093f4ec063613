"""libtpu on a host without a TPU (stablerl_jax/pod/libtpu_env.py): the entry points start
quietly, and a host with TPU chips is left as it is."""
import os
import subprocess
import sys

import pytest

from stablerl_jax.pod import libtpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def clean_env():
    """No libtpu settings during the test; the process's own restored after it."""
    saved = {k: os.environ.pop(k) for k in libtpu_env.QUIET_ENV if k in os.environ}
    yield
    for k in libtpu_env.QUIET_ENV:
        os.environ.pop(k, None)
    os.environ.update(saved)


def test_quiet_settings_only_without_tpu_chips(clean_env):
    assert not libtpu_env.quiet_libtpu(chips=4)  # a TPU host: its real chips are used
    assert not any(k in os.environ for k in libtpu_env.QUIET_ENV)
    os.environ["TPU_ACCELERATOR_TYPE"] = "v4-8"  # a value already set wins
    assert libtpu_env.quiet_libtpu(chips=0)
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v4-8"
    assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"
    assert os.environ["TPU_SKIP_MDS_QUERY"] == "1"


@pytest.mark.integration
def test_an_entry_point_starts_its_backend_quietly():
    # What `python -m experiments.<name>` does first (import the package), then start
    # JAX's backends, as every run does; without a TPU no libtpu trace may reach stderr.
    env = {k: v for k, v in os.environ.items() if k not in libtpu_env.QUIET_ENV}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    script = ("import os, experiments, jax\n"
              "from stablerl_jax.pod.libtpu_env import tpu_chips\n"
              "print(jax.default_backend(), tpu_chips(), os.environ.get('TPU_SKIP_MDS_QUERY'))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    backend, chips, skip = out.stdout.split()
    if int(chips) == 0:
        assert skip == "1" and backend != "tpu"
        assert "TPU_WORKER_HOSTNAMES" not in out.stderr, out.stderr[-2000:]
        assert "libtpu" not in out.stderr, out.stderr[-2000:]
    else:  # a TPU host: nothing was set, the chips are the backend
        assert skip == "None" and backend == "tpu"


@pytest.mark.tpu
def test_two_processes_start_libtpu_side_by_side_without_a_tpu():
    # An experiment holds its backend while an AOT compile (or `pytest -m tpu`) starts
    # another: without TPU chips, libtpu's multi-process lock must not stop the second.
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)
    env = {k: v for k, v in os.environ.items() if k not in libtpu_env.QUIET_ENV}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    hold = ("import sys, experiments, jax\n"
            "jax.devices()\nprint('up', flush=True)\nsys.stdin.read()")
    first = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert first.stdout.readline().strip() == "up"
        second = subprocess.run(
            [sys.executable, "-c", "import experiments\nfrom stablerl_jax.pod import aot\n"
             "print(len(aot.devices(aot.topology('v5p-8'))))"],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert second.returncode == 0, second.stderr[-2000:]
        assert second.stdout.split()[-1] == "4"
    finally:
        first.communicate("", timeout=120)

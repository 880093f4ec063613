"""Bad tracker settings and installs, each refused with one line naming the fix before
any training (stablerl_jax/runs/trackers.py): wandb's online mode without an API key, a
tracker package that fails as it imports, an MLflow tracking server that does not reply
(refused within a stated bound, where MLflow's own retries take minutes). The command
line cases run `experiments.train`, which opens its trackers as the cold start
begins; a case that reached training would fail here (tests/tiers.py refuses a run in
this tier)."""
import http.server
import json
import os
import re
import socket
import sys
import threading
import time

import pytest

from experiments import train
from stablerl_jax.runs import trackers as trk

# Imported here, at collection: a first import of mlflow runs `uname -p` (its telemetry
# asks platform.platform()), a child process that tests/tiers.py refuses in a test.
wandb = pytest.importorskip("wandb")
pytest.importorskip("mlflow.tracking")
pytest.importorskip("mlflow.utils.rest_utils")

SMALL = ["task.num_train=64", "task.num_test=16", "rl.eval_problems=16"]  # data made quickly
# The check is that a refusal comes within a bound, not how fast: a slow CI machine gets
# this much beyond the bound the code states.
SLACK_S = 10.0


def _cli(tmp_path, *argv):
    workdir = tmp_path / "run"
    return ["--workdir", str(workdir), "--quiet", "--compile-cache=", *argv, *SMALL]


def _error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [ln for ln in err.splitlines() if "error:" in ln]


# wandb: online mode needs an API key, found by wandb's own lookup without network.
@pytest.fixture
def wandb_without_key(tmp_path, monkeypatch):
    """No W&B credentials anywhere wandb looks: no WANDB_API_KEY, an empty home, config
    directory and netrc; wandb's global settings read afresh (wandb.teardown), without
    asking git for the program's repository (a child process)."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DIR",
                "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))
    monkeypatch.setenv("NETRC", str(home / "netrc"))
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.wandb.ai")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.chdir(tmp_path)  # no workspace settings file (./wandb/settings)
    wandb.teardown()
    yield home
    wandb.teardown()


def _open_wandb(workdir):
    wandb.teardown()  # settings as the environment now says
    tracker = trk.Trackers(("wandb",), str(workdir))
    tracker.close()  # nothing was opened: the wandb run starts at the first record
    return tracker


def test_wandb_online_without_an_api_key_is_one_line_before_the_cold_start(
        tmp_path, capsys, wandb_without_key):
    with pytest.raises(SystemExit) as e:
        train.main(_cli(tmp_path, "--tracker", "tensorboard,wandb"))
    assert e.value.code == 2
    err = _error_lines(capsys)
    assert len(err) == 1, err
    for needle in ("tracker 'wandb': no W&B API key for https://api.wandb.ai",
                   "set WANDB_API_KEY or run `wandb login`", "WANDB_MODE=offline",
                   "--traceback for the full traceback"):
        assert needle in err[0], (needle, err)
    assert not (tmp_path / "run" / "sft_run").exists()  # no tracker state, no SFT run


def test_wandb_needs_a_key_only_online_and_takes_it_from_env_or_netrc(
        tmp_path, wandb_without_key, monkeypatch):
    workdir = tmp_path / "run"
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ValueError, match=r"^tracker 'wandb': no W&B API key for "
                                         r"https://api.wandb.ai, which wandb's online mode "
                                         r"needs: set WANDB_API_KEY .* WANDB_MODE=offline"):
        _open_wandb(workdir)
    for mode in ("offline", "dryrun", "disabled"):  # as before: no key needed
        monkeypatch.setenv("WANDB_MODE", mode)
        assert _open_wandb(workdir).enabled
    monkeypatch.setenv("WANDB_MODE", "online")
    key = "k" * 40
    (wandb_without_key / "netrc").parent.mkdir(parents=True, exist_ok=True)
    (wandb_without_key / "netrc").write_text(f"machine api.wandb.ai login user password {key}\n")
    (wandb_without_key / "netrc").chmod(0o600)
    assert _open_wandb(workdir).enabled  # `wandb login`'s netrc entry
    (wandb_without_key / "netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", key)
    assert _open_wandb(workdir).enabled
    monkeypatch.setenv("WANDB_API_KEY", "short")
    with pytest.raises(ValueError, match=r"^tracker 'wandb': the W&B credentials for "
                                         r"https://api.wandb.ai are not valid "
                                         r"\(AuthenticationError: .*40\+ characters.*\); set "
                                         r"WANDB_API_KEY"):
        _open_wandb(workdir)
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "offlne")
    with pytest.raises(ValueError, match=r"^tracker 'wandb': wandb refuses its settings "
                                         r"\(ValidationError: .*mode.*'offlne'.*\); fix the "
                                         r"variable WANDB_<SETTING>"):
        _open_wandb(workdir)
    assert not workdir.exists()


# A tracker package that fails as it imports, other than by being absent.
BROKEN = [  # (the package's __init__.py, the error as the line gives it)
    pytest.param("raise RuntimeError('half-installed\\nsee the log')",
                 "RuntimeError: half-installed see the log", id="RuntimeError, two lines"),
    pytest.param("raise AttributeError(\"module 'numpy' has no attribute 'float'\")",
                 "AttributeError: module 'numpy' has no attribute 'float'", id="AttributeError"),
    pytest.param("import stablerl_no_such_dependency", "ModuleNotFoundError: No module named "
                 "'stablerl_no_such_dependency'", id="a dependency missing"),
]


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
@pytest.mark.parametrize("init, error", BROKEN)
def test_a_package_that_fails_to_import_is_one_line_naming_it(tmp_path, capsys, monkeypatch,
                                                              name, init, error):
    (tmp_path / "site" / name).mkdir(parents=True)
    (tmp_path / "site" / name / "__init__.py").write_text(init + "\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, name, raising=False)  # imported afresh: the broken one
    with pytest.raises(SystemExit) as e:
        train.main(_cli(tmp_path, "--tracker", f"tensorboard,{name}"))
    assert e.value.code == 2
    err = _error_lines(capsys)
    assert err == [f"{os.path.basename(sys.argv[0])}: error: argument --tracker: tracker "
                   f"{name!r}: the {name} package fails to import ({error}); reinstall it "
                   f"(uv pip install -e '.[{name}]') or leave {name} out of --tracker"], err
    assert not (tmp_path / "run").exists()


# MLflow: a tracking server that does not reply is refused within the stated bound.
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again as the block ends: nothing listens


@pytest.fixture
def mlflow_env(monkeypatch):
    """MLFLOW_EXPERIMENT_NAME unset (MLflow's modules are imported above: an import
    takes seconds on a busy machine, outside the clock of a bound)."""
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


def _refused_within(bound_s: float, workdir, match: str) -> float:
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match):
        trk.Trackers(("mlflow",), str(workdir))
    took = time.monotonic() - t0
    assert took < bound_s + SLACK_S, took
    return took


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_error(404)  # any reply is a server that is there

    def log_message(self, *args):
        pass


def test_an_mlflow_server_not_listening_is_one_line_within_the_bound_others_open(
        tmp_path, monkeypatch, mlflow_env):
    uri = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    _refused_within(trk._MLFLOW_PROBE_S, tmp_path / "run", (
        rf"^the mlflow tracking server {re.escape(uri)} \(MLFLOW_TRACKING_URI\) fails a "
        rf"{trk._MLFLOW_PROBE_S} s reachability check \(ConnectionRefusedError: .*\); start "
        r"it, or set "
        r"MLFLOW_TRACKING_URI to a running server, sqlite:///mlflow.db or a file:// store$"))
    assert not (tmp_path / "run").exists()
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)  # a server that replies
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.server_port}")
        assert trk.Trackers(("mlflow",), str(tmp_path / "run")).enabled
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # no probe
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert trk.Trackers(("mlflow",), str(tmp_path / "run")).enabled


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_an_mlflow_server_that_never_replies_is_refused_within_the_bound(
        tmp_path, monkeypatch, mlflow_env, scheme):
    # Connected (the kernel accepts into the backlog) but never answered: the probe's
    # read timeout, made 1 s here, ends it.
    monkeypatch.setattr(trk, "_MLFLOW_PROBE_S", 1)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        uri = f"{scheme}://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        _refused_within(1, tmp_path / "run", rf"^the mlflow tracking server {re.escape(uri)} "
                                             r"\(MLFLOW_TRACKING_URI\) fails a 1 s "
                                             r"reachability check \(.*timed out.*\); start "
                                             r"it")


def test_an_mlflow_server_a_resumed_run_recorded_names_trackers_json(tmp_path, monkeypatch,
                                                                     mlflow_env):
    workdir = tmp_path / "run"
    workdir.mkdir()
    uri = f"http://127.0.0.1:{_closed_port()}"
    state = {"mlflow": {"run_id": "0" * 32, "tracking_uri": uri, "experiment": trk.PROJECT}}
    (workdir / "trackers.json").write_text(json.dumps(state))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # not used
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    path = os.path.join(workdir, "trackers.json")
    _refused_within(trk._MLFLOW_PROBE_S, workdir, (
        rf"^the mlflow tracking server {re.escape(uri)} \(recorded in {re.escape(path)} for "
        r"this run\) fails a .*; start it, or delete that file's \"mlflow\" entry to log "
        r"to a new run$"))
    assert json.loads((workdir / "trackers.json").read_text()) == state  # left as it was


def test_an_mlflow_server_not_listening_is_one_line_before_the_cold_start(
        tmp_path, capsys, monkeypatch, mlflow_env):
    uri = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(SystemExit) as e:
        train.main(_cli(tmp_path, "--tracker", "mlflow"))
    assert e.value.code == 2
    err = _error_lines(capsys)
    assert len(err) == 1 and f"error: the mlflow tracking server {uri} (MLFLOW_TRACKING_URI) " \
        f"fails a {trk._MLFLOW_PROBE_S} s reachability check" in err[0], err
    assert "--traceback for the full traceback" in err[0]
    assert not (tmp_path / "run" / "sft_run").exists()

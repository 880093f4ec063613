"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow.

`Trackers` mirrors a run beside `<workdir>/metrics.jsonl`, the source of truth (metrics_io.py):
metrics rows (`log`), flat config (`log_config`), samples (`log_samples`: a wandb.Table; MLflow
JSON `samples/step_<step>.json`, an object per row), PNG plots (`log_plots`: wandb images;
MLflow `plots/` artifacts). TensorBoard is metrics_io.MetricsWriter's, on if `tensorboard` is
listed. Only the first process logs (`enabled`); others import nothing.

Settings are each library's own: wandb's WANDB_PROJECT (default "stablerl_jax"), WANDB_ENTITY,
WANDB_MODE (online, the default; offline; disabled), WANDB_BASE_URL and WANDB_DIR (default: the
workdir; wandb's own ./wandb for a gs:// one); MLflow's MLFLOW_TRACKING_URI (a tracking server;
`sqlite:///mlflow.db`, the full `mlflow` package's default; or a `file://` store, which MLflow 3
opens only with MLFLOW_ALLOW_FILE_STORE=true) and MLFLOW_EXPERIMENT_NAME (default
"stablerl_jax"). A bad setting is one line (ValueError) before any training: as the command line
is parsed, a tracker package that does not import (missing or broken); as the Trackers open,
wandb's online mode without an API key (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE or the netrc
entry `wandb login` writes, looked up without network; other modes need none) or an http(s)
tracking server silent for _MLFLOW_PROBE_S = 5 s (MLflow's own calls retry for minutes). MLflow
metric names allow no "@": `avg@k` is logged as `avg_at_k` (`mlflow_key`).

Resume continues the same tracker runs: `<workdir>/trackers.json` holds each tracker's run id
(with MLflow's tracking URI and wandb's project, whatever the environment says later) and the
last step given per kind of record (metrics, samples, plots). A tracker cannot delete points, so
the steps a resumed loop logs again (after its checkpoint, up to the recorded one;
MetricsWriter.truncate_after drops them from the JSONL) are skipped: each step reaches a tracker
once, with the killed run's values (the same bits on CPU, where a resume is exact). Recorded
before logged: a kill in between loses the point, never doubles it."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import pathlib
import re
import secrets
import ssl
import time
import urllib.parse

from stablerl_jax.runs import storage
from stablerl_jax.runs.metrics_io import refuse_link

NAMES = ("tensorboard", "wandb", "mlflow")
PROJECT = "stablerl_jax"  # wandb project / MLflow experiment unless the environment names one
_OWN = ("wandb", "mlflow")  # the trackers this module logs to (TensorBoard: MetricsWriter)
_MLFLOW_PARAM_LEN = 6000  # MLflow's limit on a param value (mlflow.utils.validation)
_MLFLOW_PROBE_S = 5  # seconds a tracking server has to accept, then to reply (probe)


def parse(spec: str) -> tuple[str, ...]:
    """Tracker names from a comma-separated list of NAMES, or "none" (not even TensorBoard)."""
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    if names == ("none",):
        return ()
    check_names(names)
    if not names:
        raise ValueError(f"tracker list {spec!r} is empty; give a comma-separated subset of "
                         f"{', '.join(NAMES)}, or none")
    return names


def check_names(names) -> None:
    bad = [n for n in names if n not in NAMES]
    if bad:
        raise ValueError(f"tracker {', '.join(map(repr, bad))} is unknown; choose a "
                         f"comma-separated subset of {', '.join(NAMES)}, or none")


def check(names) -> None:
    """ValueError (one line, naming the fix) for an unknown name or a tracker package missing or
    broken (any exception on import, or a module it imports missing); checked before any work."""
    check_names(names)
    for name in names:
        if name in _OWN:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name != name:  # the package is there, a module it imports is not
                    raise ValueError(_broken(name, e)) from None
                raise ValueError(f"tracker {name!r}: the {name} package is not installed; "
                                 f"pip install 'stablerl_jax[{name}]'") from None
            except Exception as e:  # a broken install fails as it imports, in any way
                raise ValueError(_broken(name, e)) from None


def _broken(name: str, e: Exception) -> str:
    return (f"tracker {name!r}: the {name} package fails to import ({_brief(e)}); "
            f"reinstall it (uv pip install -e '.[{name}]') or leave {name} out of --tracker")


def _brief(e: BaseException) -> str:
    """`Type: message` of an exception, on one line."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def add_argument(ap) -> None:
    """An entry point's `--tracker NAMES` flag, its names checked (`parse`, `check`) as the
    command line is parsed: a bad one is one line before any work."""
    def names(spec: str) -> tuple[str, ...]:
        try:
            out = parse(spec)
            check(out)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return out
    ap.add_argument("--tracker", default="tensorboard", type=names, metavar="NAMES",
                    help=f"comma-separated experiment trackers: {', '.join(NAMES)}, or none "
                         "(default: tensorboard; metrics.jsonl is always written)")


def mlflow_key(name: str) -> str:
    """MLflow-safe name: "@" → "_at_", chars outside letters, digits, `_ - . / space` → "_"."""
    return re.sub(r"[^\w./ -]", "_", name.replace("@", "_at_"))


class Trackers:
    """The wandb / MLflow runs of one training run in `workdir` (module docstring). `names`: any
    of NAMES; `.tensorboard`: whether the run's MetricsWriter writes TensorBoard (its job).
    Tracker runs open at the first record, so a run refused earlier leaves no trace there. A
    context manager: leaving closes the runs, failed on an exception (killed on Ctrl-C)."""

    def __init__(self, names, workdir: str, *, run_name: str = "", enabled: bool = True):
        check_names(names)
        self.tensorboard = "tensorboard" in names  # MetricsWriter's, asked for or not
        own = [n for n in NAMES if n in _OWN and n in names]
        self.enabled = enabled and bool(own)
        self.path = os.path.join(workdir, "trackers.json")
        self.workdir, self.run_name = workdir, run_name
        self._backends: list | None = None  # None: not opened yet
        if not self.enabled:
            return
        check(own)
        self.state = _read_state(self.path)
        # Connected now, so a tracking store that cannot open fails before any training.
        self._clients = {n: _BACKENDS[n](self.state.setdefault(n, {}), self.path)
                         for n in own}

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("finished" if exc_type is None else
                   "killed" if issubclass(exc_type, KeyboardInterrupt) else "failed")

    def log(self, step: int, row: dict) -> None:
        """A MetricsWriter.write row (floats; None values, "step" skipped), logged at `step`."""
        scalars = {k: float(v) for k, v in row.items() if k != "step" and v is not None}
        self._each("metrics", step, lambda b: b.metrics(step, scalars))

    def log_config(self, flat: dict) -> None:
        """The run's flat config ({"section.field": value}); call once per session."""
        if self.enabled:
            for b in self._open():
                b.config(flat)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """Decoded samples of `step` as one table (columns: every row's keys, in order)."""
        if rows:
            self._each("samples", step, lambda b: b.samples(step, rows))

    def log_plots(self, step: int, paths: list[str]) -> None:
        """PNG plots (metrics_io.plot_metrics' paths), each under its file name."""
        if paths:
            self._each("plots", step, lambda b: b.plots(step, paths))

    def close(self, status: str = "finished") -> None:
        """End the tracker runs (status: finished, failed or killed); idempotent."""
        if self.enabled and self._backends is not None:
            for b in self._backends:
                b.close(status)
        self._backends = []

    def _open(self) -> list:
        if self._backends is None:
            self._backends = []
            for client in self._clients.values():
                self._backends.append(client)  # before start: close() ends what started
                client.start(self.run_name, self.workdir, self._save)
        return self._backends

    def _each(self, kind: str, step: int, log) -> None:
        if not self.enabled:
            return
        due = []
        for b in self._open():
            logged = b.entry.setdefault("logged", {})
            if step > logged.get(kind, -1):  # steps up to it were logged by an earlier run
                logged[kind] = int(step)
                due.append(b)
        if due:
            self._save()  # before logging: a kill in between loses a point, never doubles it
        for b in due:
            log(b)

    def _save(self) -> None:
        refuse_link(self.path)
        storage.atomic_write(self.path, json.dumps(self.state, indent=1))


def _read_state(path: str) -> dict:
    if not storage.exists(path):
        return {}
    try:
        state = json.loads(storage.read_text(path))
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it to log to new tracker "
                         "runs") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a JSON object; delete it to log to new tracker runs")
    return state


_WANDB_FIX = ("set WANDB_API_KEY or run `wandb login`, or set WANDB_MODE=offline to log "
              "locally (`wandb sync` uploads it later), or leave wandb out of --tracker")


class _Wandb:
    """A wandb run. `entry`: its part of trackers.json (run_id, project, logged); `path`: that
    file (the backends' common signature; wandb's errors name no file)."""

    def __init__(self, entry: dict, path: str):
        import wandb
        self.wandb, self.entry, self.run = wandb, entry, None
        _check_wandb_login()

    def start(self, run_name: str, workdir: str, save) -> None:
        if "run_id" not in self.entry:  # recorded before the run exists: a resume reuses it
            self.entry.update(run_id=secrets.token_hex(6),  # wandb's run id alphabet
                              project=os.environ.get("WANDB_PROJECT", PROJECT))
            save()
        local = None if storage.is_remote(workdir) else workdir  # wandb writes local files
        if local:
            storage.makedirs(local)
        try:
            self.run = self.wandb.init(project=self.entry["project"],
                                       id=self.entry["run_id"], name=run_name or None,
                                       resume="allow", dir=os.environ.get("WANDB_DIR") or local)
        except self.wandb.errors.Error as e:  # UsageError, CommError, AuthenticationError
            raise ValueError(f"tracker 'wandb': wandb.init failed ({_brief(e)}); "
                             f"{_WANDB_FIX}") from None

    def metrics(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def config(self, flat: dict) -> None:
        self.run.config.update(flat, allow_val_change=True)  # a resume may change a field

    def samples(self, step: int, rows: list[dict]) -> None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
        table = self.wandb.Table(columns=columns, data=[[r.get(c) for c in columns]
                                                        for r in rows])
        self.run.log({"samples": table}, step=step)

    def plots(self, step: int, paths: list[str]) -> None:
        self.run.log({f"plots/{pathlib.Path(p).stem}": self.wandb.Image(p) for p in paths},
                     step=step)

    def close(self, status: str) -> None:
        if self.run is not None:
            # 130 = 128 + SIGINT, what a shell reports for Ctrl-C (cli_errors.py).
            self.run.finish(exit_code={"finished": 0, "killed": 130}.get(status, 1))
            self.run = None


def _check_wandb_login() -> None:
    """ValueError (one line, naming the fix) if wandb would log online without credentials
    (wandb.init would stop at its login), by wandb's own lookup without network or prompt:
    wandb.init's settings, WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, the netrc entry for
    WANDB_BASE_URL's host, an api_key setting; offline and disabled modes need none. Without it
    (no wandb.sdk.lib.wbauth) wandb.init decides; `_Wandb.start` makes its errors one line."""
    try:
        from wandb.errors import AuthenticationError
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import HostUrl, authenticate_session
    except ImportError:
        return
    try:
        settings = wandb_setup.singleton().settings  # the ones wandb.init uses
    except ValueError as e:  # pydantic's ValidationError: a WANDB_* value wandb refuses
        raise ValueError(f"tracker 'wandb': wandb refuses its settings ({_brief(e)}); fix "
                         "the variable WANDB_<SETTING> of the setting it names (WANDB_MODE: "
                         "online, offline or disabled; WANDB_BASE_URL: a URL)") from None
    if settings._noop or settings._offline:
        return
    host = HostUrl(settings.base_url, app_url=settings.app_url)
    try:
        auth = authenticate_session(host=host, source="stablerl_jax", prompt=False,
                                    update_session=False)
    except AuthenticationError as e:  # a key of the wrong form, or two sources at once
        raise ValueError(f"tracker 'wandb': the W&B credentials for {host.url} are not "
                         f"valid ({_brief(e)}); {_WANDB_FIX}") from None
    if auth is None:
        raise ValueError(f"tracker 'wandb': no W&B API key for {host.url}, which wandb's "
                         f"{settings.mode} mode needs: {_WANDB_FIX}")


class _Mlflow:
    """An MLflow run, through MlflowClient (no active-run global). `entry`: its part of
    trackers.json (run_id, tracking_uri, experiment, logged); `path`: that file."""

    def __init__(self, entry: dict, path: str):
        import mlflow
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        self.entry, self.run_id = entry, None
        uri = entry.get("tracking_uri") or mlflow.get_tracking_uri()
        if "://" not in uri and not uri.startswith(("databricks", "uc")):  # a bare path
            uri = pathlib.Path(uri).resolve().as_uri()
        try:
            self.client = MlflowClient(tracking_uri=uri)
        except (MlflowException, ImportError) as e:
            first = str(e).strip().split(". ")[0]
            raise ValueError(
                f"the mlflow tracking store {uri} cannot be opened ({first}); set "
                "MLFLOW_TRACKING_URI to a tracking server (http://host:port), install the "
                "full mlflow package for sqlite:///mlflow.db, or set "
                "MLFLOW_ALLOW_FILE_STORE=true for a file:// store") from None
        self.uri = uri
        if urllib.parse.urlsplit(uri).scheme in ("http", "https"):
            _probe_mlflow_server(uri, path if entry.get("tracking_uri") else "")

    def start(self, run_name: str, workdir: str, save) -> None:
        from mlflow.exceptions import MlflowException
        if "run_id" in self.entry:
            try:
                self.client.update_run(self.entry["run_id"], status="RUNNING")
            except MlflowException:
                raise ValueError(
                    f"{os.path.join(workdir, 'trackers.json')} names mlflow run "
                    f"{self.entry['run_id']}, which the tracking store {self.uri} does not "
                    "hold; delete the file's \"mlflow\" entry to log to a new run") from None
            self.run_id = self.entry["run_id"]
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment else
                         self.client.create_experiment(name))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name or None
                                             ).info.run_id
        self.entry.update(run_id=self.run_id, tracking_uri=self.uri, experiment=name)
        save()

    def metrics(self, step: int, scalars: dict) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(mlflow_key(k), v, now, step) for k, v in scalars.items()])

    def config(self, flat: dict) -> None:
        """Params not yet in the run: MLflow refuses to change a param's value, so a field
        a resume changed keeps its first value there (and is named in the log)."""
        from mlflow.entities import Param
        have = self.client.get_run(self.run_id).data.params
        text = {k: (v if isinstance(v, str) else json.dumps(v))[:_MLFLOW_PARAM_LEN]
                for k, v in flat.items()}
        changed = sorted(k for k, v in text.items() if k in have and have[k] != v)
        if changed:
            logging.warning("mlflow run %s keeps the first value of params %s (MLflow params "
                            "cannot change); the current config is in the checkpoints",
                            self.run_id, changed[:8])
        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in text.items()
                                                   if k not in have])

    def samples(self, step: int, rows: list[dict]) -> None:
        self.client.log_dict(self.run_id, rows, f"samples/step_{step:08d}.json")

    def plots(self, step: int, paths: list[str]) -> None:
        for p in paths:  # the same name again replaces the file: the latest plots
            self.client.log_artifact(self.run_id, p, artifact_path="plots")

    def close(self, status: str) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status.upper())
            self.run_id = None


def _probe_mlflow_server(uri: str, recorded_in: str) -> None:
    """ValueError (one line, naming the fix) unless the tracking server at `uri` answers one GET
    of /health, sent as MLflow sends (credentials, TLS, proxies) but not retried:
    _MLFLOW_PROBE_S seconds to connect, as many to reply (name resolution: the resolver's time).
    MLflow's own calls retry for minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR, MLFLOW_HTTP_REQUEST_TIMEOUT). Any reply (even an error)
    counts. `recorded_in`: the trackers.json naming `uri` on resume ('': MLFLOW_TRACKING_URI)."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request
    try:
        http_request(get_default_host_creds(uri), "/health", "GET", max_retries=0,
                     backoff_factor=0, timeout=_MLFLOW_PROBE_S, raise_on_status=False)
    except MlflowException as e:
        cause = e
        while (cause.__cause__ or cause.__context__) is not None:  # the socket's error
            cause = cause.__cause__ or cause.__context__
        if recorded_in:
            named, fix = (f"recorded in {recorded_in} for this run", "start it, or delete "
                          f"that file's \"mlflow\" entry to log to a new run")
        else:
            named, fix = ("MLFLOW_TRACKING_URI", "start it, or set MLFLOW_TRACKING_URI to a "
                          "running server, sqlite:///mlflow.db or a file:// store")
        if isinstance(cause, ssl.SSLError):
            fix = ("set MLFLOW_TRACKING_SERVER_CERT_PATH to the CA bundle that signed its "
                   "certificate (MLFLOW_TRACKING_INSECURE_TLS=true skips the check)")
        raise ValueError(f"the mlflow tracking server {uri} ({named}) fails a "
                         f"{_MLFLOW_PROBE_S} s reachability check ({_brief(cause)}); "
                         f"{fix}") from None


_BACKENDS = {"wandb": _Wandb, "mlflow": _Mlflow}

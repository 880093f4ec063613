"""Experiment trackers: wandb (offline run files) and MLflow (a local file store), read back
from what they wrote; resume continues the same tracker run without logging a step twice."""
import argparse
import glob
import json
import math
import os
import struct
import sys

import mlflow  # noqa: F401  (its first import runs `uname -p`: here, not in a test)
import pytest

from stablerl_jax.runs import trackers as trk
from stablerl_jax.runs.metrics_io import MetricsWriter, plot_metrics, read_metrics

SAMPLES = [{"split": "train", "prompt": "1+1=", "response": "2<|im_end|>", "reward": 1.0,
            "length": 3, "truncated": False}]


def _session(workdir, names, steps, *, resume_from=None, offset=0.0, config=None,
             samples_at=(), plots=False, killed=False):
    """The calls rl/loop.py makes on a MetricsWriter and a Trackers: cut the metrics log
    back to the checkpoint `resume_from` (None: a fresh start), log the config, then a row
    (and samples at `samples_at`) for each of `steps`, the plots at the end. Every row's
    value is step + `offset` (0.0 for the first run, another for a resumed one), the
    loss NaN at step 1 (no value). `killed`: Ctrl-C after the last row."""
    writer = MetricsWriter(str(workdir))
    with trk.Trackers(names, workdir, run_name="v/seed0") as tracker:
        writer.truncate_after(-1 if resume_from is None else resume_from)
        tracker.log_config(config or {"rl.steps": 8, "rl.eval_sets": ["a", "b"]})
        for s in steps:
            row = writer.write(s, {"reward": s + offset, "eval/x/avg@k": 2 * s + offset,
                                   "loss": math.nan if s == 1 else s + offset})
            tracker.log(s, row)
            if s in samples_at:
                tracker.log_samples(s, [{**SAMPLES[0], "step_seen": s + offset}])
        if plots:
            tracker.log_plots(steps[-1], plot_metrics(read_metrics(str(workdir)),
                                                      os.path.join(workdir, "plots")))
        if killed:
            raise KeyboardInterrupt
    writer.close()


def _killed_then_resumed(workdir, names):
    """A run killed after logging steps 0..5 (samples at 2 and 4) whose last checkpoint
    is step 3, resumed to step 8 with other values (offset 100) and one changed field."""
    with pytest.raises(KeyboardInterrupt):
        _session(workdir, names, range(6), samples_at=(2, 4), killed=True)
    first = json.loads((workdir / "trackers.json").read_text())
    _session(workdir, names, range(4, 9), resume_from=3, offset=100.0, samples_at=(4, 6),
             config={"rl.steps": 9, "rl.eval_sets": ["a", "b"]}, plots=True)
    second = json.loads((workdir / "trackers.json").read_text())
    assert [r["step"] for r in read_metrics(str(workdir))] == list(range(9))
    return first, second


# Each step reaches the tracker once: 0..5 from the killed run (its values, though the
# resumed run wrote 4 and 5 again into metrics.jsonl), 6..8 from the resumed one.
EXPECTED_REWARD = [(s, float(s)) for s in range(6)] + [(s, s + 100.0) for s in range(6, 9)]


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for the opt-in
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return uri


def test_mlflow_resume_continues_the_run_and_logs_each_step_once(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient
    workdir = tmp_path / "run"
    first, second = _killed_then_resumed(workdir, ("tensorboard", "mlflow"))
    run_id = first["mlflow"]["run_id"]
    assert second["mlflow"]["run_id"] == run_id
    assert second["mlflow"]["logged"] == {"metrics": 8, "samples": 6, "plots": 8}
    client = MlflowClient(mlflow_store)
    experiment = client.get_experiment_by_name(trk.PROJECT)
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "v/seed0"

    def history(key):
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
    assert history("reward") == EXPECTED_REWARD
    assert history("eval/x/avg_at_k") == [(s, 2 * s + (s > 5) * 100.0) for s in range(9)]
    assert [s for s, _ in history("loss")] == [0, *range(2, 9)]  # NaN: no point
    # Params are immutable in MLflow: the resumed run's changed rl.steps keeps 8.
    assert run.data.params == {"rl.steps": "8", "rl.eval_sets": '["a", "b"]'}
    names = sorted(a.path for a in client.list_artifacts(run_id, "samples"))
    assert names == [f"samples/step_0000000{s}.json" for s in (2, 4, 6)]
    local = client.download_artifacts(run_id, "samples/step_00000006.json", str(tmp_path))
    assert json.loads(open(local).read()) == [{**SAMPLES[0], "step_seen": 106.0}]
    plots = {os.path.basename(a.path) for a in client.list_artifacts(run_id, "plots")}
    assert plots == {os.path.basename(p) for p in glob.glob(f"{workdir}/plots/*.png")}
    assert {"reward.png", "loss.png"} <= plots


def test_mlflow_run_killed_is_marked_and_a_missing_run_is_one_line(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient
    with pytest.raises(KeyboardInterrupt):
        with trk.Trackers(("mlflow",), str(tmp_path)) as tracker:
            tracker.log(0, {"step": 0, "reward": 1.0})
            raise KeyboardInterrupt
    state = json.loads((tmp_path / "trackers.json").read_text())
    assert MlflowClient(mlflow_store).get_run(state["mlflow"]["run_id"]).info.status == "KILLED"
    state["mlflow"]["run_id"] = "0" * 32
    (tmp_path / "trackers.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"names mlflow run 0+, which .* delete the file's "
                                         r"\"mlflow\" entry"):
        with trk.Trackers(("mlflow",), str(tmp_path)) as tracker:
            tracker.log(1, {"reward": 1.0})


def test_mlflow_store_that_cannot_open_fails_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://x")
    with pytest.raises(ValueError, match="mlflow tracking store nosuchscheme://x cannot be "
                                         "opened .* set MLFLOW_TRACKING_URI"):
        trk.Trackers(("mlflow",), str(tmp_path))
    assert not os.listdir(tmp_path)


def _wandb_records(path):
    """The records of a wandb run file (`run-<id>.wandb`): a LevelDB log (a 7-byte file
    header, then 32 KiB blocks of chunks, each a 7-byte header — crc32, length, type: 1
    full, 2 first, 3 middle, 4 last — and its bytes; a block's tail shorter than a
    header is padding), each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    out, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero fill: the end of what was written
            break
        part += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            out.append(pb.Record.FromString(part))
            part = b""
    return out


def _wandb_history(run_dir):
    """{step: {key: value}} of one offline run directory."""
    rows = {}
    for r in _wandb_records(glob.glob(f"{run_dir}/run-*.wandb")[0]):
        if r.WhichOneof("record_type") == "history":
            row = rows.setdefault(r.history.step.num, {})
            for item in r.history.item:  # a media item: one item per field, nested_key
                *outer, key = item.nested_key or [item.key]  # [name, field]
                for k in outer:
                    row = row.setdefault(k, {})
                row[key] = json.loads(item.value_json)
                row = rows[r.history.step.num]
    return rows


@pytest.mark.integration
def test_wandb_offline_resume_continues_the_run_and_logs_each_step_once(tmp_path,
                                                                         monkeypatch):
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"),
                     ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    workdir = tmp_path / "run"
    first, second = _killed_then_resumed(workdir, ("wandb",))
    run_id = first["wandb"]["run_id"]
    assert second["wandb"] == {"run_id": run_id, "project": trk.PROJECT,
                               "logged": {"metrics": 8, "samples": 6, "plots": 8}}
    # An offline run opened again is a second directory with the same run id (`wandb
    # sync` appends it to the run); the workdir holds both (WANDB_DIR unset).
    dirs = sorted(glob.glob(f"{workdir}/wandb/offline-run-*-{run_id}"))
    assert len(dirs) == 2
    killed, resumed = (_wandb_history(d) for d in dirs)
    assert sorted(killed) == list(range(6)) and sorted(resumed) == [6, 7, 8]
    rows = {**killed, **resumed}
    assert [(s, rows[s]["reward"]) for s in sorted(rows)] == EXPECTED_REWARD
    assert "loss" not in rows[1] and rows[2]["loss"] == 2.0  # NaN: no value
    assert rows[6]["samples"]["_type"] == "table-file"
    table = json.loads(open(os.path.join(dirs[1], "files",
                                         rows[6]["samples"]["path"])).read())
    assert table["columns"] == [*SAMPLES[0], "step_seen"]
    assert table["data"] == [[*SAMPLES[0].values(), 106.0]]
    assert "samples" in killed[2] and "samples" in killed[4] and "samples" not in rows[5]
    assert rows[8]["plots/reward"]["_type"] == "image-file"
    assert os.path.exists(os.path.join(dirs[1], "files", rows[8]["plots/reward"]["path"]))
    runs = [r.run for d in dirs for r in _wandb_records(glob.glob(f"{d}/run-*.wandb")[0])
            if r.WhichOneof("record_type") == "run"]
    assert {(r.run_id, r.display_name, r.project) for r in runs} == {
        (run_id, "v/seed0", trk.PROJECT)}
    configs = [{u.key: json.loads(u.value_json) for r in _wandb_records(
        glob.glob(f"{d}/run-*.wandb")[0]) if r.WhichOneof("record_type") == "config"
        for u in r.config.update} for d in dirs]
    assert [(c["rl.steps"], c["rl.eval_sets"]) for c in configs] == [(8, ["a", "b"]),
                                                                      (9, ["a", "b"])]


def test_other_processes_and_no_trackers_log_nothing(tmp_path, monkeypatch):
    # Not even imported: a process that logs nothing needs neither package.
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    for names, enabled in ((("tensorboard", "wandb", "mlflow"), False), (("tensorboard",), True),
                           ((), True)):
        with trk.Trackers(names, str(tmp_path), enabled=enabled) as tracker:
            assert not tracker.enabled
            tracker.log_config({"a": 1})
            tracker.log(0, {"reward": 1.0})
            tracker.log_samples(0, SAMPLES)
            tracker.log_plots(0, [str(tmp_path / "x.png")])
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` fails as if not installed
    fix = rf"tracker '{name}': the {name} package is not installed; pip install " \
          rf"'stablerl_jax\[{name}\]'$"
    with pytest.raises(ValueError, match=fix):
        trk.check(trk.parse(f"tensorboard,{name}"))
    with pytest.raises(ValueError, match=fix):
        trk.Trackers((name,), str(tmp_path))
    assert not os.listdir(tmp_path)


def test_parse_names():
    assert trk.parse("tensorboard") == ("tensorboard",)
    assert trk.parse(" wandb,mlflow,wandb ") == ("wandb", "mlflow")
    assert trk.parse("none") == ()
    for bad in ("tb", "wandb,none", "tensorboard,neptune"):
        with pytest.raises(ValueError, match=r"is unknown; choose a comma-separated subset of "
                                             r"tensorboard, wandb, mlflow, or none"):
            trk.parse(bad)
    with pytest.raises(ValueError, match="is empty"):
        trk.parse(",")
    with pytest.raises(ValueError, match="'tb' is unknown"):
        trk.Trackers(("tb",), "unused", enabled=False)


def test_mlflow_key():
    assert trk.mlflow_key("eval/aime24/avg@k") == "eval/aime24/avg_at_k"
    assert trk.mlflow_key("kl/train_infer_k1") == "kl/train_infer_k1"
    assert trk.mlflow_key("a:b (c)") == "a_b _c_"


def test_the_flag_parses_and_refuses_before_any_work(capsys, monkeypatch):
    ap = argparse.ArgumentParser(prog="x")
    trk.add_argument(ap)
    assert ap.parse_args([]).tracker == ("tensorboard",)
    assert ap.parse_args(["--tracker", "wandb,tensorboard"]).tracker == ("wandb", "tensorboard")
    assert ap.parse_args(["--tracker", "none"]).tracker == ()
    with pytest.raises(SystemExit):
        ap.parse_args(["--tracker", "tb"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "x: error: argument --tracker: tracker 'tb' is unknown; choose a comma-separated "
        "subset of tensorboard, wandb, mlflow, or none")
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(SystemExit):
        ap.parse_args(["--tracker", "mlflow"])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "pip install 'stablerl_jax[mlflow]'")

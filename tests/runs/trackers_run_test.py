"""Trackers wired into the RL loop, the cold start and the command lines: loop.run,
sft.cold_start and experiments/runner.py take `trackers=`, MetricsWriter `tensorboard=`,
and the training run and every experiment module take --tracker."""
import json
import os
import sys

import pytest
from rl_helpers import kill_cold_start_at, tiny_cfg

from experiments import onpolicy, train
from stablerl_jax import presets
from stablerl_jax.data import sft_data
from stablerl_jax.rl import loop, sft
from stablerl_jax.runs import trackers as trk
from stablerl_jax.runs.metrics_io import read_metrics


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return uri


@pytest.mark.slow  # two RL runs, ~40 s on 2 cores
def test_rl_loop_resumed_logs_each_step_once_to_the_same_run(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient
    workdir = str(tmp_path / "run")
    loop.run(tiny_cfg(steps=2, checkpoint_every=2, eval_every=2), workdir, progress=False,
             trackers=("mlflow",))
    assert not os.path.exists(f"{workdir}/tb")  # TensorBoard left out of the list
    # A killed run logged step 3 (to metrics.jsonl and to the tracker) after its last
    # checkpoint, at step 2.
    with open(f"{workdir}/metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "reward": 123.0}) + "\n")
    with trk.Trackers(("mlflow",), workdir) as tracker:
        tracker.log(3, {"reward": 123.0})
    run_id = json.loads(open(f"{workdir}/trackers.json").read())["mlflow"]["run_id"]
    loop.run(tiny_cfg(steps=4, checkpoint_every=2, eval_every=2), workdir, progress=False,
             trackers=("mlflow", "tensorboard"))
    state = json.loads(open(f"{workdir}/trackers.json").read())["mlflow"]
    assert state["run_id"] == run_id
    assert state["logged"] == {"metrics": 4, "samples": 4, "plots": 4}
    client = MlflowClient(mlflow_store)
    rows = read_metrics(workdir)
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "reward"))
    # Step 3 keeps the killed run's value; every other step is metrics.jsonl's.
    assert history == [(r["step"], 123.0 if r["step"] == 3 else r["reward"])
                       for r in rows if "reward" in r]  # step 0: the eval alone
    assert [s for s, _ in history] == [1, 2, 3, 4] and history[2] != (3, rows[3]["reward"])
    acc = sorted(m.step for m in client.get_metric_history(run_id, "eval/test/avg_at_k"))
    assert acc == [0, 2, 4]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "test"
    assert run.data.params["rl.steps"] == "2"  # MLflow params keep their first value
    assert run.data.params["model.d_model"] == "32"
    samples = sorted(a.path for a in client.list_artifacts(run_id, "samples"))
    assert samples == [f"samples/step_0000000{s}.json" for s in (0, 2, 4)]
    local = client.download_artifacts(run_id, "samples/step_00000004.json", str(tmp_path))
    assert json.loads(open(local).read()) == [
        {k: v for k, v in r.items() if k != "step"}
        for r in read_metrics(f"{workdir}/samples.jsonl") if r["step"] == 4]
    assert "reward.png" in {os.path.basename(a.path)
                            for a in client.list_artifacts(run_id, "plots")}
    assert os.path.isdir(f"{workdir}/tb")  # asked for on resume


@pytest.mark.integration
def test_a_killed_cold_start_continues_its_tracker_run(tmp_path, mlflow_store, monkeypatch):
    from mlflow.tracking import MlflowClient
    cfg = presets.preset("tiny", ["task.num_train=64", "task.num_test=16", "sft.batch_size=8",
                                  "sft.steps=4", "sft.checkpoint_every=2"])
    workdir = str(tmp_path / "w")
    data = loop.task_data(cfg, workdir)
    real = kill_cold_start_at(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        sft.cold_start(cfg, data, workdir, progress=False, trackers=("mlflow",))
    state = json.loads(open(f"{workdir}/sft_run/trackers.json").read())["mlflow"]
    client = MlflowClient(mlflow_store)
    assert client.get_run(state["run_id"]).info.status == "KILLED"
    monkeypatch.setattr(sft_data, "batches", real)
    _, losses = sft.cold_start(cfg, data, workdir, progress=False, trackers=("mlflow",))
    again = json.loads(open(f"{workdir}/sft_run/trackers.json").read())["mlflow"]
    assert again["run_id"] == state["run_id"]
    run = client.get_run(state["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == f"{cfg.name}/sft"
    history = sorted((m.step, m.value)
                     for m in client.get_metric_history(state["run_id"], "sft/loss"))
    assert history == list(zip(range(1, 5), losses))  # resumed at 2: 3 logged once
    assert not os.path.exists(f"{workdir}/sft_run/tb")


def test_the_command_lines_refuse_bad_trackers_before_any_work(tmp_path, capsys,
                                                               monkeypatch):
    workdir = tmp_path / "run"
    for main, argv in ((train.main, []), (onpolicy.main, ["--seeds", "0"])):
        with pytest.raises(SystemExit) as e:
            main(["--workdir", str(workdir), "--quiet", "--compile-cache=", *argv,
                  "--tracker", "tensorboard,tb"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --tracker: tracker 'tb' is unknown; choose a comma-separated " \
               "subset of tensorboard, wandb, mlflow, or none" in err
        monkeypatch.setitem(sys.modules, "wandb", None)
        with pytest.raises(SystemExit):
            main(["--workdir", str(workdir), "--quiet", *argv, "--tracker", "wandb"])
        assert "pip install 'stablerl_jax[wandb]'" in capsys.readouterr().err
        monkeypatch.delitem(sys.modules, "wandb")
    assert not workdir.exists()

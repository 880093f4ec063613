"""What a run costs (rl/costs.py, rl/profiling.py): per-phase times, throughput, MFU,
the compiled steps' estimates and profiler traces."""
import glob
import inspect
import math
import os
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg

from stablerl_jax.pod import roofline
from stablerl_jax.rl import costs, loop, profiling
from stablerl_jax.rl.engine import Engine
from stablerl_jax.runs.metrics_io import read_metrics
from stablerl_jax.sampling import rollout


def _adds_up(row: dict) -> None:
    """The phases and time/other make up time/step; no phase counted twice (other >= 0)."""
    phases = sum(row.get(f"time/{p}", 0.0) for p in costs.PHASES)
    # time/other is time/step minus at most 8 phases: the sum back differs by roundings.
    assert math.isclose(phases + row["time/other"], row["time/step"], rel_tol=1e-12)
    assert row["time/other"] >= 0


def test_phases_add_up_and_compiles_count_in_the_phase_that_ran_them():
    with costs.PhaseTimer() as timer:
        timer.row()
        with timer.phase("sample"):
            timer.wait(jax.jit(lambda x: x * 3.0 + 1.0)(jnp.ones(13)))  # compiles here
        for i in range(2):
            with timer.phase("update", key=f"update_{i}"):
                time.sleep(0.01)
        row = timer.row()
        nxt = timer.row()
    _adds_up(row)
    assert row["time/update"] == pytest.approx(row["time/update_0"] + row["time/update_1"])
    assert row["time/update_0"] >= 0.01 and row["time/sample"] > 0
    assert row["time/compile_sample"] > 0 and "time/compile_update" not in row
    assert row["time/compile"] == row["time/compile_sample"] <= row["time/sample"]
    # The next row starts empty.
    assert nxt["time/compile"] == 0 and "time/sample" not in nxt
    # Outside the `with`, the listener is gone: a compile is no one's.
    jax.jit(lambda x: x - 2.0)(jnp.ones(11)).block_until_ready()
    assert timer.compile == {}


def test_static_decode_steps_are_each_pass_longest_response():
    # max_batch 2 over 6 rows: 3 strided passes, rows (0, 3), (1, 4), (2, 5).
    lengths = jnp.array([3, 5, 1, 2, 7, 0])
    assert int(rollout.decode_steps(lengths, 2)) == 3 + 7 + 1
    assert int(rollout.decode_steps(lengths, 0)) == 7


@pytest.mark.parametrize("kind,key", [("TPU v5p", "v5p"), ("TPU v5", "v5p"),
                                      ("TPU v5 lite", "v5e"), ("TPU v6 lite", "v6e"),
                                      ("TPU v4", "v4"), ("NVIDIA H100 80GB HBM3", "h100"),
                                      ("NVIDIA H200", "h200"), ("cpu", None)])
def test_device_kinds_name_their_chip_constants(kind, key):
    assert costs.chip_key(SimpleNamespace(device_kind=kind)) == key


def test_the_cpu_peak_is_a_stated_figure():
    peak, source = costs.peak_flops(jax.devices()[0])
    cores = len(os.sched_getaffinity(0))
    assert peak == cores * costs.CPU_FLOPS_PER_CORE / jax.local_device_count()
    assert "assumed" in source
    h200 = costs.peak_flops(SimpleNamespace(device_kind="NVIDIA H200", platform="gpu"))
    assert h200[0] == roofline.CHIP_SPECS["h200"].peak_flops == 989e12


def test_estimates_are_scaled_to_the_step_and_compared():
    cfg = tiny_cfg()
    times = {"time/sample": 2.0, "time/score": 1.0, "time/update": 3.0}
    est = {"sample": 4.0, "score": 0.5, "update": 1.5}
    b, c = 8, cfg.sampling.max_new_tokens
    full = cfg.task.max_prompt_len + c
    out = costs.perf_row(cfg, times, generated=100.0, trained=60.0, rows=b, width=full,
                         decode_steps=c // 2, estimates=est)
    # Half the decode steps: half the fixed-length estimate; the full width: as compiled.
    assert out["est/sample"] == 2.0 and out["perf/sample_vs_est"] == 1.0
    assert out["est/score"] == 0.5 and out["perf/score_vs_est"] == 2.0
    assert out["perf/update_vs_est"] == 2.0
    assert out["perf/generated_tokens_per_s"] == 50.0 and out["perf/trained_tokens_per_s"] == 20.0
    assert out["perf/decode_steps_per_s"] == c / 4
    flops = costs.step_flops(cfg, b, full)
    assert out["perf/update_flops_per_s_per_device"] == flops["update"] / 3.0 / jax.device_count()
    narrow = costs.perf_row(cfg, times, generated=1.0, trained=1.0, rows=b, width=full // 2,
                            decode_steps=None, estimates=est)
    assert narrow["est/score"] < 0.5 and "perf/decode_steps_per_s" not in narrow
    assert "est/sample" in narrow  # no decode count: the fixed-length estimate


def test_a_score_step_without_a_forward_has_no_mfu():
    from stablerl_jax import presets
    from stablerl_jax.pod import aot
    fused = presets.tiny()  # on-policy, rl.score_in_update: the update's forward scores
    assert fused.rl.score_in_update and costs.score_forwards(fused) == 0
    out = costs.perf_row(fused, {"time/score": 0.1, "time/update": 1.0}, generated=1.0,
                         trained=1.0, rows=8, width=20, decode_steps=None)
    assert "perf/score_mfu" not in out and out["perf/update_mfu"] > 0
    assert aot.step_model_flops(fused, "score") == 0
    both = fused.replace(rl=fused.rl.replace(num_minibatches=2, attribution=True))
    assert costs.score_forwards(both) == 2  # its own pass and the attribution's


def test_profile_steps_are_checked_in_one_line(capsys):
    import argparse
    ap = argparse.ArgumentParser()
    profiling.add_argument(ap)
    assert ap.parse_args(["--profile", "3:4"]).profile == (3, 4)
    assert ap.parse_args(["--profile", "5"]).profile == (5, 5)
    for bad in ("0:2", "4:3", "a:b", "1:2:3", ""):
        with pytest.raises(SystemExit) as e:
            ap.parse_args(["--profile", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "FIRST:LAST" in err and "1 <= FIRST <= LAST" in err


def test_only_process_0_compiles_the_estimates(monkeypatch):
    monkeypatch.setattr(costs, "chip_key", lambda d: "v5p")
    monkeypatch.setattr(costs.distributed, "is_main", lambda: False)
    monkeypatch.setattr(roofline, "estimate", lambda *a: pytest.fail("estimated off process 0"))
    pod = SimpleNamespace(mesh=SimpleNamespace(devices=np.array(
        [SimpleNamespace(device_kind="TPU v5")])))
    assert costs.estimate_phases(pod) == (None, "")


@pytest.mark.integration
def test_the_run_prices_its_programs_with_the_function_aot_compile_prints(monkeypatch):
    from experiments import aot_compile
    engine = Engine.create(tiny_cfg(), eos_id=EOS_ID, pad_id=PAD_ID)
    real, seen = roofline.estimate, []
    monkeypatch.setattr(roofline, "estimate", lambda *a: seen.append(real(*a)) or seen[-1])
    monkeypatch.setattr(costs, "chip_key", lambda d: "v5p")
    phases, said = costs.estimate_phases(engine)
    (est,) = seen
    assert phases == {"sample": est.steps["sample"].seconds,
                      "score": est.steps["score"].seconds,
                      "update": 2 * est.steps["update"].seconds}  # N = 2 updates a step
    assert all(v > 0 for v in phases.values()) and said.startswith("estimates (v5p")
    assert "roofline.estimate(engine, compiled, chip)" in inspect.getsource(
        aot_compile._estimates)


@pytest.mark.integration
def test_a_run_records_its_costs_resumes_the_series_and_traces_steps(tmp_path, capsys):
    wd = str(tmp_path / "run")
    loop.run(tiny_cfg(steps=2, checkpoint_every=1, eval_every=2), wd, progress=False,
             profile=(2, 2))
    summary = loop.run(tiny_cfg(steps=3, checkpoint_every=1, eval_every=2), wd,
                       progress=True)  # resumed from step 2; the printout
    rows = read_metrics(wd)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["time/eval"] > 0 and rows[0]["time/compile_eval"] > 0
    for r in rows[1:]:
        _adds_up(r)
        for k in ("sample", "reward", "score", "update", "update_0", "update_1", "compile",
                  "sample_per_decode_step"):
            assert f"time/{k}" in r, (r["step"], k)
        for k in ("generated_tokens_per_s", "generated_tokens_per_s_per_device",
                  "trained_tokens_per_s", "decode_steps_per_s", "score_flops_per_s_per_device",
                  "update_flops_per_s_per_device"):
            assert r[f"perf/{k}"] > 0, (r["step"], k)
        assert 0 < r["perf/score_mfu"] <= 1 and 0 < r["perf/update_mfu"] <= 1
        assert not any(k.startswith("est/") for k in r)  # CPU: no chip constants
    assert rows[1]["time/compile_update"] > 0  # the first update compiles
    # The save and log writes after row k are in row k + 1.
    assert rows[2]["time/checkpoint"] > 0 and rows[2]["time/logs"] > 0
    assert rows[2]["time/eval"] > 0 and "time/eval" not in rows[1]
    # The summary and the printout.
    split = summary["cost"]["seconds_per_step"]
    # The rows after the first (its compiles): steps 2 and 3.
    assert split["step"] == pytest.approx(np.mean([rows[2]["time/step"], rows[3]["time/step"]]))
    assert summary["cost"]["measured_vs_estimated"] == []
    assert "no estimates on cpu" in capsys.readouterr().out
    assert os.path.isfile(os.path.join(wd, "plots", "time_per_phase.png"))
    # The trace of step 2, which jax.profiler's reader opens.
    (trace,) = glob.glob(os.path.join(wd, "profile", "process_0", "plugins", "profile", "*",
                                      "*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(trace)
    assert any(len(list(line.events)) for plane in data.planes for line in plane.lines)


@pytest.mark.tpu
def test_a_dry_start_on_a_pod_logs_the_estimates_aot_compile_prints(monkeypatch):
    """The run's start on a topology's abstract devices prices its programs with the
    function experiments.aot_compile prints, on the chip its devices name."""
    import libtpu  # noqa: F401  (the tpu extra; CI installs it: fail, never skip)

    from stablerl_jax import presets
    from stablerl_jax.pod import aot
    cfg = presets.preset("tiny", ["mesh=1,4,1"])
    engine = Engine.for_topology(cfg, aot.topology("v5p-8"))
    real, seen = roofline.estimate, []
    monkeypatch.setattr(roofline, "estimate", lambda *a: seen.append((a, real(*a))) or seen[-1][1])
    phases, said = costs.estimate_phases(engine)
    ((_, compiled, chip), est), = seen
    assert chip is roofline.CHIP_SPECS["v5p"] and said.startswith("estimates (v5p")
    assert set(compiled) == {"sample", "score", "update"}
    assert phases == {k: est.steps[k].seconds for k in ("sample", "score", "update")}
    assert phases["sample"] > 0 and phases["update"] > 0

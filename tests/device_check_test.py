"""benchmarks/device_check.py on a CPU: what runs, what is skipped and why, the report."""
import json

import pytest

from benchmarks import device_check


@pytest.mark.integration  # child processes: jax, experiments.bitwise_check
def test_on_a_cpu_the_bits_run_and_the_gpu_parts_are_skipped_with_their_reason(tmp_path,
                                                                               capsys):
    assert device_check.main(["--out", str(tmp_path), "--budget-s", "600"]) == 0
    rows = {r["part"]: r for r in json.loads((tmp_path / "device_check.json").read_text())
            ["parts"]}
    assert list(rows) == [p.name for p in device_check.parts()]
    assert rows["env"]["verdict"] == "passed" and "backend cpu" in rows["env"]["tail"]
    for dtype in ("float32", "bfloat16"):
        r = rows[f"bits-{dtype}"]
        assert r["verdict"] == "passed", r["tail"]
        assert "OK: the sampler computes the trainer's numbers bit for bit" in r["tail"]
        assert f"model.compute_dtype={dtype}" in r["command"] and "--rows 4" in r["command"]
    assert rows["kernels"]["verdict"].startswith("skipped: no GPU (jax backend cpu)")
    assert "interpreted in the default test tier" in rows["kernels"]["verdict"]
    assert rows["cost"]["verdict"].startswith("skipped: no GPU")
    md = (tmp_path / "device_check.md").read_text()
    assert "| bits-bfloat16 | 0 |" in md and "## cost" in md
    assert f"report in {tmp_path}/device_check.md" in capsys.readouterr().out


@pytest.mark.integration
def test_a_part_past_its_limit_is_recorded_and_fails_the_check(tmp_path, monkeypatch):
    slow = device_check.Part("sleep", (device_check.sys.executable, "-c",
                                       "print('started', flush=True); import time; "
                                       "time.sleep(60)"), 0.01, False)
    monkeypatch.setattr(device_check, "parts", lambda: (slow,))
    assert device_check.main(["--out", str(tmp_path), "--budget-s", "300"]) == 1
    (row,) = json.loads((tmp_path / "device_check.json").read_text())["parts"]
    assert row["verdict"] == "timed out" and row["rc"] is None and row["limit_s"] == 3
    assert "started" in row["tail"] and "(stopped at its limit)" in row["tail"]


def test_a_budget_that_is_not_positive_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        device_check.main(["--budget-s", "0"])
    assert e.value.code == 2
    assert "--budget-s=0: give a positive number of seconds" in capsys.readouterr().err


def test_a_bucket_as_out_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        device_check.main(["--out", "gs://bucket/report"])
    assert e.value.code == 2
    assert "--out=gs://bucket/report: give a local directory" in capsys.readouterr().err

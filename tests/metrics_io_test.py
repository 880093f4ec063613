"""Metrics JSONL / TensorBoard / PNG plots."""
import math

from stablerl_jax import metrics_io as mio


def test_write_read_truncate_and_nan(tmp_path):
    w = mio.MetricsWriter(str(tmp_path))
    for s in range(1, 5):
        w.write(s, {"reward": s / 10, "kl/train_infer_k1": 10.0 ** -s, "loss": math.nan})
    rows = mio.read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["reward"] == 0.2 and rows[0]["loss"] is None
    w.truncate_after(2)
    assert [r["step"] for r in mio.read_metrics(str(tmp_path))] == [1, 2]
    w.close()
    assert list((tmp_path / "tb").iterdir())


def test_plots_are_pngs(tmp_path):
    rows = [{"step": s, "reward": s / 10, "kl/train_infer_k1": 10.0 ** -s,
             "eval/accuracy": None if s % 2 else 0.5} for s in range(1, 6)]
    paths = mio.plot_metrics(rows, str(tmp_path / "plots"))
    assert len(paths) == 3  # reward, accuracy, KL; absent keys are skipped
    for p in paths:
        with open(p, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n"
    out = mio.plot_comparison({"a": rows, "b": rows[:3]}, str(tmp_path / "cmp.png"))
    assert open(out, "rb").read(4) == b"\x89PNG"

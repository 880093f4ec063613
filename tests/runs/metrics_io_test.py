"""Metrics JSONL / TensorBoard events / PNG plots."""
import glob
import json
import math
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2
from tolerance import bound

from stablerl_jax.runs import metrics_io as mio


def _events(tb_dir):
    """All events of all event files, file by file in creation order (TFRecord framing:
    u64 length, u32 crc, payload, u32 crc)."""
    out = []
    for path in sorted(glob.glob(f"{tb_dir}/events.out.tfevents.*")):
        data, pos = open(path, "rb").read(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            out.append((path, event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])))
            pos += 12 + n + 4
    return out


def _scalars(tb_dir, tag):
    return [(e.step, v.simple_value) for _, e in _events(tb_dir) for v in e.summary.value
            if v.tag == tag]


def test_write_read_round_trip_with_numpy_jax_and_nonfinite(tmp_path):
    w = mio.MetricsWriter(str(tmp_path))
    row = w.write(np.int64(3), {"reward": jnp.float32(0.5), "n": np.int32(4), "ok": True,
                                "loss": math.nan, "kl": -math.inf, "x": jnp.array([2.0]),
                                "absent": None})
    w.close()
    expect = {"step": 3, "reward": 0.5, "n": 4.0, "ok": 1.0, "loss": None, "kl": None,
              "x": 2.0, "absent": None}
    assert row == expect
    assert mio.read_metrics(str(tmp_path)) == [expect]
    assert mio.read_metrics(str(tmp_path / "metrics.jsonl")) == [expect]
    line = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line  # strict JSON
    assert all(isinstance(v, float) for k, v in json.loads(line).items()
               if k != "step" and v is not None)
    assert mio.read_metrics(str(tmp_path / "nowhere")) == []


def test_bad_values_are_clear_errors(tmp_path):
    w = mio.MetricsWriter(str(tmp_path))
    with pytest.raises(ValueError, match="'v' .* not a scalar"):
        w.write(0, {"v": np.ones(3)})
    with pytest.raises(ValueError, match="'s' .* not a scalar"):
        w.write(0, {"s": "high"})
    with pytest.raises(ValueError, match="'step'"):
        w.write(0, {"step": 1})
    w.close()
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        mio.MetricsWriter(str(tmp_path / "f"))


def test_truncate_after_drops_later_rows_and_tensorboard_steps(tmp_path):
    w = mio.MetricsWriter(str(tmp_path))
    for s in range(1, 5):
        w.write(s, {"reward": s / 10})
    w.truncate_after(2)
    assert [r["step"] for r in mio.read_metrics(str(tmp_path))] == [1, 2]
    w.write(3, {"reward": 0.7})
    w.close()
    assert [(r["step"], r["reward"]) for r in mio.read_metrics(str(tmp_path))] == [
        (1, 0.1), (2, 0.2), (3, 0.7)]
    # TensorBoard stores simple_value as float32: one rounding.
    assert _scalars(tmp_path / "tb", "reward") == [
        (s, pytest.approx(v, rel=bound(1), abs=0))
        for s, v in [(1, .1), (2, .2), (3, .3), (4, .4), (3, .7)]]
    # The new event file starts by telling TensorBoard to drop steps >= 3 of earlier files.
    files = sorted({p for p, _ in _events(tmp_path / "tb")})
    assert len(files) == 2
    starts = [e.step for p, e in _events(tmp_path / "tb")
              if p == files[1] and e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [3]
    w = mio.MetricsWriter(str(tmp_path))
    w.truncate_after(-1)
    w.close()
    assert mio.read_metrics(str(tmp_path)) == []


def test_torn_last_line_is_dropped_bad_middle_line_is_an_error(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"')  # killed mid-write
    assert mio.read_metrics(str(tmp_path)) == [{"step": 1, "a": 1.0}]
    w = mio.MetricsWriter(str(tmp_path))
    w.truncate_after(5)  # resume also repairs the torn line
    w.write(2, {"a": 2.0})
    w.close()
    assert [r["step"] for r in mio.read_metrics(str(tmp_path))] == [1, 2]
    p.write_text('{"step": 1}\ngarbage\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        mio.read_metrics(str(p))


def _is_png(path):
    data = open(path, "rb").read()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def _records():
    # KL spans 1e-1 .. 1e-6 and k1 goes negative once (a noisy estimator); NaN was written
    # as null; eval/accuracy is logged every other step only.
    return [{"step": s, "reward": s / 10, "kl/train_infer_k1": 10.0 ** -s if s != 3 else -1e-4,
             "kl/train_infer_k3": 10.0 ** -s, "loss": None if s == 2 else 1.0 / s,
             **({"eval/accuracy": 0.1 * s} if s % 2 == 0 else {})} for s in range(1, 7)]


def test_plot_metrics_writes_pngs_for_present_keys_only(tmp_path):
    paths = mio.plot_metrics(_records(), str(tmp_path / "plots"))
    names = sorted(p.split("/")[-1] for p in paths)
    assert names == ["held-out_accuracy.png", "loss.png", "reward.png",
                     "training-inference_kl.png"]
    assert all(_is_png(p) for p in paths)
    one = mio.plot_metrics(_records(), str(tmp_path / "k"), keys=["loss", "entropy"])
    assert [p.split("/")[-1] for p in one] == ["loss.png"] and _is_png(one[0])
    custom = mio.plot_metrics(_records(), str(tmp_path / "c"),
                              panels=[("k3 only", ["kl/train_infer_k3"], True)])
    assert [p.split("/")[-1] for p in custom] == ["k3_only.png"]


def test_log_panel_omits_nonpositive_values_and_says_so(tmp_path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    mio._draw(ax, {"run": _records()}, "KL", ["kl/train_infer_k1", "kl/train_infer_k3"], True)
    k1, k3 = ax.lines
    assert list(k1.get_xdata()) == [1, 2, 4, 5, 6] and list(k3.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert ax.get_yscale() == "log" and "not shown" in ax.get_title()
    plt.close(fig)


def test_plot_comparison_one_line_per_run(tmp_path):
    runs = {"MiniRL": _records(), "w/o IS": _records()[:3]}
    panels = [("reward", ["reward"], False), ("KL", ["kl/train_infer_k3"], True),
              ("absent", ["nope"], False)]
    out = mio.plot_comparison(runs, str(tmp_path / "cmp" / "fig.png"), panels)
    assert _is_png(out)
    with pytest.raises(ValueError, match="none of the panel keys"):
        mio.plot_comparison(runs, str(tmp_path / "x.png"), [("absent", ["nope"], False)])


def test_eval_sets_get_their_panels_and_samples_reach_tensorboard_text(tmp_path):
    records = [{"step": s, "eval/aime24/avg@k": 0.1 * s, "eval/aime24/pass@k": 0.2 * s,
                "eval/aime24/length_mean": 10.0 + s, "eval/hmmt25/avg@k": 0.05 * s,
                "eval/hmmt25/pass@k": 0.1 * s, "eval/hmmt25/length_mean": 12.0}
               for s in (0, 2)]
    names = sorted(p.split("/")[-1] for p in mio.plot_metrics(records, str(tmp_path / "p")))
    assert names == ["eval_aime24.png", "eval_hmmt25.png", "eval_response_length.png"]
    w = mio.MetricsWriter(str(tmp_path / "run"))
    w.text(3, "samples", [{"prompt": "What is 2+2?", "response": "line 1\nline 2",
                           "reward": 1.0}])
    w.close()
    texts = [(e.step, v.tensor.string_val[0].decode()) for _, e in _events(w.tb_dir)
             for v in e.summary.value if v.tag.startswith("samples")]
    assert len(texts) == 1 and texts[0][0] == 3
    assert "prompt: `What is 2+2?`" in texts[0][1] and "line 1\nline 2" in texts[0][1]


def test_a_linked_log_is_refused_and_its_target_left_alone(tmp_path):
    # A rewrite by rename would replace the link and leave its target stale.
    target = tmp_path / "elsewhere.jsonl"
    target.write_text('{"step": 0, "reward": 0.5}\n{"step": 1, "reward": 0.7}\n')
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(target)
    with pytest.raises(ValueError, match=r"metrics.jsonl is a symbolic link .* replace the "
                                         r"link by a regular file"):
        mio.MetricsWriter(str(run))
    assert not (run / "tb").exists()  # refused before the TensorBoard writer
    for log in ("samples.jsonl", "dangling.jsonl"):
        (run / log).symlink_to(target if log == "samples.jsonl" else tmp_path / "absent")
        with pytest.raises(ValueError, match="is a symbolic link"):
            mio.truncate_jsonl(str(run / log), 0)
        assert (run / log).is_symlink()
    assert [r["step"] for r in mio.read_metrics(str(target))] == [0, 1]
    mio.MetricsWriter(str(run), enabled=False)  # a process that writes nothing: no check


def test_a_leftover_temp_link_is_not_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    log = tmp_path / "samples.jsonl"
    log.write_text('{"step": 0}\n{"step": 2}\n')
    (tmp_path / "samples.jsonl.tmp").symlink_to(outside)
    mio.truncate_jsonl(str(log), 1)
    assert outside.read_text() == "keep" and not log.is_symlink()
    assert mio.read_metrics(str(log)) == [{"step": 0}]

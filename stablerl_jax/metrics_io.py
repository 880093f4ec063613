"""Run metrics: JSONL (the source of truth), TensorBoard events, PNG plots.

metrics.jsonl holds one object per logged step, {"step": s, name: value, ...}; a
non-finite value is written as null. On resume, lines after the restored step are
dropped so the file equals the one an uninterrupted run writes.
"""
from __future__ import annotations

import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboardX import SummaryWriter  # noqa: E402

# (title, keys, log-scale y)
PANELS = [
    ("reward", ["reward"], False),
    ("held-out accuracy (avg@k)", ["eval/accuracy"], False),
    ("entropy (full vocabulary)", ["entropy"], False),
    ("training-inference KL", ["kl/train_infer_k1", "kl/train_infer_k3"], True),
    ("clip fraction", ["clip/frac_high", "clip/frac_low"], False),
    ("routing mismatch", ["routing/mismatch_rate", "routing/any_flip"], False),
    ("Eq. 5 factors: std of log ratio", ["eq5/engine_log_std", "eq5/staleness_log_std"], True),
    ("response length", ["response_length"], False),
]


def _clean(v):
    v = float(v)
    return v if math.isfinite(v) else None


class MetricsWriter:
    def __init__(self, workdir: str):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb_dir = os.path.join(workdir, "tb")
        self.tb = SummaryWriter(self.tb_dir)

    def write(self, step: int, metrics: dict) -> None:
        row = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for k, v in row.items():
            if k != "step" and v is not None:
                self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def truncate_after(self, step: int) -> None:
        rows = [r for r in read_metrics(self.path) if r["step"] <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(tmp, self.path)

    def close(self) -> None:
        self.tb.close()


def read_metrics(path: str) -> list[dict]:
    """Rows of a metrics.jsonl (or of <workdir>/metrics.jsonl)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(records, key):
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _draw(ax, runs: dict, title, keys, log):
    for name, records in runs.items():
        for key in keys:
            x, y = _series(records, key)
            if x:
                label = key if len(runs) == 1 else (name if len(keys) == 1 else f"{name}: {key}")
                ax.plot(x, [abs(v) for v in y] if log else y, label=label)
    if log:
        ax.set_yscale("log")
    ax.set_title(title + (" (abs, log)" if log else ""), fontsize=9)
    ax.set_xlabel("step")
    if ax.lines:
        ax.legend(fontsize=6)


def plot_metrics(records: list[dict], out_dir: str, panels=PANELS) -> list[str]:
    """One PNG per panel whose keys appear in the records."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for title, keys, log in panels:
        if not any(_series(records, k)[0] for k in keys):
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        _draw(ax, {"run": records}, title, keys, log)
        fig.tight_layout()
        path = os.path.join(out_dir, keys[0].replace("/", "_") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_comparison(runs: dict, out_path: str, panels=PANELS) -> str:
    """One figure, a panel per metric, a line per run."""
    panels = [p for p in panels if any(_series(r, k)[0] for r in runs.values() for k in p[1])]
    cols = 3
    rows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, keys, log) in zip(axes.flat, panels):
        _draw(ax, runs, title, keys, log)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path

"""Run metrics: JSONL (the source of truth), TensorBoard events, PNG plots.

`<workdir>/metrics.jsonl` holds one JSON object per logged global step,
`{"step": s, name: value, ...}`, every value a float. A non-finite value (NaN, ±inf) is
written as `null` (JSON has no NaN), and TensorBoard skips it; `read_metrics` returns it
as None. On resume, `truncate_after(step)` drops the rows a killed run wrote after its last
checkpoint, so the file equals the one an uninterrupted run writes, and TensorBoard is told
to discard those steps too (tensorboardX `purge_step`).

A JSONL log the run rewrites on start or resume (metrics.jsonl, samples.jsonl,
minibatches.jsonl, sft_run/metrics.jsonl: `truncate_jsonl`) must be a regular file, not
a symbolic link: the rewrite replaces the file by rename, which would turn the link into
a regular file and leave its target silently stale, so a link there is refused
(`refuse_link`) before anything is written to it.
"""
from __future__ import annotations

import json
import math
import os
import re
import time

import numpy as np
from matplotlib.figure import Figure  # no pyplot: files only, the caller's backend untouched
from tensorboardX import SummaryWriter

# (title, keys, log-scale y). A panel is drawn when any of its keys has a value.
PANELS = [
    ("reward", ["reward"], False),
    ("held-out accuracy", ["eval/accuracy", "eval/pass_at_k"], False),
    ("entropy", ["entropy", "update/entropy"], False),
    ("training-inference KL", ["kl/train_infer_k1", "kl/train_infer_k3"], True),
    ("clip / mask fraction", ["clip/frac_high", "clip/frac_low", "is/frac_truncated"], False),
    ("routing mismatch", ["routing/mismatch_rate", "routing/any_flip"], False),
    ("Eq. 5 factors: mean log ratio", ["eq5/engine_log_mean", "eq5/staleness_log_mean"], False),
    ("Eq. 5 factors: spread of log ratio",
     ["eq5/engine_log_std", "eq5/staleness_log_std",
      "eq5/engine_log_sqmean", "eq5/staleness_log_sqmean"], True),
    ("loss", ["loss"], False),
    ("skipped updates", ["skipped_updates"], False),
    ("gradient norm", ["grad_norm"], True),
    ("response length", ["response_length", "response/length_max"], False),
    ("truncated responses", ["response/truncated_frac", "response/clip_ratio",
                             "eval/truncated_frac"], False),
]
_EVAL_SET = re.compile(r"eval/([^/]+)/avg@k")


def eval_set_panels(records: list[dict]) -> list:
    """One panel per eval set the records hold (`eval/<set>/avg@k`, rl/evals.py): its
    avg@k and pass@k, and one of every set's mean response length."""
    names = sorted({m.group(1) for r in records for k in r if (m := _EVAL_SET.fullmatch(k))})
    if not names:
        return []
    return ([(f"eval {n}", [f"eval/{n}/avg@k", f"eval/{n}/pass@k"], False) for n in names]
            + [("eval response length", [f"eval/{n}/length_mean" for n in names], False)])


def _to_float(key: str, v) -> float | None:
    if v is None:  # a metric with no value this step
        return None
    try:
        f = float(np.asarray(v).item())  # numpy / jax 0-d arrays and Python numbers
    except (TypeError, ValueError):
        raise ValueError(f"metric {key!r} = {v!r} is not a scalar number; log a float "
                         "(reduce arrays before writing)") from None
    return f if math.isfinite(f) else None


class MetricsWriter:
    """Appends metric rows to `<workdir>/metrics.jsonl` and `<workdir>/tb/`. A disabled
    writer (every process but the first of a multi-process run) writes nothing."""

    def __init__(self, workdir: str, enabled: bool = True):
        if os.path.exists(workdir) and not os.path.isdir(workdir):
            raise ValueError(f"metrics workdir {workdir!r} is a file; pass a directory path")
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb_dir = os.path.join(workdir, "tb")
        if enabled:
            refuse_link(self.path)  # before the TensorBoard writer creates anything
            os.makedirs(workdir, exist_ok=True)
            self.tb = self._tb_writer()

    def _tb_writer(self, purge_step: int | None = None) -> SummaryWriter:
        # tensorboardX names event files by the second they were opened in, so a second
        # writer in the same second would overwrite the first; a nanosecond suffix keeps
        # them apart and sorted in opening order (the order TensorBoard reads them in).
        return SummaryWriter(self.tb_dir, purge_step=purge_step,
                             filename_suffix=f".{time.time_ns():020d}")

    def write(self, step: int, metrics: dict) -> dict:
        """Append one row (flushed to disk before returning); returns the row written."""
        if "step" in metrics:
            raise ValueError("metrics must not contain a 'step' key; pass the step separately")
        row = {"step": int(step), **{k: _to_float(k, v) for k, v in metrics.items()}}
        if not self.enabled:
            return row
        append_jsonl(self.path, row)
        for k, v in row.items():
            if k != "step" and v is not None:
                self.tb.add_scalar(k, v, row["step"])
        self.tb.flush()
        return row

    def text(self, step: int, tag: str, rows: list[dict]) -> None:
        """TensorBoard text under `tag`: one markdown section per row (its fields as
        `key: value` lines, multi-line values in code blocks)."""
        if not self.enabled:
            return
        parts = []
        for i, row in enumerate(rows):
            lines = [f"**{i}**"]
            for k, v in row.items():
                v = str(v)
                lines.append(f"{k}:\n```\n{v}\n```" if "\n" in v or len(v) > 80 else
                             f"{k}: `{v}`")
            parts.append("\n\n".join(lines))
        self.tb.add_text(tag, "\n\n---\n\n".join(parts), int(step))
        self.tb.flush()

    def truncate_after(self, step: int) -> None:
        """Keep only rows with row["step"] <= step (step=-1 empties the file), atomically."""
        if not self.enabled:
            return
        truncate_jsonl(self.path, step)
        # TensorBoard hides events with step >= purge_step from earlier event files.
        self.tb.close()
        self.tb = self._tb_writer(purge_step=step + 1)

    def close(self) -> None:
        if self.enabled:
            self.tb.close()


def append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def refuse_link(path: str) -> None:
    """ValueError naming `path` and the fix when it is a symbolic link (dangling or not):
    a log rewritten by rename would replace the link (module docstring)."""
    if os.path.islink(path):
        raise ValueError(
            f"{path} is a symbolic link (to {os.readlink(path)!r}); the run rewrites this "
            "log by rename, which would replace the link and leave its target stale: "
            "replace the link by a regular file (e.g. a copy of its target), and link the "
            "other way round if the log must appear elsewhere")


def truncate_jsonl(path: str, step: int) -> None:
    """Keep only rows with row["step"] <= step of a step-keyed JSONL file. Atomic: the new
    file replaces the old one by rename, so a crash here loses nothing. A symbolic link
    at `path` is refused (`refuse_link`)."""
    refuse_link(path)
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    tmp = path + ".tmp"
    if os.path.lexists(tmp):  # a crash's leftover; never write through a link there
        os.remove(tmp)
    with open(tmp, "x") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


def read_metrics(path: str) -> list[dict]:
    """Rows of a metrics.jsonl, or of `<path>/metrics.jsonl` for a workdir ([] if absent).
    A torn last line (the process died mid-write) is dropped; a bad line elsewhere is an
    error."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # no trailing newline: an interrupted write
                break
            raise ValueError(f"{path}:{i + 1} is not a JSON object: {line[:80]!r}") from None
    return rows


def torn_tail(path: str) -> int:
    """Bytes of a torn last line of a JSONL file (no newline and not a JSON object: a
    write cut short), 0 if there is none or no file."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 1))
        if size == 0 or f.read(1) == b"\n":
            return 0
        f.seek(0)
        last = f.read().rsplit(b"\n", 1)[-1]
    try:
        json.loads(last)
    except ValueError:
        return len(last)
    return 0


def _series(records: list[dict], key: str, log: bool):
    pts = [(r["step"], r[key]) for r in records
           if r.get(key) is not None and (not log or r[key] > 0)]
    return [p[0] for p in pts], [p[1] for p in pts]


def _draw(ax, runs: dict, title: str, keys: list, log: bool) -> None:
    dropped = False
    for i, (name, records) in enumerate(runs.items()):
        for j, key in enumerate(keys):
            x, y = _series(records, key, log)
            dropped |= log and len(x) < len(_series(records, key, False)[0])
            if not x:
                continue
            label = key if len(runs) == 1 else name if len(keys) == 1 else f"{name}: {key}"
            # Colour tells runs apart, line style tells keys apart.
            ax.plot(x, y, label=label, color=f"C{(i if len(runs) > 1 else j) % 10}",
                    linestyle=["-", "--", ":", "-."][j % 4] if len(runs) > 1 else "-",
                    marker="." if len(x) < 30 else None)
    if log:
        ax.set_yscale("log")
    ax.set_title(title + (" (values <= 0 not shown)" if dropped else ""), fontsize=9)
    ax.set_xlabel("step")
    if ax.lines:
        ax.legend(fontsize=6)


def _present(runs: dict, keys: list) -> bool:
    return any(_series(r, k, False)[0] for r in runs.values() for k in keys)


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9@-]+", "_", title.lower()).strip("_")


def plot_metrics(records: list[dict], out_dir: str, keys: list[str] | None = None, *,
                 panels: list | None = None) -> list[str]:
    """One PNG per panel with data; returns their paths. Default panels: PANELS and
    `eval_set_panels`. `keys` instead draws one panel per key (log scale where PANELS
    puts that key on one)."""
    if keys is not None:
        log_keys = {k for _, ks, log in PANELS if log for k in ks}
        panels = [(k, [k], k in log_keys) for k in keys]
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for title, panel_keys, log in panels or PANELS + eval_set_panels(records):
        if not _present({"run": records}, panel_keys):
            continue
        fig = Figure(figsize=(5, 3.2))
        _draw(fig.subplots(), {"run": records}, title, panel_keys, log)
        fig.tight_layout()
        path = os.path.join(out_dir, _slug(title) + ".png")
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def plot_comparison(runs: dict[str, list[dict]], out_path: str, panels: list | None = None,
                    *, cols: int = 3) -> str:
    """One figure: a grid of panels (those with data in some run), one line per run."""
    panels = [p for p in panels or PANELS if _present(runs, p[1])]
    if not panels:
        raise ValueError(f"none of the panel keys appear in runs {list(runs)}; check the "
                         "metric names (see metrics_io.PANELS)")
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(5 * cols, 3.2 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (title, keys, log) in zip(axes.flat, panels):
        _draw(ax, runs, title, keys, log)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=100)
    return out_path

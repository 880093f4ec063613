"""Run metrics: JSONL (the source of truth), TensorBoard events, PNG plots.

`<workdir>/metrics.jsonl` holds one JSON object per logged global step,
`{"step": s, name: value, ...}`, every value a float, or `null` for a non-finite one (JSON has
no NaN; TensorBoard skips it, `read_metrics` returns None). On resume `truncate_after(step)`
drops the rows a killed run wrote after its last checkpoint, so the file equals an uninterrupted
run's (its `outcome`: the `MEASURED` keys are wall times, different every run), and has
TensorBoard discard those steps (tensorboardX `purge_step`). TensorBoard is one of a run's
trackers (`tensorboard=False`: no tb/ directory; the others: trackers.py).

On a `gs://` workdir (storage.py) the JSONL logs are objects rewritten whole at `flush`
(`storage.AppendFile`: before every checkpoint save, else after storage.FLUSH_EVERY_S);
tensorboardX writes a local temporary directory, uploaded alike (`storage.Mirror`).

A JSONL log the run rewrites on start or resume (metrics.jsonl, samples.jsonl,
minibatches.jsonl, sft_run/metrics.jsonl: `truncate_jsonl`) must be a regular file: the rewrite
by rename would turn a symbolic link into a file, its target silently stale, so a link is
refused (`refuse_link`) before anything is written."""
from __future__ import annotations

import json
import math
import os
import re
import time

import numpy as np
from matplotlib.figure import Figure  # no pyplot: files only, the caller's backend untouched
from tensorboardX import SummaryWriter

from stablerl_jax.runs import storage

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
# rl.attribution (stablerl_jax/method/attribution.py): the parts of log π_θ − log μ.
ATTRIBUTION_PANELS = [
    ("mismatch parts: mean log ratio",
     ["attr/precision_mean", "attr/routing_mean", "attr/staleness_mean",
      "attr/routing_cf_mean"], False),
    ("mismatch parts: mean square",
     ["attr/precision_sqmean", "attr/routing_sqmean", "attr/staleness_sqmean",
      "attr/routing_cf_sqmean", "attr/total_sqmean"], True),
    ("mismatch parts: share of the variance",
     ["attr/precision_share", "attr/routing_share", "attr/staleness_share"], False),
]
_ATTR_BIN = re.compile(r"attr_bin/([a-z]+)_([^/]+)/total_sqmean")
_ATTR_LAYER = re.compile(r"attr_layer/l(\d+)_share")


def eval_set_panels(records: list[dict]) -> list:
    """One panel per eval set the records hold (`eval/<set>/avg@k`, rl/evals.py): its
    avg@k and pass@k, and one of every set's mean response length."""
    names = sorted({m.group(1) for r in records for k in r if (m := _EVAL_SET.fullmatch(k))})
    if not names:
        return []
    return ([(f"eval {n}", [f"eval/{n}/avg@k", f"eval/{n}/pass@k"], False) for n in names]
            + [("eval response length", [f"eval/{n}/length_mean" for n in names], False)])


def attribution_panels(records: list[dict]) -> list:
    """ATTRIBUTION_PANELS plus, for the keys present, a panel per token-bin family (the mean
    square of the total log-ratio per bin) and one of the routing part's per-layer shares."""
    keys = {k for r in records for k in r}
    families: dict[str, list[str]] = {}
    for k in sorted(keys):
        if m := _ATTR_BIN.fullmatch(k):
            families.setdefault(m.group(1), []).append(k)
    layers = sorted((m for k in keys if (m := _ATTR_LAYER.fullmatch(k))),
                    key=lambda m: int(m.group(1)))
    out = list(ATTRIBUTION_PANELS)
    out += [(f"mismatch by {f}: mean square of the total", ks, True)
            for f, ks in families.items()]
    if layers:
        out.append(("routing part: share by layer",
                    [m.group(0) for m in layers] + ["attr_layer/interaction_share"], False))
    return out


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
    """Appends rows to `<workdir>/metrics.jsonl` and, with `tensorboard`, `<workdir>/tb/`.
    Disabled (every process but the first of a multi-process run), it writes nothing."""

    def __init__(self, workdir: str, enabled: bool = True, tensorboard: bool = True):
        if storage.isfile(workdir):
            raise ValueError(f"metrics workdir {workdir!r} is a file; pass a directory path")
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb_dir = os.path.join(workdir, "tb")
        self.log = JsonlLog(self.path, enabled)  # refuses a link before TensorBoard writes
        self.tb = self._tb_files = None
        if enabled:
            storage.makedirs(workdir)
            if tensorboard:
                self._tb_files = storage.Mirror(self.tb_dir)
                self.tb = self._tb_writer()

    def _tb_writer(self, purge_step: int | None = None) -> SummaryWriter:
        # tensorboardX names event files by the second they were opened in, so a second
        # writer in the same second would overwrite the first; a nanosecond suffix keeps
        # them apart and sorted in opening order (the order TensorBoard reads them in).
        return SummaryWriter(self._tb_files.local, purge_step=purge_step,
                             filename_suffix=f".{time.time_ns():020d}")

    def write(self, step: int, metrics: dict) -> dict:
        """Append one row (flushed to disk before returning); returns the row written."""
        if "step" in metrics:
            raise ValueError("metrics must not contain a 'step' key; pass the step separately")
        row = {"step": int(step), **{k: _to_float(k, v) for k, v in metrics.items()}}
        if not self.enabled:
            return row
        self.log.write(row)
        if self.tb is None:
            return row
        for k, v in row.items():
            if k != "step" and v is not None:
                self.tb.add_scalar(k, v, row["step"])
        self.tb.flush()
        self._tb_files.sync(older_than_s=storage.FLUSH_EVERY_S)  # as the rows are
        return row

    def text(self, step: int, tag: str, rows: list[dict]) -> None:
        """TensorBoard text under `tag`: one markdown section per row (its fields as
        `key: value` lines, multi-line values in code blocks)."""
        if self.tb is None:
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

    def flush(self) -> None:
        """All written so far is in the workdir on return (locally each row already is)."""
        if self.enabled:
            self.log.flush()
            if self.tb is not None:
                self._tb_files.sync()

    def truncate_after(self, step: int) -> None:
        """Keep only rows with row["step"] <= step (step=-1 empties the file), atomically."""
        if not self.enabled:
            return
        self.log.truncate_after(step)
        if self.tb is not None:
            # TensorBoard hides events with step >= purge_step from earlier event files.
            self.tb.close()
            self.tb = self._tb_writer(purge_step=step + 1)

    def close(self) -> None:
        if self.enabled:
            self.log.flush()
            if self.tb is not None:
                self.tb.close()
                self._tb_files.close()


class JsonlLog:
    """A step-keyed JSONL log (`{"step": s, ...}` lines), appended row by row, cut back by
    `truncate_after` on resume; disabled (all but the first process) it writes nothing, enabled
    it refuses a link at `path` (`refuse_link`)."""

    def __init__(self, path: str, enabled: bool = True):
        self.path, self.enabled = path, enabled
        self._file = storage.AppendFile(path)
        if enabled:
            refuse_link(path)

    def write(self, row: dict) -> None:
        if self.enabled:
            self._file.append(json.dumps(row) + "\n")

    def flush(self) -> None:
        """On an object store, upload the rows written since the last upload."""
        if self.enabled:
            self._file.flush()

    def truncate_after(self, step: int) -> None:
        """Keep only rows with row["step"] <= step (`truncate_jsonl`)."""
        if self.enabled:
            self._file.flush()
            self._file.replace(_kept(self.path, step))


def refuse_link(path: str) -> None:
    """ValueError naming `path` and the fix if a symlink, dangling or not (module docstring)."""
    if storage.islink(path):
        raise ValueError(
            f"{path} is a symbolic link (to {os.readlink(path)!r}); the run rewrites this "
            "log by rename, which would replace the link and leave its target stale: "
            "replace the link by a regular file (e.g. a copy of its target), and link the "
            "other way round if the log must appear elsewhere")


def truncate_jsonl(path: str, step: int) -> None:
    """Keep only rows with row["step"] <= step of a step-keyed JSONL file, atomically (a rename:
    a crash loses nothing). A symbolic link at `path` is refused (`refuse_link`)."""
    refuse_link(path)
    storage.atomic_write(path, _kept(path, step))


def _kept(path: str, step: int) -> str:
    """The text of a JSONL log's rows with row["step"] <= step."""
    return "".join(json.dumps(r) + "\n" for r in read_metrics(path) if r["step"] <= step)


# Keys of what a row cost (rl/costs.py): wall times and rates, not results of the run.
MEASURED = ("time/", "perf/", "est/")


def outcome(rows: list[dict]) -> list[dict]:
    """The rows without their `MEASURED` keys: what a resumed or repeated run reproduces."""
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows]


def read_metrics(path: str) -> list[dict]:
    """Rows of a metrics.jsonl, or of `<path>/metrics.jsonl` for a workdir ([] if absent). A
    torn last line (died mid-write) is dropped; a bad line elsewhere is an error."""
    if storage.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not storage.exists(path):
        return []
    lines = storage.read_text(path).split("\n")
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
    """Bytes of a JSONL file's torn last line (no newline, not JSON: a write cut short); 0 if
    none or no file. (An object is written whole: only a copied-in one can end torn.)"""
    if not storage.exists(path):
        return 0
    with storage.open_file(path, "rb") as f:
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
    """One PNG per panel with data; returns the paths. Panels: PANELS, `eval_set_panels` and
    `attribution_panels`, or one per key of `keys` (log scale where PANELS has it so)."""
    if keys is not None:
        log_keys = {k for _, ks, log in PANELS if log for k in ks}
        panels = [(k, [k], k in log_keys) for k in keys]
    storage.makedirs(out_dir)
    paths = []
    for title, panel_keys, log in panels or (PANELS + eval_set_panels(records)
                                              + attribution_panels(records)):
        if not _present({"run": records}, panel_keys):
            continue
        fig = Figure(figsize=(5, 3.2))
        _draw(fig.subplots(), {"run": records}, title, panel_keys, log)
        fig.tight_layout()
        path = os.path.join(out_dir, _slug(title) + ".png")
        _save_png(fig, path, dpi=110)
        paths.append(path)
    if keys is None and panels is None:
        paths += plot_time_split(records, out_dir)
    return paths


# The phases of rl/costs.py in the order they run, stacked from the bottom.
TIME_PHASES = ("sample", "reward", "score", "update", "attribution", "eval", "logs",
               "checkpoint", "other")


def plot_time_split(records: list[dict], out_dir: str) -> list[str]:
    """time_per_phase.png: each training row's wall seconds stacked by phase (rl/costs.py),
    the row's time/step on top of them; [] when no row recorded times."""
    rows = [r for r in records if r.get("step", 0) > 0 and r.get("time/step") is not None]
    if not rows:
        return []
    x = [r["step"] for r in rows]
    phases = [p for p in TIME_PHASES if any(r.get(f"time/{p}") for r in rows)]
    fig = Figure(figsize=(6, 3.4))
    ax = fig.subplots()
    ax.stackplot(x, *[[max(r.get(f"time/{p}") or 0.0, 0.0) for r in rows] for p in phases],
                 labels=phases, colors=[f"C{TIME_PHASES.index(p)}" for p in phases])
    ax.plot(x, [r["time/step"] for r in rows], color="k", linewidth=0.8, label="step")
    ax.set_yscale("symlog", linthresh=max(1e-3, min(r["time/step"] for r in rows)))
    ax.set_title("seconds per global step, by phase", fontsize=9)
    ax.set_xlabel("step")
    ax.legend(fontsize=6, loc="upper right", ncol=2)
    fig.tight_layout()
    path = os.path.join(out_dir, "time_per_phase.png")
    _save_png(fig, path, dpi=110)
    return [path]


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
    storage.makedirs(os.path.dirname(storage.abspath(out_path)))
    _save_png(fig, out_path, dpi=100)
    return out_path


def _save_png(fig: Figure, path: str, dpi: int) -> None:
    with storage.open_file(path, "wb") as f:  # a local file or an object
        fig.savefig(f, format="png", dpi=dpi)

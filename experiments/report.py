"""The report of an experiment's runs, beside the outcomes of experiments/stats.py:
`<workdir>/comparison.png` (seed-mean curves, one line per variant, one metric per
panel), `<workdir>/summary.md` and `summary.json` (the per-variant table of
`summary_rows` and the seed-paired differences of `stats.compare`).
"""
from __future__ import annotations

import json
import os

import numpy as np

from experiments import stats
from stablerl_jax.metrics_io import plot_comparison


# The comparison figure: one metric per panel, so each line is one variant (seed mean).
COMPARISON_PANELS = [
    ("training reward", ["reward"], False),
    ("held-out accuracy (avg@k)", ["eval/accuracy"], False),
    ("entropy of π_old (full vocabulary)", ["entropy"], False),
    ("training-inference KL k1 E_μ[log μ_old − log π_old]", ["kl/train_infer_k1"], True),
    ("clip fraction (Â > 0, r > 1+ε_high)", ["clip/frac_high"], False),
    ("clip fraction (Â < 0, r < 1−ε_low)", ["clip/frac_low"], False),
    ("IS weights truncated at C", ["is/frac_truncated"], False),
    ("routing mismatch (μ vs π_old experts)", ["routing/mismatch_rate"], False),
    ("Eq. 5 engine factor: std of log π_old/μ_old", ["eq5/engine_log_std"], True),
    ("Eq. 5 staleness factor: std of log π_θ/π_old", ["eq5/staleness_log_std"], True),
    ("first-order residual |Πρ − 1 − Σ(ρ − 1)|", ["eq5/first_order_residual_abs"], True),
    ("gradient norm", ["grad_norm"], True),
]


def seed_mean(runs: list[list[dict]]) -> list[dict]:
    """Per-step mean over seeds of every metric (None where no seed has a value)."""
    by_step: dict[int, dict[str, list[float]]] = {}
    for records in runs:
        for r in records:
            row = by_step.setdefault(r["step"], {})
            for k, v in r.items():
                if k != "step" and v is not None:
                    row.setdefault(k, []).append(v)
    return [{"step": s, **{k: float(np.mean(v)) for k, v in row.items()}}
            for s, row in sorted(by_step.items())]


def _window(records: list[dict], key: str, part: slice) -> float | None:
    vals = [r[key] for r in records if r.get(key) is not None]
    vals = vals[part]
    return float(np.mean(vals)) if vals else None


def summary_rows(runs: dict[str, list[list[dict]]]) -> list[dict]:
    """Per variant, seed-averaged: held-out accuracy at start / best / final (the mean of
    the last evaluations, stats.final_accuracy), how many seeds collapsed and the mean
    collapse step (stats.collapse_step, censored at the run length + 1), training reward,
    entropy and training–inference KL over the first and last fifth of the steps, routing
    mismatch, the mean square of Eq. 5's two log factors, clip fraction and the fraction of
    updates skipped (non-finite loss or gradient)."""
    out = []
    for name, seeds in runs.items():
        per_seed = []
        for records in seeds:
            steps_ = [r for r in records if r["step"] > 0]
            fifth = max(1, len(steps_) // 5)
            first, last = slice(0, fifth), slice(-fifth, None)
            evals = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
            collapse = stats.collapse_step(records)
            per_seed.append({
                "acc_start": evals[0] if evals else None,
                "acc_best": max(evals) if evals else None,
                "acc_end": stats.final_accuracy(records),
                "collapse": collapse,
                "collapsed": float(collapse <= len(steps_)),
                "reward_first": _window(steps_, "reward", first),
                "reward_last": _window(steps_, "reward", last),
                "entropy_first": _window(steps_, "entropy", first),
                "entropy_last": _window(steps_, "entropy", last),
                "kl_first": _window(steps_, "kl/train_infer_k1", first),
                "kl_last": _window(steps_, "kl/train_infer_k1", last),
                "routing_mismatch": _window(steps_, "routing/mismatch_rate", slice(None)),
                "engine_log_sq": _window(steps_, "eq5/engine_log_sqmean", slice(None)),
                "stale_log_sq": _window(steps_, "eq5/staleness_log_sqmean", slice(None)),
                "clip_frac": _window(steps_, "clip/frac_high", slice(None)),
                "skipped": _window(steps_, "skipped_updates", slice(None)),
            })
        row = {"variant": name, "seeds": len(per_seed)}
        for k in per_seed[0]:
            vals = [s[k] for s in per_seed if s[k] is not None]
            row[k] = float((np.sum if k == "collapsed" else np.mean)(vals)) if vals else None
            if k == "acc_end" and len(vals) > 1:
                row["acc_end_sd"] = float(np.std(vals, ddof=1))
        out.append(row)
    return out


_COLUMNS = [("variant", "variant", "{}"), ("seeds", "seeds", "{}"),
            ("acc_start", "acc@0", "{:.3f}"), ("acc_best", "best acc", "{:.3f}"),
            ("acc_end", "final acc", "{:.3f}"), ("acc_end_sd", "± sd", "{:.3f}"),
            ("collapsed", "seeds collapsed", "{:.0f}"), ("collapse", "collapse step", "{:.0f}"),
            ("reward_first", "reward first⅕", "{:.3f}"), ("reward_last", "reward last⅕", "{:.3f}"),
            ("entropy_first", "entropy first⅕", "{:.3f}"),
            ("entropy_last", "entropy last⅕", "{:.3f}"),
            ("kl_first", "KL k1 first⅕", "{:.2e}"), ("kl_last", "KL k1 last⅕", "{:.2e}"),
            ("routing_mismatch", "routing mismatch", "{:.3f}"),
            ("engine_log_sq", "E[log² engine]", "{:.2e}"),
            ("stale_log_sq", "E[log² staleness]", "{:.2e}"),
            ("clip_frac", "clip frac", "{:.3f}"), ("skipped", "skipped frac", "{:.3f}")]


def markdown_table(rows: list[dict]) -> str:
    cols = [c for c in _COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |",
             "|" + "---|" * len(cols)]
    for r in rows:
        cells = [("—" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(runs: dict, workdir: str, title: str, command: str, groups=None,
           comparisons=(), seeds=None) -> str:
    """Write comparison.png (or comparison_<group>.png per group of variant names) and
    summary.md (+ summary.json): the per-variant table, then for each (A, B) of
    `comparisons` the seed-paired differences (stats.compare) over the seeds both ran
    (`seeds`: {variant: the seeds of its runs, in order}); return the markdown."""
    for group, names in (groups or {"": list(runs)}).items():
        plot_comparison({k: seed_mean(runs[k]) for k in names if k in runs},
                        os.path.join(workdir, f"comparison{'_' + group if group else ''}.png"),
                        COMPARISON_PANELS)
    rows = summary_rows(runs)
    table = markdown_table(rows)
    by_seed = {k: dict(zip(seeds[k], v)) for k, v in runs.items()} if seeds else {}
    compared = [r for a, b in comparisons for r in stats.compare(by_seed, a, b)]
    if compared:
        table += ("\n\nDifferences, seed by seed (experiments/stats.py: final accuracy is "
                  f"the mean of the last {stats.FINAL_EVALS} evaluations; collapse: the "
                  f"{stats.WINDOW}-step mean reward below {stats.COLLAPSE_FRACTION:g} × its "
                  "best so far, censored at steps + 1):\n\n" + stats.markdown(compared))
    with open(os.path.join(workdir, "summary.md"), "w") as f:
        f.write(f"# {title}\n\n```\n{command}\n```\n\n{table}\n")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump({"variants": rows, "comparisons": compared}, f, indent=2)
    return table

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
from stablerl_jax.runs import storage
from stablerl_jax.runs.metrics_io import plot_comparison

# The comparison figure: one metric per panel, so each line is one variant (seed mean).
COMPARISON_PANELS = [
    ("training reward", ["reward"], False),
    ("held-out accuracy (avg@k)", ["eval/accuracy"], False),
    ("entropy of π_old (full vocabulary)", ["entropy"], False),
    ("training-inference KL k1 E_μ[log μ_old − log π_old]", ["kl/train_infer_k1"], True),
    ("clip fraction (Â > 0, r > 1+ε_high)", ["clip/frac_high"], False),
    ("clip fraction (Â < 0, r < 1−ε_low)", ["clip/frac_low"], False),
    ("IS weights truncated at C", ["is/frac_truncated"], False),
    ("per-response log-ratio s = Σ_t log π_old/μ_old", ["seq/log_ratio"], False),
    ("sequence IS weights π_old(y)/μ_old(y) beyond C", ["seq/beyond_cap"], False),
    ("routing mismatch (μ vs π_old experts)", ["routing/mismatch_rate"], False),
    ("Eq. 5 engine factor: std of log π_old/μ_old", ["eq5/engine_log_std"], True),
    ("Eq. 5 staleness factor: std of log π_θ/π_old", ["eq5/staleness_log_std"], True),
    ("first-order residual |Πρ − 1 − Σ(ρ − 1)|", ["eq5/first_order_residual_abs"], True),
    ("gradient norm", ["grad_norm"], True),
    # rl.attribution (docs/method.md §11), drawn where the runs have it.
    ("precision part: E[(log π(θ_old, routes_μ) − log μ)²]", ["attr/precision_sqmean"], True),
    ("routing part without replay: E[routing_cf²]", ["attr/routing_cf_sqmean"], True),
    ("routing part's share of Var(log π_θ − log μ)", ["attr/routing_share"], False),
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


def _carried(r: dict, bin_: str) -> float | None:
    """The share of the step's E[total²] its tokens in `bin_` (attr_bin/<bin_>) carry."""
    share, sq = r.get(f"attr_bin/{bin_}/share"), r.get(f"attr_bin/{bin_}/total_sqmean")
    total = r.get("attr/total_sqmean")
    if share is None or total is None or not total > 0:
        return None
    return share * (sq or 0.0) / total


def attribution_row(steps_: list[dict], collapse: int) -> dict:
    """rl.attribution's outcomes (docs/method.md §11; {} for a run without it), over the
    first fifth of the steps and over the stats.WINDOW steps before the collapse (`pre`;
    the last fifth of a run that does not collapse): E[precision²], E[routing_cf²] (the
    counterfactual routing part, comparable across replay modes), the routing part's share
    of Var(log π_θ − log μ), and the share of E[total²] carried by tokens the sampler drew
    with probability < 0.1 and by the last third of each response."""
    if not any(r.get("attr/total_sqmean") is not None for r in steps_):
        return {}
    fifth = max(1, len(steps_) // 5)
    end = next((i for i, r in enumerate(steps_) if r["step"] >= collapse), len(steps_))
    windows = {"first": steps_[:fifth],
               "pre": steps_[max(0, end - stats.WINDOW):end] if end < len(steps_)
               else steps_[-fifth:]}
    mean = lambda vals: float(np.mean(vals)) if vals else None
    out = {}
    for part, rows in windows.items():
        for name, key in (("prec", "attr/precision_sqmean"),
                          ("routcf", "attr/routing_cf_sqmean"),
                          ("rshare", "attr/routing_share")):
            out[f"attr_{name}_{part}"] = mean([r[key] for r in rows if r.get(key) is not None])
    for name, bin_ in (("lowmu", "mu_lt0.1"), ("late", "pos_last")):
        out[f"attr_{name}_pre"] = mean([v for r in windows["pre"]
                                        if (v := _carried(r, bin_)) is not None])
    return out


def seed_row(records: list[dict]) -> dict:
    """One run's outcomes: held-out accuracy at start / best / final (the mean of the last
    evaluations, stats.final_accuracy), its collapse step (stats.collapse_step, censored at
    the run length + 1), training reward, entropy, training–inference KL and the
    per-response log-ratio s = Σ_t log π_old/μ_old over the first and last fifth of the
    steps, routing mismatch, the mean square of Eq. 5's two log factors, the share of
    sequence IS weights beyond the TIS cap, clip fraction, the fraction of updates
    skipped (non-finite loss or gradient), the drift ‖q − π_old‖₁ (rl.drift_monitor) over
    the first and last fifth and the share of responses trust-region masking removed."""
    steps_ = [r for r in records if r["step"] > 0]
    fifth = max(1, len(steps_) // 5)
    first, last, every = slice(0, fifth), slice(-fifth, None), slice(None)
    evals = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    collapse = stats.collapse_step(records)
    windows = {"reward": "reward", "entropy": "entropy", "kl": "kl/train_infer_k1",
               "seq": "seq/log_ratio", "drift": "drift/l1"}
    return {
        "acc_start": evals[0] if evals else None,
        "acc_best": max(evals) if evals else None,
        "acc_end": stats.final_accuracy(records),
        "collapse": collapse,
        "collapsed": float(collapse <= len(steps_)),
        **{f"{name}_{part}": _window(steps_, key, where)
           for name, key in windows.items()
           for part, where in (("first", first), ("last", last))},
        "routing_mismatch": _window(steps_, "routing/mismatch_rate", every),
        "engine_log_sq": _window(steps_, "eq5/engine_log_sqmean", every),
        "stale_log_sq": _window(steps_, "eq5/staleness_log_sqmean", every),
        "beyond_cap": _window(steps_, "seq/beyond_cap", every),
        "clip_frac": _window(steps_, "clip/frac_high", every),
        "skipped": _window(steps_, "skipped_updates", every),
        "tr_masked": _window(steps_, "trust_region/frac_masked", every),
        **attribution_row(steps_, collapse),
    }


def summary_rows(runs: dict[str, list[list[dict]]]) -> list[dict]:
    """Per variant, `seed_row` averaged over seeds (`collapsed`: how many seeds did), with
    the seeds' sd of the final accuracy."""
    out = []
    for name, seeds in runs.items():
        per_seed = [seed_row(records) for records in seeds]
        row = {"variant": name, "seeds": len(per_seed)}
        for k in per_seed[0]:
            vals = [s[k] for s in per_seed if s[k] is not None]
            row[k] = float((np.sum if k == "collapsed" else np.mean)(vals)) if vals else None
            if k == "acc_end" and len(vals) > 1:
                row["acc_end_sd"] = float(np.std(vals, ddof=1))
        out.append(row)
    return out


def per_seed_rows(runs: dict[str, list[list[dict]]], seeds: dict) -> list[dict]:
    """`seed_row` of every run, labelled with its variant and seed ({variant: seeds})."""
    return [{"variant": name, "seed": seed, **seed_row(records)}
            for name, per_seed in runs.items() for seed, records in zip(seeds[name], per_seed)]


_COLUMNS = [("variant", "variant", "{}"), ("seeds", "seeds", "{}"), ("seed", "seed", "{}"),
            ("acc_start", "acc@0", "{:.3f}"), ("acc_best", "best acc", "{:.3f}"),
            ("acc_end", "final acc", "{:.3f}"), ("acc_end_sd", "± sd", "{:.3f}"),
            ("collapsed", "seeds collapsed", "{:.0f}"), ("collapse", "collapse step", "{:.0f}"),
            ("reward_first", "reward first⅕", "{:.3f}"), ("reward_last", "reward last⅕", "{:.3f}"),
            ("entropy_first", "entropy first⅕", "{:.3f}"),
            ("entropy_last", "entropy last⅕", "{:.3f}"),
            ("kl_first", "KL k1 first⅕", "{:.2e}"), ("kl_last", "KL k1 last⅕", "{:.2e}"),
            ("seq_first", "E[s] first⅕", "{:.1f}"), ("seq_last", "E[s] last⅕", "{:.1f}"),
            ("beyond_cap", "π/μ > cap", "{:.3f}"),
            ("routing_mismatch", "routing mismatch", "{:.3f}"),
            ("engine_log_sq", "E[log² engine]", "{:.2e}"),
            ("stale_log_sq", "E[log² staleness]", "{:.2e}"),
            ("clip_frac", "clip frac", "{:.3f}"), ("skipped", "skipped frac", "{:.3f}"),
            ("drift_first", "‖q−π_old‖₁ first⅕", "{:.2e}"),
            ("drift_last", "‖q−π_old‖₁ last⅕", "{:.2e}"),
            ("tr_masked", "TR masked frac", "{:.3f}"),
            ("attr_prec_first", "E[precision²] first⅕", "{:.2e}"),
            ("attr_prec_pre", "E[precision²] pre", "{:.2e}"),
            ("attr_routcf_first", "E[routing_cf²] first⅕", "{:.2e}"),
            ("attr_routcf_pre", "E[routing_cf²] pre", "{:.2e}"),
            ("attr_rshare_first", "routing share first⅕", "{:.3f}"),
            ("attr_rshare_pre", "routing share pre", "{:.3f}"),
            ("attr_lowmu_pre", "μ<0.1 share pre", "{:.3f}"),
            ("attr_late_pre", "last⅓ share pre", "{:.3f}")]


PER_SEED_KEYS = ("variant", "seed", "acc_start", "acc_best", "acc_end", "collapse",
                 "reward_first", "reward_last", "entropy_first", "entropy_last",
                 "kl_first", "kl_last", "seq_first", "seq_last", "beyond_cap",
                 "attr_prec_first", "attr_prec_pre", "attr_routcf_first", "attr_routcf_pre",
                 "attr_rshare_first", "attr_rshare_pre", "attr_lowmu_pre", "attr_late_pre")


def markdown_table(rows: list[dict], keys=None) -> str:
    """The `_COLUMNS` (those named in `keys`, if given) that some row has a value for."""
    cols = [c for c in _COLUMNS if (keys is None or c[0] in keys)
            and any(r.get(c[0]) is not None for r in rows)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |",
             "|" + "---|" * len(cols)]
    for r in rows:
        cells = [("—" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_table(runs: dict[str, list[list[dict]]]) -> str:
    """Seconds per global step and their split by phase, per variant (rl/costs.py
    time_split of each run, averaged over its seeds); '' when no run recorded times."""
    from stablerl_jax.rl.costs import PHASES, time_split
    rows = {}
    for name, per_seed in runs.items():
        splits = [s for s in (time_split(records) for records in per_seed) if s]
        if splits:
            rows[name] = {k: float(np.mean([s[k] for s in splits])) for k in splits[0]}
    if not rows:
        return ""
    cols = ["step", *(p for p in PHASES if any(r[p] > 0 for r in rows.values())), "other"]
    lines = ["| variant | " + " | ".join("s / global step" if c == "step" else c
                                          for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{r[c]:.3g}" for c in cols) + " |"
              for name, r in rows.items()]
    return "\n".join(lines)


def report(runs: dict, workdir: str, title: str, command: str, groups=None,
           comparisons=(), seeds=None) -> str:
    """Write comparison.png (or comparison_<group>.png per group of variant names) and
    summary.md (+ summary.json): the per-variant table, the per-run table (with `seeds`:
    {variant: the seeds of its runs, in order}), then for each (A, B) of `comparisons` the
    seed-paired differences (stats.compare) over the seeds both ran; return the
    markdown."""
    for group, names in (groups or {"": list(runs)}).items():
        plot_comparison({k: seed_mean(runs[k]) for k in names if k in runs},
                        os.path.join(workdir, f"comparison{'_' + group if group else ''}.png"),
                        COMPARISON_PANELS)
    rows = summary_rows(runs)
    table = markdown_table(rows)
    if seeds:
        table += ("\n\nEach run (the same outcomes, one row per seed):\n\n"
                  + markdown_table(per_seed_rows(runs, seeds), PER_SEED_KEYS))
    costs = cost_table(runs)
    if costs:
        table += ("\n\nWhat a global step cost (seconds, wall clock; the mean over each run's "
                  "rows after its first, whose compiles dominate, then over seeds; "
                  "stablerl_jax/rl/costs.py names the phases):\n\n" + costs)
    by_seed = {k: dict(zip(seeds[k], v)) for k, v in runs.items()} if seeds else {}
    compared = [r for a, b in comparisons for r in stats.compare(by_seed, a, b)]
    if compared:
        table += ("\n\nDifferences, seed by seed (experiments/stats.py: final accuracy is "
                  f"the mean of the last {stats.FINAL_EVALS} evaluations; collapse: the "
                  f"{stats.WINDOW}-step mean reward below {stats.COLLAPSE_FRACTION:g} × its "
                  "best so far, censored at steps + 1):\n\n" + stats.markdown(compared))
    storage.write_text(os.path.join(workdir, "summary.md"),
                       f"# {title}\n\n```\n{command}\n```\n\n{table}\n")
    storage.write_text(os.path.join(workdir, "summary.json"),
                       json.dumps({"variants": rows, "comparisons": compared}, indent=2))
    return table

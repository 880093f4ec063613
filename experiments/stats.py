"""Per-seed outcomes of a run and intervals for the difference between two variants.

Outcomes of one run (its metrics records), each defined here once:

- final accuracy: mean held-out accuracy (avg@k) of the last `FINAL_EVALS` evaluations,
  which averages out part of one evaluation's sampling noise;
- collapse step: the first global step t at which the mean training reward of steps
  t−W+1 … t (W = `WINDOW`) is below `COLLAPSE_FRACTION` of the best such mean before it.
  A run that never collapses is censored at its length + 1 (so "collapses earlier" is a
  smaller number, and "never" the largest);
- reward / KL last fifth: the mean training reward and training–inference k1 KL over
  the last fifth of the steps; with rl.attribution also the mean squares of its
  precision and counterfactual routing parts over the last fifth.

Comparisons. Runs of the same seed share their prompts and the sampler's random keys, so
two variants are compared seed by seed: for outcome y, d_s = y_A,s − y_B,s and the 95 %
interval is the paired t interval mean(d) ± t_{0.975, n−1} · sd(d)/√n. The Welch interval
(unpaired, unequal variances) is given beside it. A difference is resolved when the paired
interval excludes 0 and there are at least MIN_SEEDS seeds.
"""
from __future__ import annotations

import numpy as np
from scipy import stats as sps

FINAL_EVALS = 3
WINDOW = 10
MIN_SEEDS = 3  # two seeds can agree by chance to a zero-width interval
COLLAPSE_FRACTION = 0.5


def _steps(records):
    return [r for r in records if r["step"] > 0]


def final_accuracy(records) -> float | None:
    acc = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    return float(np.mean(acc[-FINAL_EVALS:])) if acc else None


def collapse_step(records) -> int:
    """First step whose W-step mean reward is below COLLAPSE_FRACTION × the best earlier
    W-step mean; the run length + 1 when there is none (censored)."""
    steps = _steps(records)
    rewards = np.array([r["reward"] for r in steps], float)
    if len(rewards) < WINDOW + 1:
        return len(rewards) + 1
    means = np.convolve(rewards, np.ones(WINDOW) / WINDOW, mode="valid")  # ends at W−1 …
    best = np.maximum.accumulate(means)
    below = np.flatnonzero(means[1:] < COLLAPSE_FRACTION * best[:-1])
    return int(steps[below[0] + WINDOW]["step"]) if len(below) else len(rewards) + 1


def _last_fifth(records, key) -> float | None:
    vals = [r[key] for r in _steps(records) if r.get(key) is not None]
    return float(np.mean(vals[-max(1, len(vals) // 5):])) if vals else None


OUTCOMES = {
    "final accuracy": final_accuracy,
    "collapse step": collapse_step,
    "reward last fifth": lambda r: _last_fifth(r, "reward"),
    "KL k1 last fifth": lambda r: _last_fifth(r, "kl/train_infer_k1"),
    # Expert choices that differ between the engines, and how unevenly the sampler loads
    # its experts (the most-loaded one's share over the mean: verl's violation); runs
    # from before these monitors have no value and are skipped.
    "routing flips last fifth": lambda r: _last_fifth(r, "routing/any_flip"),
    "expert load max_vio last fifth": lambda r: _last_fifth(r, "moe/sampler/max_vio"),
    # rl.attribution (docs/method.md §11); runs without it have no value and are skipped.
    "E[precision²] last fifth": lambda r: _last_fifth(r, "attr/precision_sqmean"),
    "E[routing_cf²] last fifth": lambda r: _last_fifth(r, "attr/routing_cf_sqmean"),
}


def interval(a, b, paired: bool, level: float = 0.95) -> tuple[float, float, float]:
    """(mean(a) − mean(b), lower, upper) of the `level` t interval; NaN bounds with fewer
    than two values per side."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if paired:
        d = a - b
        n = len(d)
        if n < 2:
            return float(np.mean(d)), np.nan, np.nan
        half = sps.t.ppf(0.5 + level / 2, n - 1) * np.std(d, ddof=1) / np.sqrt(n)
        return float(np.mean(d)), float(np.mean(d) - half), float(np.mean(d) + half)
    if len(a) < 2 or len(b) < 2:
        return float(a.mean() - b.mean()), np.nan, np.nan
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    se = np.sqrt(va + vb)
    if se == 0:
        return float(a.mean() - b.mean()), float(a.mean() - b.mean()), float(a.mean() - b.mean())
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = sps.t.ppf(0.5 + level / 2, dof) * se
    diff = float(a.mean() - b.mean())
    return diff, diff - half, diff + half


def compare(runs: dict, a: str, b: str) -> list[dict]:
    """One row per outcome: variant a against variant b over the seeds both have
    (`runs`: {variant: {seed: records}})."""
    seeds = sorted(set(runs[a]) & set(runs[b]))
    rows = []
    for name, fn in OUTCOMES.items():
        ya = [fn(runs[a][s]) for s in seeds]
        yb = [fn(runs[b][s]) for s in seeds]
        if any(v is None for v in ya + yb):
            continue
        diff, lo, hi = interval(ya, yb, paired=True)
        _, wlo, whi = interval(ya, yb, paired=False)
        if len(seeds) < MIN_SEEDS:
            verdict = f"fewer than {MIN_SEEDS} seeds"
        elif lo > 0 or hi < 0:
            verdict = f"{a} {'>' if lo > 0 else '<'} {b}"
        else:
            verdict = "not resolved"
        rows.append({"a": a, "b": b, "outcome": name, "seeds": len(seeds),
                     "mean_a": float(np.mean(ya)), "mean_b": float(np.mean(yb)),
                     "diff": diff, "paired_ci": [lo, hi], "welch_ci": [wlo, whi],
                     "verdict": verdict})
    return rows


def _fmt(x, outcome):
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "—"
    return (f"{x:.1f}" if outcome == "collapse step" else
            f"{x:.2e}" if outcome.startswith(("KL", "E[")) else f"{x:.3f}")


def markdown(rows: list[dict]) -> str:
    lines = ["| A | B | outcome | seeds | mean A | mean B | A − B | paired 95 % CI | "
             "Welch 95 % CI | verdict |", "|" + "---|" * 10]
    for r in rows:
        f = lambda x: _fmt(x, r["outcome"])
        lines.append(f"| {r['a']} | {r['b']} | {r['outcome']} | {r['seeds']} | "
                     f"{f(r['mean_a'])} | {f(r['mean_b'])} | {f(r['diff'])} | "
                     f"[{f(r['paired_ci'][0])}, {f(r['paired_ci'][1])}] | "
                     f"[{f(r['welch_ci'][0])}, {f(r['welch_ci'][1])}] | {r['verdict']} |")
    return "\n".join(lines)

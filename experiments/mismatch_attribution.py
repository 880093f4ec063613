"""Where the mismatch comes from: the per-token split of log π_θ − log μ into precision,
routing and staleness (rl.attribution) in a run that collapses and one that does not.

    python -m experiments.mismatch_attribution [--preset tiny|long] [--workdir runs/...]
        [--seeds 0,1] [--only minirl-lr3e-4,...] [--dry-run] [key=value ...]

The on-policy set's settings (experiments/onpolicy.py: one mini-batch per step, FP8
sampling with router noise) with the attribution on and a probe of 8 rows every 10 steps
(the routing part by layer, the tokens in attribution.jsonl). Variants: MiniRL at lr
3e-4, which collapses on the long task (docs/records/results.md, on-policy at lr 3e-4), and
MiniRL + R3 at lr 1e-4, which does not; MiniRL at lr 1e-4 beside them separates the
step size from the replay. With one mini-batch π_θ = π_old at the update, so the
staleness part is 0 here and the total is the training–inference mismatch itself. The
long preset runs 4 seeds × 3 variants × 300 global steps; the paper preset states the
same at paper scale (rl.attribution costs one more score forward per step).

    python -c "from experiments import mismatch_attribution as m; \\
        print(m.tables('runs/attribution_long'))"

prints the attribution's tables over the set's runs (`tables`).
"""
from __future__ import annotations

import os

import numpy as np

from experiments import cli, onpolicy, report, stats
from experiments.runner import Experiment, Variant
from stablerl_jax import presets
from stablerl_jax.config import ExperimentConfig
from stablerl_jax.method.attribution import BINS
from stablerl_jax.runs.metrics_io import read_metrics

VARIANTS = (
    Variant("minirl-lr3e-4", ("rl.optim.learning_rate=3e-4",)),
    Variant("minirl+R3-lr1e-4", (onpolicy.R3,)),
    Variant("minirl-lr1e-4", ()),
)


def with_attribution(base: ExperimentConfig, rows: int = 8) -> ExperimentConfig:
    """`base` with the attribution on and a probe of `rows` rows every 10 steps (0: one
    per batch shard, at least 8)."""
    rl = base.rl.replace(attribution=True, attribution_every=10, attribution_rows=rows)
    return base.replace(name=f"attribution-{base.name}", rl=rl)


def paper() -> ExperimentConfig:
    """presets.paper with the attribution: the probe's rows one per batch shard of the
    v5p-256 mesh (128)."""
    return with_attribution(presets.paper(), rows=0)


EXPERIMENTS = {
    "tiny": lambda: Experiment(with_attribution(onpolicy.tiny_base()), VARIANTS,
                               seeds=(0, 1, 2, 3)),
    "long": lambda: Experiment(with_attribution(onpolicy.long_base()), VARIANTS,
                               seeds=(0, 1, 2, 3)),
    "paper": lambda: Experiment(paper(), VARIANTS, seeds=(0, 1, 2)),
}


def comparisons(names: list[str]) -> list[tuple[str, str]]:
    """The collapsing run against each stable one."""
    pairs = [("minirl-lr3e-4", "minirl+R3-lr1e-4"), ("minirl-lr3e-4", "minirl-lr1e-4"),
             ("minirl+R3-lr1e-4", "minirl-lr1e-4")]
    return [(a, b) for a, b in pairs if a in names and b in names]


def _windows(records: list[dict]) -> dict:
    """{first, pre, last}: the first fifth of the steps, the stats.WINDOW steps before the
    collapse (the last fifth without one: report.attribution_row's `pre`), the last fifth."""
    steps_ = [r for r in records if r["step"] > 0]
    fifth = max(1, len(steps_) // 5)
    end = next((i for i, r in enumerate(steps_) if r["step"] >= stats.collapse_step(records)),
               len(steps_))
    pre = steps_[max(0, end - stats.WINDOW):end] if end < len(steps_) else steps_[-fifth:]
    return {"first": steps_[:fifth], "pre": pre, "last": steps_[-fifth:]}


def tables(workdir: str, variants=None, seeds=(0, 1, 2, 3)) -> str:
    """Markdown tables of the attribution over a set's runs (`<workdir>/<variant>/seed<s>`),
    seed means over the windows of `_windows`: the k1 (minus the mean) of each part and of
    the counterfactual routing part, the parts' shares of the variance, the layers' shares
    of the routing part (probe steps), and per token bin its share of the tokens and of
    E[(log π_θ − log μ)²]."""
    variants = variants or [v.name for v in VARIANTS]
    parts = ("precision", "routing", "staleness", "routing_cf", "total")
    head = ("| variant | window | " + " | ".join(f"k1 {p}" for p in parts)
            + " | precision share | routing share | layer 0 share | layer 1 share | "
              "interaction |")
    out, bins_ = [head, "|" + "---|" * (head.count("|") - 1)], []
    for v in variants:
        runs = [read_metrics(os.path.join(workdir, v, f"seed{s}")) for s in seeds]
        runs = [r for r in runs if r]
        if not runs:
            continue
        def mean(w, fn):
            """The seed mean of each run's mean of fn over window w (NaN: no value)."""
            per_run = [[x for r in _windows(rec)[w] if (x := fn(r)) is not None]
                       for rec in runs]
            per_run = [float(np.mean(v)) for v in per_run if v]
            return float(np.mean(per_run)) if per_run else float("nan")

        for w in ("first", "pre", "last"):
            cells = [f"{0.0 - mean(w, lambda r, p=p: r.get(f'attr/{p}_mean')):.3g}"
                     for p in parts]
            cells += [f"{mean(w, lambda r, k=k: r.get(k)):.3f}" for k in (
                "attr/precision_share", "attr/routing_share", "attr_layer/l0_share",
                "attr_layer/l1_share", "attr_layer/interaction_share")]
            n = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}"
            out.append(f"| {v} ({n}) | {w} | " + " | ".join(cells) + " |")
            for family, _, labels in BINS:
                for label in labels:
                    b = f"{family}_{label}"
                    bins_.append((v, w, b, mean(w, lambda r, b=b: r.get(f"attr_bin/{b}/share")),
                                  mean(w, lambda r, b=b: report._carried(r, b))))
    head = "| variant | window | bin | tokens | share of E[x²] |"
    table = [head, "|---|---|---|---|---|"] + [
        f"| {v} | {w} | {b} | {t:.3f} | {c:.3f} |" for v, w, b, t, c in bins_]
    return "\n".join(out) + "\n\n" + "\n".join(table)


EXPERIMENT = cli.Descriptor(module=__spec__.name, doc=__doc__,
                            title="Mismatch attribution", presets=EXPERIMENTS,
                            comparisons=comparisons)
main = EXPERIMENT.main


if __name__ == "__main__":
    main()

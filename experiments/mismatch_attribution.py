"""Where the mismatch comes from: the per-token split of log π_θ − log μ into precision,
routing and staleness (rl.attribution) in a run that collapses and one that does not.

    python -m experiments.mismatch_attribution [--preset tiny|long] [--workdir runs/...]
        [--seeds 0,1] [--only minirl-lr3e-4,...] [--dry-run] [key=value ...]

The on-policy set's settings (experiments/onpolicy.py: one mini-batch per step, FP8
sampling with router noise) with the attribution on and a probe of 8 rows every 10 steps
(the routing part by layer, the tokens in attribution.jsonl). Variants: MiniRL at lr
3e-4, which collapses on the long task (docs/results.md, on-policy at lr 3e-4), and
MiniRL + R3 at lr 1e-4, which does not; MiniRL at lr 1e-4 beside them separates the
step size from the replay. With one mini-batch π_θ = π_old at the update, so the
staleness part is 0 here and the total is the training–inference mismatch itself. The
long preset runs 4 seeds × 3 variants × 300 global steps; the paper preset states the
same at paper scale (rl.attribution costs one more score forward per step).
"""
from __future__ import annotations

from experiments import cli, onpolicy
from experiments.runner import Experiment, Variant
from stablerl_jax import presets
from stablerl_jax.config import ExperimentConfig

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


EXPERIMENT = cli.Descriptor(module=__spec__.name, doc=__doc__,
                            title="Mismatch attribution", presets=EXPERIMENTS,
                            comparisons=comparisons)
main = EXPERIMENT.main


if __name__ == "__main__":
    main()

"""Zero mismatch: on-policy training with a sampler that computes the trainer's numbers bit
for bit, against today's residual and FP8 mismatch.

    python -m experiments.zero_mismatch [--preset tiny|long] [--workdir runs/zero_mismatch]
        [--seeds 0,1] [--only bitwise-minirl,...] [--dry-run] [key=value ...]

The on-policy set's settings (experiments/onpolicy.py: N = 1, lr 1e-4) in bfloat16
compute, with no router noise, and three samplers: `bitwise` (μ = π_old exactly,
docs/method.md §12), `exact` (the same weights and arithmetic, computed in other call
shapes: the residual mismatch of bfloat16) and `fp8` (FP8 weights). MiniRL under each,
and under `bitwise` also MiniRL + R3 (a no-op when μ = π_old: its metrics must equal
MiniRL's) and MiniRL without the IS weight (exactly 1 when μ = π_old). Questions: does
anything collapse without mismatch; does R3 or the IS weight change anything at zero
mismatch; how far does `exact`'s bfloat16 residual move the outcomes. 4 seeds × 5
variants × 300 global steps per preset.
"""
from __future__ import annotations

from experiments import cli, onpolicy
from experiments.runner import Experiment, Variant
from stablerl_jax.config import ExperimentConfig

VARIANTS = (
    Variant("bitwise-minirl", ("sampling.numerics=bitwise",)),
    Variant("bitwise-minirl+R3", ("sampling.numerics=bitwise", onpolicy.R3)),
    Variant("bitwise-minirl-noIS", ("sampling.numerics=bitwise", onpolicy.NO_IS)),
    Variant("exact-minirl", ("sampling.numerics=exact",)),
    Variant("fp8-minirl", ("sampling.numerics=fp8",)),
)


def base_of(base: ExperimentConfig) -> ExperimentConfig:
    """`base` in bfloat16 compute without router noise (the samplers differ in numerics
    alone)."""
    return base.replace(name=f"zero-{base.name}",
                        model=base.model.replace(compute_dtype="bfloat16"),
                        sampling=base.sampling.replace(router_noise_std=0.0))


EXPERIMENTS = {
    "tiny": lambda: Experiment(base_of(onpolicy.tiny_base()), VARIANTS, seeds=(0, 1, 2, 3)),
    "long": lambda: Experiment(base_of(onpolicy.long_base()), VARIANTS, seeds=(0, 1, 2, 3)),
}


def comparisons(names: list[str]) -> list[tuple[str, str]]:
    """Each variant against bitwise MiniRL."""
    return [(v.name, "bitwise-minirl") for v in VARIANTS[1:]
            if v.name in names and "bitwise-minirl" in names]


EXPERIMENT = cli.Descriptor(module=__spec__.name, doc=__doc__,
                            title="Zero mismatch (bitwise sampler, on-policy)",
                            presets=EXPERIMENTS, comparisons=comparisons)
main = EXPERIMENT.main


if __name__ == "__main__":
    main()

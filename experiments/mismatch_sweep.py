"""How much training–inference mismatch it takes for the IS weight to matter on-policy.

    python -m experiments.mismatch_sweep [--workdir runs/mismatch_sweep] [--seeds 0,1]
        [--only s1.0-minirl,...] [key=value ...]

The on-policy setting (experiments/onpolicy.py) with the sampler's mismatch turned up
step by step: router-logit noise σ ∈ {0, 0.3, 1, 2} on top of FP8 weights, and FP8
activations (per-token e4m3) at σ = 0.3. At each level MiniRL runs with and without the
training–inference IS weight; the level at which the two separate (difference of final
accuracy and of the collapse step, summary.md) is the one the claim runs use. The tiny
preset runs 300 global steps per run.
"""
from __future__ import annotations

from experiments import cli, onpolicy
from experiments.runner import Experiment, Variant

LEVELS = (("s0", ("sampling.router_noise_std=0.0",)),
          ("s0.3", ("sampling.router_noise_std=0.3",)),
          ("s1", ("sampling.router_noise_std=1.0",)),
          ("s2", ("sampling.router_noise_std=2.0",)),
          ("s0.3+actfp8", ("sampling.router_noise_std=0.3", "sampling.act_fp8=true")))
VARIANTS = tuple(Variant(f"{level}-{name}", (*knobs, *extra))
                 for level, knobs in LEVELS
                 for name, extra in (("minirl", ()), ("minirl-noIS", (onpolicy.NO_IS,))))

EXPERIMENTS = {"tiny": lambda: Experiment(onpolicy.tiny_base(), VARIANTS, seeds=(0, 1))}


def comparisons(names: list[str]) -> list[tuple[str, str]]:
    """MiniRL w/o IS against MiniRL at each mismatch level."""
    return [(f"{level}-minirl-noIS", f"{level}-minirl") for level, _ in LEVELS
            if f"{level}-minirl" in names and f"{level}-minirl-noIS" in names]


EXPERIMENT = cli.Descriptor(
    module=__spec__.name, doc=__doc__,
    title="On-policy mismatch sweep (MiniRL with and without the IS weight)",
    presets=EXPERIMENTS, comparisons=comparisons)
main = EXPERIMENT.main


if __name__ == "__main__":
    main()

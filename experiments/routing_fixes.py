"""Which routing fix works: replay, a full-precision router on both engines, a frozen
router, or zero mismatch, side by side.

    python -m experiments.routing_fixes [--preset tiny|long] [--workdir runs/routing_fixes]
        [--seeds 0,1] [--only none,r3-indices,...] [--dry-run] [key=value ...]

The on-policy set's settings (experiments/onpolicy.py: N = 1, FP8 sampling with router
noise) at lr 3e-4, where runs without a fix collapse on the long task, for 150 global
steps. Variants: no fix; R3 replaying indices and gate weights; R3 replaying indices
only (the peers' replay); a float32 router on both engines; a frozen router; a frozen
float32 router; and the zero-mismatch sampler (`sampling.numerics=bitwise`, no router
noise: docs/method.md §12). Each run logs the training–inference KL, the routing flips
and the expert load of both engines (moe/…). The long preset runs 4 seeds × 7 variants.
"""
from __future__ import annotations

from experiments import cli, onpolicy
from experiments.runner import Experiment, Variant
from stablerl_jax.config import ExperimentConfig

FP32_ROUTER = ("model.router_dtype=float32", "sampling.router_dtype=float32")
FROZEN = ("rl.freeze_router=true",)
VARIANTS = (
    Variant("none"),
    Variant("r3-weights", (onpolicy.R3, "rl.replay_weights=true")),
    Variant("r3-indices", (onpolicy.R3,)),
    Variant("fp32-router", FP32_ROUTER),
    Variant("frozen-router", FROZEN),
    Variant("frozen-fp32-router", (*FROZEN, *FP32_ROUTER)),
    Variant("zero-mismatch", ("sampling.numerics=bitwise", "sampling.router_noise_std=0.0")),
)


def at_3e4(base: ExperimentConfig, steps: int = 150) -> ExperimentConfig:
    rl = base.rl.replace(steps=steps, checkpoint_every=50,
                         optim=base.rl.optim.replace(learning_rate=3e-4))
    return base.replace(name=f"routing-{base.name}", rl=rl)


EXPERIMENTS = {
    "tiny": lambda: Experiment(at_3e4(onpolicy.tiny_base()), VARIANTS, seeds=(0, 1, 2, 3)),
    "long": lambda: Experiment(at_3e4(onpolicy.long_base()), VARIANTS, seeds=(0, 1, 2, 3)),
}


def comparisons(names: list[str]) -> list[tuple[str, str]]:
    """Each fix against no fix; indices-only replay against replaying the weights too;
    the frozen float32 router against the frozen one; replay against a float32 router
    (does the router's precision make replay unnecessary?)."""
    pairs = [(v.name, "none") for v in VARIANTS[1:]] + [
        ("r3-indices", "r3-weights"), ("frozen-fp32-router", "frozen-router"),
        ("r3-indices", "fp32-router")]
    return [(a, b) for a, b in pairs if a in names and b in names]


EXPERIMENT = cli.Descriptor(module=__spec__.name, doc=__doc__,
                            title="Routing fixes side by side (on-policy, lr 3e-4)",
                            presets=EXPERIMENTS, comparisons=comparisons)
main = EXPERIMENT.main


if __name__ == "__main__":
    main()

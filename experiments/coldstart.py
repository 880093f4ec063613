"""Different cold starts, then the same RL recipe (paper Fig. 5).

    python -m experiments.coldstart [--preset tiny|paper] [--workdir runs/coldstart]
        [--seeds 0,1] [--only sft-steps,...] [--dry-run] [key=value ...]

Three SFT initializations that differ in their cold-start data: worked solutions in the
'steps' style, in the 'rewrite' style, and answers only ('terse'). Each gets its own
SFT run (cached in `<workdir>/sft-<style>/sft`), then MiniRL + R2 at N = 2 from it on the
same problems with the same reward. The tiny preset runs 3 cold starts × 4 seeds × 150
global steps (300 optimizer steps).
"""
from __future__ import annotations

from experiments import cli
from experiments.runner import Experiment, Variant
from stablerl_jax import presets
from stablerl_jax.config import STYLES, ExperimentConfig, apply_overrides

VARIANTS = tuple(Variant(f"sft-{s}", (f"task.style={s}",)) for s in STYLES)
RECIPE = ("rl.replay=r2", "rl.num_minibatches=2")


def tiny_base() -> ExperimentConfig:
    """The on-policy tiny setting with MiniRL + R2, N = 2, 4 prompts × 8 per mini-batch."""
    from experiments.onpolicy import tiny_base as onpolicy_base
    base = apply_overrides(onpolicy_base(), RECIPE)
    rl = base.rl.replace(steps=150, prompts_per_step=8, eval_every=10, checkpoint_every=50)
    return base.replace(name="coldstart", rl=rl)


EXPERIMENTS = {
    "tiny": lambda: Experiment(tiny_base(), VARIANTS, seeds=(0, 1, 2, 3)),
    # Paper §5: three cold starts distilled from different teachers; MiniRL + R2 at N = 2
    # with 1,024 responses per mini-batch (B = 2,048).
    "paper": lambda: Experiment(apply_overrides(
        presets.paper(), (*RECIPE, "rl.prompts_per_step=128", "sft.steps=2000")), VARIANTS,
        seeds=(0, 1, 2)),
}


def main(argv=None) -> dict:
    return cli.main("coldstart", __doc__, EXPERIMENTS, "Cold starts → MiniRL + R2 (N = 2)", argv,
                    cold_start_per_variant=True)


if __name__ == "__main__":
    main()

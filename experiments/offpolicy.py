"""Off-policy training: a fixed mini-batch, N ∈ {2, 4, 8} updates per global step
(paper Figs. 2–4).

    python -m experiments.offpolicy [--preset tiny|long|paper] [--workdir runs/offpolicy]
        [--seeds 0,1] [--only N2-minirl-noclip,...] [--dry-run] [key=value ...]

The mini-batch size is fixed and the global batch grows with N (B = N × mini-batch), as
in the paper; the k-th update of a step is k−1 optimizer steps stale. Variants at each N:
MiniRL without clipping; MiniRL (clipping, no replay: the control); + R2 without
clipping; + R2 (clipping); + R3 (clipping). The tiny preset runs 4 seeds × 5 variants ×
N ∈ {2, 4, 8} × 100 global steps (800 optimizer steps at N = 8). Figures: comparison_N2.png, comparison_N4.png, comparison_N8.png.
"""
from __future__ import annotations

from experiments import cli
from experiments.runner import Experiment, Variant
from stablerl_jax import presets
from stablerl_jax.config import ExperimentConfig

NS = (2, 4, 8)
NO_CLIP = "loss.clip=false"
BASE_VARIANTS = (
    Variant("minirl-noclip", (NO_CLIP,)),
    Variant("minirl", ()),  # clipping without replay: the control claim 6 needs
    Variant("minirl+R2-noclip", ("rl.replay=r2", NO_CLIP)),
    Variant("minirl+R2", ("rl.replay=r2",)),
    Variant("minirl+R3", ("rl.replay=r3",)),
)


def variants(minibatch_prompts: int) -> tuple[Variant, ...]:
    return tuple(Variant(f"N{n}-{v.name}", (*v.overrides, f"rl.num_minibatches={n}",
                                            f"rl.prompts_per_step={minibatch_prompts * n}"))
                 for n in NS for v in BASE_VARIANTS)


def tiny_base() -> ExperimentConfig:
    """The on-policy tiny setting (FP8 + router noise 0.3) with 4 prompts × 8 responses per
    mini-batch."""
    from experiments.onpolicy import tiny_base as onpolicy_base
    base = onpolicy_base()
    rl = base.rl.replace(steps=100, prompts_per_step=8, num_minibatches=2, eval_every=10,
                         checkpoint_every=50)
    return base.replace(name="offpolicy", rl=rl)


def long_base() -> ExperimentConfig:
    """`tiny_base`'s schedule on the long on-policy setting (onpolicy.long_base)."""
    from experiments.onpolicy import long_base as onpolicy_long
    tiny = tiny_base()
    base = onpolicy_long()
    return base.replace(name="offpolicy-long", rl=base.rl.replace(
        steps=tiny.rl.steps, prompts_per_step=tiny.rl.prompts_per_step,
        num_minibatches=tiny.rl.num_minibatches, eval_every=tiny.rl.eval_every,
        checkpoint_every=tiny.rl.checkpoint_every))


EXPERIMENTS = {
    "tiny": lambda: Experiment(tiny_base(), variants(4), seeds=(0, 1, 2, 3)),
    # Long responses at N = 2 only (claim 7: R2 against R3).
    "long": lambda: Experiment(long_base(), tuple(v for v in variants(4)
                                                  if v.name.startswith("N2-")),
                               seeds=(0, 1, 2, 3)),
    # Paper §5: 1,024 responses (64 prompts × 16) per mini-batch, B = N × 1,024.
    "paper": lambda: Experiment(presets.paper(), variants(64), seeds=(0, 1, 2)),
}


def figure_groups(names: list[str]) -> dict:
    """One comparison figure per N."""
    groups = {f"N{n}": [m for m in names if m.startswith(f"N{n}-")] for n in NS}
    return {g: m for g, m in groups.items() if m}


def comparisons(names: list[str]) -> list[tuple[str, str]]:
    """At each N: R3 against R2 (claims 7, 8); each replay against none, both clipped,
    and clipping against none, without and with R2 (claim 6)."""
    pairs = [("minirl+R3", "minirl+R2"), ("minirl+R2", "minirl"), ("minirl+R3", "minirl"),
             ("minirl", "minirl-noclip"), ("minirl+R2", "minirl+R2-noclip")]
    return [(f"N{n}-{a}", f"N{n}-{b}") for n in NS for a, b in pairs
            if f"N{n}-{a}" in names and f"N{n}-{b}" in names]


EXPERIMENT = cli.Descriptor(module=__spec__.name, doc=__doc__,
                            title="Off-policy (fixed mini-batch, N updates)",
                            presets=EXPERIMENTS, groups=figure_groups, comparisons=comparisons)
main = EXPERIMENT.main


if __name__ == "__main__":
    main()

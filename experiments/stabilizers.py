"""Score centering and trust-region masking against a true zero: the paper's MiniRL, the
two stabilizers and R3, side by side at four mismatch cells, off-policy where runs break.

    python -m experiments.stabilizers [--preset tiny] [--workdir runs/stabilizers]
        [--seeds 0,1] [--only fp8-minirl,...] [--dry-run] [key=value ...]

The off-policy tiny setting (experiments/offpolicy.py) at N = 8 mini-batches and lr 3e-4,
where R2 and unclipped runs collapse, in bfloat16 compute (as experiments/zero_mismatch.py)
with the drift monitor on (rl.drift_monitor: ‖q − π_old‖₁ every step). Cells: `bitwise`
(μ = π_old bit for bit: zero mismatch), `exact` (bfloat16's residual mismatch), `fp8`
(FP8 weights and router noise σ = 0.3: the off-policy sets' mismatch) and `fp8-S2` (the
same with partial rollouts at S = 2: experiments/async_staleness.py's continuous sampler
over 2B slots). Arms at each cell: MiniRL; + score centering (loss.center=exact); +
trust-region masking (k1 ≤ δ = TR_DELTA); + R3; R3 + score centering. 4 seeds × 20
variants × 100 global steps (800 optimizer steps each). Questions: is the drift 0 and
centering an exact no-op at `bitwise`; does centering delay or prevent a collapse, and at
which source; does it replace R3 or add to it; does trust-region masking do what token
clipping does not.
"""
from __future__ import annotations

from experiments import cli, offpolicy, zero_mismatch
from experiments.runner import Experiment, Variant
from stablerl_jax.config import ExperimentConfig

N = 8  # mini-batches per global step
TR_DELTA = 0.5  # δ of trust-region masking on the largest per-token k1 of a response
FP8 = ("sampling.numerics=fp8", "sampling.router_noise_std=0.3")
CENTER = "loss.center=exact"
R3 = "rl.replay=r3"
ARMS = (("minirl", ()), ("center", (CENTER,)),
        ("trust-region", ("loss.trust_region=k1", f"loss.trust_region_delta={TR_DELTA}")),
        ("R3", (R3,)), ("R3+center", (R3, CENTER)))


def cells(b: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The four mismatch cells for B responses a step (fp8-S2: 2B sampler slots)."""
    return (("bitwise", ("sampling.numerics=bitwise",)),
            ("exact", ("sampling.numerics=exact",)),
            ("fp8", FP8),
            ("fp8-S2", (*FP8, "sampling.continuous=true", "rl.max_staleness=2",
                        f"sampling.max_batch={2 * b}")))


def variants(b: int) -> tuple[Variant, ...]:
    return tuple(Variant(f"{cell}-{arm}", (*over, *arm_over))
                 for cell, over in cells(b) for arm, arm_over in ARMS)


def tiny_base() -> ExperimentConfig:
    """offpolicy.tiny_base at N = 8 and lr 3e-4, bfloat16 compute, drift monitor on."""
    base = zero_mismatch.base_of(offpolicy.tiny_base())
    minibatch_prompts = base.rl.prompts_per_step // base.rl.num_minibatches
    rl = base.rl.replace(num_minibatches=N, prompts_per_step=minibatch_prompts * N,
                         drift_monitor=True,
                         optim=base.rl.optim.replace(learning_rate=3e-4))
    return base.replace(name="stabilizers", rl=rl)


def experiment() -> Experiment:
    base = tiny_base()
    return Experiment(base, variants(base.rl.prompts_per_step * base.rl.group_size),
                      seeds=(0, 1, 2, 3))


EXPERIMENTS = {"tiny": experiment}


def figure_groups(names: list[str]) -> dict:
    """One comparison figure per cell."""
    groups = {cell: [m for m in names
                     if m.startswith(cell + "-") and m[len(cell) + 1:] in dict(ARMS)]
              for cell, _ in cells(0)}
    return {g: m for g, m in groups.items() if m}


def comparisons(names: list[str]) -> list[tuple[str, str]]:
    """At each cell: each arm against MiniRL, R3 + centering against R3 (does centering
    add to R3), centering against R3 (does it replace R3)."""
    pairs = []
    for cell, _ in cells(0):
        pairs += [(f"{cell}-{arm}", f"{cell}-minirl") for arm, _ in ARMS[1:]]
        pairs += [(f"{cell}-R3+center", f"{cell}-R3"), (f"{cell}-center", f"{cell}-R3")]
    return [(a, b) for a, b in pairs if a in names and b in names]


EXPERIMENT = cli.Descriptor(module=__spec__.name, doc=__doc__,
                            title="Stabilizers at four mismatch cells (off-policy, N = 8, "
                                  "lr 3e-4)",
                            presets=EXPERIMENTS, groups=figure_groups,
                            comparisons=comparisons)
main = EXPERIMENT.main


if __name__ == "__main__":
    main()

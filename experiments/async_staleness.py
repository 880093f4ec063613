"""Partial rollouts under a staleness bound: does Routing Replay become necessary, and does
the IS weight start to matter, once rollouts are stale for real?

    python -m experiments.async_staleness [--preset tiny|long] [--workdir runs/async]
        [--seeds 0,1] [--only S1-minirl,...] [--dry-run] [key=value ...]

The on-policy set's settings (experiments/onpolicy.py: one mini-batch per step, FP8
sampling with router noise) with the continuous sampler (sampling.continuous) over
half as many slots as a step has responses at S = 0: each step samples its own prompts
to completion (the static sampler's responses). At S = 1, 2 (rl.max_staleness) the
sampler has twice as many slots as a step has responses and keeps B + n = 3B responses
in flight; a step trains on the first Q groups to complete, and the rest continue under
the next step's parameters, so a response's tokens come from up to S + 1 parameter
versions (rl/inflight.py). With B/2 slots a step decodes about twice the mean response
length, so no response of the long task (220-370 tokens) outlives two steps and S = 2
would equal S = 1; 2B slots end a step after about half a mean length.
π_old is the training engine at each token's own version (rl.old_policy=behavior, Eq. 5
kept clean); S = 2 also runs AReaL's proximal choice (π_old = the current parameters).
Variants: S ∈ {0, 1, 2} × {minirl, minirl-noIS, minirl+R3, minirl+R3-noIS}, and
S2-proximal-minirl, S2-proximal-minirl+R3. The long preset runs 4 seeds × 14 variants ×
300 global steps.
"""
from __future__ import annotations

from experiments import cli, onpolicy
from experiments.runner import Experiment, Variant
from stablerl_jax.config import ExperimentConfig

POLICIES = (("minirl", ()), ("minirl-noIS", (onpolicy.NO_IS,)),
            ("minirl+R3", (onpolicy.R3,)), ("minirl+R3-noIS", (onpolicy.R3, onpolicy.NO_IS)))


def variants(b: int) -> tuple[Variant, ...]:
    """The variants for B responses a step: S = 0 over B/2 slots (the static sampler's
    responses), S = 1, 2 over 2B slots (3B responses in flight)."""
    wide = f"sampling.max_batch={2 * b}"
    return tuple(
        Variant(f"S{s}-{name}", (*(("rl.max_staleness=" + str(s), wide) if s else ()), *over))
        for s in (0, 1, 2) for name, over in POLICIES) + tuple(
        Variant(f"S2-proximal-{name}", ("rl.max_staleness=2", wide, "rl.old_policy=proximal",
                                        *over))
        for name, over in POLICIES[::2])


def with_continuous(base: ExperimentConfig) -> ExperimentConfig:
    """`base` sampling continuously over half the step's responses in slots."""
    rl = base.rl
    return base.replace(name=f"async-{base.name}", sampling=base.sampling.replace(
        continuous=True, max_batch=rl.prompts_per_step * rl.group_size // 2))


def experiment(base: ExperimentConfig) -> Experiment:
    base = with_continuous(base)
    return Experiment(base, variants(base.rl.prompts_per_step * base.rl.group_size),
                      seeds=(0, 1, 2, 3))


EXPERIMENTS = {
    "tiny": lambda: experiment(onpolicy.tiny_base()),
    "long": lambda: experiment(onpolicy.long_base()),
}


def comparisons(names: list[str]) -> list[tuple[str, str]]:
    """At each S: R3 against no replay, and without IS against with; each S ≥ 1 variant
    against its S = 0 twin; proximal against behavior at S = 2."""
    pairs = []
    for s in (0, 1, 2):
        pairs += [(f"S{s}-minirl+R3", f"S{s}-minirl"), (f"S{s}-minirl-noIS", f"S{s}-minirl"),
                  (f"S{s}-minirl+R3-noIS", f"S{s}-minirl+R3")]
    pairs += [(f"S{s}-{name}", f"S0-{name}") for s in (1, 2) for name, _ in POLICIES]
    pairs += [(f"S2-proximal-{name}", f"S2-{name}") for name, _ in POLICIES[::2]]
    return [(a, b) for a, b in pairs if a in names and b in names]


EXPERIMENT = cli.Descriptor(module=__spec__.name, doc=__doc__, title="Partial rollouts (S)",
                            presets=EXPERIMENTS, comparisons=comparisons)
main = EXPERIMENT.main


if __name__ == "__main__":
    main()

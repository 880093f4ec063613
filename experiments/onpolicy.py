"""On-policy (N = 1) training with the simulated training–inference mismatch (paper Fig. 1).

    python -m experiments.onpolicy [--preset tiny|long|paper] [--workdir runs/onpolicy]
        [--seeds 0,1] [--only minirl,...] [--dry-run] [key=value ...]

Variants: MiniRL (Eq. 7); + length normalization; w/o training–inference IS; + R3;
+ R3 + length normalization; + R3 w/o IS. One global step = one optimizer step, so π_θ =
π_old at every update and the only gap to the sampler is the engine mismatch. The tiny
preset runs 4 seeds × 6 variants × 300 global steps.
"""
from __future__ import annotations

from experiments import cli
from experiments.runner import Experiment, Variant
from stablerl_jax import presets
from stablerl_jax.config import ExperimentConfig

LEN_NORM = "loss.aggregation=seq_mean_token_mean"
NO_IS = "loss.use_is=false"
R3 = "rl.replay=r3"
LONG_ROUTER_NOISE = 0.4  # σ of the long preset: per-token KL 4.1e-2 at its cold start (docs/records/results.md)
VARIANTS = (
    Variant("minirl"),
    Variant("minirl+lennorm", (LEN_NORM,)),
    Variant("minirl-noIS", (NO_IS,)),
    Variant("minirl+R3", (R3,)),
    Variant("minirl+R3+lennorm", (R3, LEN_NORM)),
    Variant("minirl+R3-noIS", (R3, NO_IS)),
)


def tiny_base() -> ExperimentConfig:
    """The training run's (`tiny`) model and task; FP8 sampling plus router logit noise (σ = 0.3) puts
    the training–inference k1 KL near 1e-2, inside the paper's range."""
    base = presets.tiny()
    rl = base.rl.replace(steps=300, prompts_per_step=16, group_size=8, num_minibatches=1,
                         eval_every=20, eval_k=4, eval_problems=64, checkpoint_every=100,
                         optim=base.rl.optim.replace(learning_rate=1e-4))
    sampling = base.sampling.replace(numerics="fp8", router_noise_std=0.3)
    return base.replace(name="onpolicy", rl=rl, sampling=sampling)


def long_base() -> ExperimentConfig:
    """`tiny_base` on the long task (presets.long: 220–370-token responses), the router
    noise raised so that the per-token training–inference KL matches tiny_base's (long
    solutions are mostly near-certain tokens, where the same noise moves μ less)."""
    base = tiny_base()
    long_ = presets.long()
    return base.replace(
        name="onpolicy-long", model=long_.model, task=long_.task, sft=long_.sft,
        sampling=base.sampling.replace(max_new_tokens=long_.sampling.max_new_tokens,
                                       router_noise_std=LONG_ROUTER_NOISE),
        # Widths in steps of 32 slots: a handful of score/update programs, not dozens.
        rl=base.rl.replace(trim_bucket=32))


EXPERIMENTS = {
    "tiny": lambda: Experiment(tiny_base(), VARIANTS, seeds=(0, 1, 2, 3)),
    "long": lambda: Experiment(long_base(), VARIANTS, seeds=(0, 1, 2, 3)),
    # Paper §5: Qwen3-30B-A3B-shaped MoE, FP8 inference, 64 prompts × 16 = 1,024
    # responses per step and per update (N = 1), lr 1e-6 (see presets.paper).
    "paper": lambda: Experiment(presets.paper(), VARIANTS, seeds=(0, 1, 2)),
}


def comparisons(names: list[str]) -> list[tuple[str, str]]:
    """Each variant against MiniRL (claims 1–4), and R3 w/o IS against R3 (claim 4)."""
    pairs = [(v.name, "minirl") for v in VARIANTS[1:]] + [("minirl+R3-noIS", "minirl+R3")]
    return [(a, b) for a, b in pairs if a in names and b in names]


EXPERIMENT = cli.Descriptor(module=__spec__.name, doc=__doc__, title="On-policy (N = 1)",
                            presets=EXPERIMENTS, comparisons=comparisons)
main = EXPERIMENT.main


if __name__ == "__main__":
    main()

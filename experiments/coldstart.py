"""Different cold starts, then the same RL recipe (paper Fig. 5).

    python -m experiments.coldstart [--preset tiny|paper] [--workdir runs/coldstart]
        [--seeds 0,1] [--only sft-steps,...] [--hf CHECKPOINT_DIR]
        [--sft-data NAME:FILE,NAME:FILE,...] [--dry-run] [key=value ...]

Three SFT initializations that differ in their cold-start data: worked solutions in the
'steps' style, in the 'rewrite' style, and answers only ('terse'). Each gets its own
SFT run (cached in `<workdir>/sft-<style>/sft`), then MiniRL + R2 at N = 2 from it on the
same problems with the same reward. The tiny preset runs 3 cold starts × 4 seeds × 150
global steps (300 optimizer steps).

--sft-data: the cold starts are one per named data file instead (variant `sft-<NAME>`,
`sft.data=FILE`: chat or prompt/response records, or problems with worked solutions;
data/sft_data.py), each trained in `<workdir>/sft-<NAME>/sft`. With --hf every cold start
begins from that checkpoint's weights, with its architecture, tokenizer and chat
template. The paper's design (three cold starts from one base model, each distilled from
a different teacher, then the same RL recipe; the RL problems and eval sets in
task.jsonl_dir, data/math_4096 by default), on a TPU pod:

    python -m experiments.coldstart --preset paper --hf /path/to/Qwen3-30B-A3B-Base
        --sft-data a:/data/teacher_a.jsonl,b:/data/teacher_b.jsonl,c:/data/teacher_c.jsonl
"""
from __future__ import annotations

import re

from experiments import cli
from experiments.runner import Experiment, Variant
from stablerl_jax import presets
from stablerl_jax.config import STYLES, ExperimentConfig, apply_overrides
from stablerl_jax.data import sft_data
from stablerl_jax.runs import storage

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


def add_sft_data(ap) -> None:
    ap.add_argument("--sft-data", default="", metavar="NAME:FILE,...",
                    help="one cold start per named SFT data file (variant sft-NAME) instead "
                         "of the synthetic styles")


def sft_data_variants(args, ap) -> tuple[Variant, ...] | None:
    """One variant per `--sft-data` NAME:FILE (None without the flag)."""
    if not args.sft_data:
        return None
    variants, names = [], set()
    for item in args.sft_data.split(","):
        name, sep, path = item.partition(":")
        if not sep or not path:
            ap.error(f"--sft-data: {item!r} is not NAME:FILE; give e.g. "
                     "--sft-data long:traces.jsonl,short:answers.jsonl")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            ap.error(f"--sft-data: name {name!r} must be letters, digits, '_' or '-' (it "
                     "names the variant sft-NAME and its directory); rename it")
        if name in names:
            ap.error(f"--sft-data: name {name!r} given twice; give each file its own name")
        try:
            sft_data.data_file(path)  # the same files sft.data reads, directories included
        except FileNotFoundError as e:
            ap.error(f"--sft-data: {name}: {e}")
        names.add(name)
        variants.append(Variant(f"sft-{name}", (f"sft.data={storage.abspath(path)}",)))
    return tuple(variants)


EXPERIMENT = cli.Descriptor(module=__spec__.name, doc=__doc__,
                            title="Cold starts → MiniRL + R2 (N = 2)", presets=EXPERIMENTS,
                            cold_start_per_variant=True, add_arguments=add_sft_data,
                            variants_from=sft_data_variants)
main = EXPERIMENT.main


if __name__ == "__main__":
    main()

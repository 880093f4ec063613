"""The command line of every experiment module:

    python -m experiments.<name> [--preset tiny|paper] [--workdir DIR] [--seeds 0,1]
        [--only VARIANT,...] [--hf CHECKPOINT_DIR] [--dry-run] [--report] [--quiet]
        [--tracker NAMES] [--compile-cache DIR] [section.field=value ...]

An experiment module describes itself once, in `EXPERIMENT = cli.Descriptor(...)`, and its
`main` is `EXPERIMENT.main`. `main` parses and validates the command line, then trains
(experiments/runner.py: one cold start, every (variant, seed) run) and writes the report
(experiments/report.py). Overrides apply to every run (e.g. `sampling.numerics=bf16
sampling.router_noise_std=0.5`, the mismatch knobs); `--dry-run` prints each run's
resolved settings and exits (the way to read the `paper` preset, which is a TPU-pod job);
`--report` rebuilds the figures and summary.md from the finished runs' stored metrics
without running anything. `--hf` starts from a Hugging Face Qwen3-MoE checkpoint: its
architecture and tokenizer in every run's config (after the overrides), its weights the
cold start's starting point (read only when the cold start trains, or as the RL start when
sft.steps = 0). `--tracker` names the experiment trackers (tensorboard, wandb, mlflow;
default tensorboard) every run and the cold start log to besides metrics.jsonl
(stablerl_jax/runs/trackers.py; a tracker whose package is missing is refused here). A module
adds its own flags and variants through the descriptor's `add_arguments` and
`variants_from`. `experiments.descriptors()` lists every module's descriptor.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Mapping

from experiments.cli_errors import one_line_errors
from experiments.report import report
from experiments.runner import (
    Experiment,
    Variant,
    finished_runs,
    run_dir,
    run_variants,
    task_and_cold_start,
)
from stablerl_jax import distributed
from stablerl_jax.config import ConfigError
from stablerl_jax.rl import preflight, profiling
from stablerl_jax.runs import compile_cache, storage, trackers
from stablerl_jax.runs import lock as run_lock


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """What one experiment module is: everything its command line and report need.

    module: the module's import name, `__spec__.name` (under `python -m` its `__name__` is
      "__main__"); the experiment's name is its last part, the default workdir
      `runs/<name>`.
    doc: the module's docstring (its first line is the `--help` description).
    title: the report's title.
    presets: {preset name: () -> Experiment}; "tiny" (the default preset) is required.
    groups(variant names) -> {figure suffix: names} splits the comparison figure.
    comparisons(variant names) -> [(a, b)]: the seed-paired differences to report.
    cold_start_per_variant: each variant trains its own SFT cold start (its overrides
      change the SFT data) in `<workdir>/<variant>/`; otherwise one shared cold start.
    add_arguments(ap) adds the module's own flags; variants_from(args, ap) -> the variants
      they ask for instead of the preset's (None: the preset's), refusing bad ones with
      ap.error.
    """

    module: str
    doc: str
    title: str
    presets: Mapping[str, Callable[[], Experiment]]
    groups: Callable[[list[str]], dict] | None = None
    comparisons: Callable[[list[str]], list[tuple[str, str]]] | None = None
    cold_start_per_variant: bool = False
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    variants_from: Callable[..., tuple[Variant, ...] | None] | None = None

    def __post_init__(self):
        package, _, name = self.module.rpartition(".")
        if package != "experiments" or not name:
            raise ValueError(f"Descriptor.module={self.module!r} must be 'experiments.<name>'; "
                             "pass module=__spec__.name")
        if not (self.doc or "").strip():
            raise ValueError(f"Descriptor.doc of {self.module}: empty; pass doc=__doc__ (the "
                             "module's docstring, with its command line)")
        if "tiny" not in self.presets:
            raise ValueError(f"Descriptor.presets of {self.module}: {sorted(self.presets)} has "
                             "no 'tiny' (the default preset, a few minutes on a CPU); add one")

    @property
    def name(self) -> str:
        return self.module.rpartition(".")[2]

    def main(self, argv=None) -> dict:
        """`python -m experiments.<name> ...`: see `main`."""
        return main(self, argv)


def command(module: str, argv=None) -> str:
    """The command line that produced a report (for its header)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python -m experiments." + module, *args])


def parser(desc: Descriptor) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=desc.doc.strip().split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(desc.presets))
    ap.add_argument("--workdir", default=f"runs/{desc.name}")
    ap.add_argument("--seeds", default=None, help="comma-separated; default: the preset's")
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--hf", default="", metavar="CHECKPOINT_DIR",
                    help="start every run from this Hugging Face Qwen3-MoE checkpoint "
                         "(its architecture, tokenizer and weights)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs' settings and exit")
    ap.add_argument("--report", action="store_true",
                    help="only rebuild the figures and summary.md from the finished runs' "
                         "stored metrics (runs not finished are left out and listed)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    trackers.add_argument(ap)
    profiling.add_argument(ap)
    preflight.add_arguments(ap, where="run directories whose runs left")
    ap.add_argument("--traceback", action="store_true",
                    help="on an error, print the full traceback (default: one line, exit 2)")
    distributed.add_arguments(ap)
    compile_cache.add_argument(ap)
    ap.add_argument("overrides", nargs="*", help="section.field=value, applied to every run")
    return ap


def select(exp: Experiment, args, ap) -> tuple[tuple[Variant, ...], tuple[int, ...]]:
    """The variants and seeds the command line asks for, validated against the preset."""
    variants = exp.variants
    if args.only:
        names = args.only.split(",")
        known = [v.name for v in exp.variants]
        bad = [n for n in names if n not in known]
        if bad:
            ap.error(f"--only: unknown variant(s) {bad}; choose from {known}")
        variants = tuple(v for v in exp.variants if v.name in names)
    try:
        seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else exp.seeds
    except ValueError:
        ap.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    try:
        for v in variants:  # validate every run's overrides before any work starts
            exp.config(v, seeds[0], args.overrides)
    except ConfigError as e:
        ap.error(str(e))
    return variants, seeds


def dry_run(exp: Experiment, variants, seeds, overrides) -> None:
    for v in variants:
        cfg = exp.config(v, seeds[0], overrides)
        rl, sampling = cfg.rl, cfg.sampling
        print(f"{v.name} (seeds {list(seeds)}): overrides {list(v.overrides)}\n"
              f"  model L={cfg.model.num_layers} D={cfg.model.d_model} "
              f"E={cfg.model.num_experts} K={cfg.model.top_k} V={cfg.model.vocab_size} "
              f"compute={cfg.model.compute_dtype}"
              + (f" from {exp.hf}" if exp.hf else "") + "\n"
              f"  rl steps={rl.steps} prompts={rl.prompts_per_step} G={rl.group_size} "
              f"N={rl.num_minibatches} replay={rl.replay} lr={rl.optim.learning_rate} "
              f"mesh={cfg.mesh}"
              + (f" mesh_dcn={cfg.mesh_dcn}" if cfg.mesh_dcn != (1, 1, 1) else "") + "\n"
              f"  sampling numerics={sampling.numerics} "
              f"router_noise={sampling.router_noise_std} max_new_tokens="
              f"{sampling.max_new_tokens}\n"
              f"  loss {cfg.loss}")


@one_line_errors
def main(desc: Descriptor, argv=None) -> dict:
    """The command line of the experiment `desc`: parse, validate, (dry-)run, report.

    Returns {variant: [metrics records per seed]}.
    """
    ap = parser(desc)
    if desc.add_arguments:
        desc.add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        distributed.initialize_from(args)
    except ValueError as e:
        ap.error(str(e))
    compile_cache.enable(args.compile_cache)
    exp = desc.presets[args.preset]()
    own = desc.variants_from(args, ap) if desc.variants_from else None
    if own:
        exp = dataclasses.replace(exp, variants=own)
    if args.hf:
        try:
            preflight.check_url(args.hf, "--hf")  # before the copy: bounded, one line
        except (ValueError, OSError) as e:
            ap.error(str(e))
        args.hf = storage.fetch_dir(args.hf)  # a gs:// checkpoint: read from a local copy
        if not os.path.isfile(os.path.join(args.hf, "config.json")):
            ap.error(f"--hf {args.hf}: no config.json there; give a Hugging Face checkpoint "
                     "directory (config.json, *.safetensors, tokenizer.json)")
        exp = dataclasses.replace(exp, hf=os.path.abspath(args.hf))
    variants, seeds = select(exp, args, ap)
    if args.dry_run:
        dry_run(exp, variants, seeds, args.overrides)
        return {}
    if args.report:
        runs, seeds = finished_runs(args.workdir, variants, seeds)
        print(_report(desc, runs, args.workdir, seeds, argv))
        return runs
    try:  # what this machine must offer, before any work starts
        for v in variants:
            preflight.check_run(exp.config(v, seeds[0], args.overrides), args.workdir)
            preflight.allowed_changes(args.allow_config_change,
                                      exp.config(v, seeds[0], args.overrides))
    except (ValueError, PermissionError) as e:
        ap.error(str(e))
    with run_lock.Lock(args.workdir, enabled=distributed.is_main()):
        return _train(desc, exp, args, variants, seeds, argv)


def _report(desc: Descriptor, runs: dict, workdir_: str, seeds: dict, argv) -> str:
    names = list(runs)
    return report(runs, workdir_, desc.title, command(desc.name, argv),
                  desc.groups(names) if desc.groups else None,
                  desc.comparisons(names) if desc.comparisons else (), seeds)


def _train(desc: Descriptor, exp: Experiment, args, variants, seeds, argv) -> dict:
    """main's training part, under the workdir's lock."""
    progress = not args.quiet
    allow = [f for f in args.allow_config_change.split(",") if f]  # checked in main
    for v in variants:  # every run's history, before the cold start
        for s in seeds:
            preflight.check_history(exp.config(v, s, args.overrides),
                                    run_dir(args.workdir, v.name, s), args.replace_history)
    run = functools.partial(run_variants, exp, args.workdir, seeds=seeds,
                            overrides=args.overrides, progress=progress,
                            allow_config_change=allow, trackers=args.tracker,
                            profile=args.profile,
                            replace_history=args.replace_history)
    if desc.cold_start_per_variant:
        runs = {}
        for v in variants:
            data, params = task_and_cold_start(exp.config(v, seeds[0], args.overrides),
                                               os.path.join(args.workdir, v.name), progress,
                                               hf=exp.hf, trackers=args.tracker)
            runs.update(run(data=data, params=params, variants=(v,)))
    else:
        data, params = task_and_cold_start(exp.base_config(args.overrides), args.workdir,
                                           progress, hf=exp.hf, trackers=args.tracker)
        runs = run(data=data, params=params, variants=variants)
    if distributed.is_main():
        print(_report(desc, runs, args.workdir, {v.name: seeds for v in variants}, argv))
    return runs

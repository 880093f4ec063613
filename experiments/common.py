"""Shared machinery of the experiment modules: variants × seeds from one cold start.

An experiment is a base `ExperimentConfig`, a list of named variants (override strings on
top of the base) and a list of seeds. `run` trains the SFT cold start once (cached in
`<workdir>/sft`), then every (variant, seed) RL run from it in
`<workdir>/<variant>/seed<k>` (each resumable, see `rl.loop.run`), and writes
`<workdir>/comparison.png` (seed-mean curves, one line per variant) and
`<workdir>/summary.md` (the table of `summary_rows`).

Command line of every module:

    python -m experiments.<name> [--preset tiny|paper] [--workdir DIR] [--seeds 0,1]
        [--only VARIANT,...] [--dry-run] [--report] [--quiet] [--compile-cache DIR]
        [section.field=value ...]

Overrides apply to every run (e.g. `sampling.numerics=bf16 sampling.router_noise_std=0.5`,
the mismatch knobs); `--dry-run` prints each run's resolved settings and exits (the way to
read the `paper` preset, which is a TPU-pod job); `--report` rebuilds the figures and
summary.md from the finished runs' stored metrics without running anything.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import numpy as np

from experiments import stats
from experiments.cli_errors import one_line_errors
from stablerl_jax import compile_cache, distributed, workdir
from stablerl_jax.config import ConfigError, ExperimentConfig, apply_overrides
from stablerl_jax.metrics_io import plot_comparison, read_metrics
from stablerl_jax.rl import loop, preflight, sft


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One preset of an experiment: what to run and how many times."""

    base: ExperimentConfig
    variants: tuple[Variant, ...]
    seeds: tuple[int, ...] = (0, 1)

    def config(self, variant: Variant, seed: int, overrides=()) -> ExperimentConfig:
        return apply_overrides(
            self.base, (*variant.overrides, *overrides, f"rl.seed={seed}",
                         f"name={variant.name}/seed{seed}"))


# The comparison figure: one metric per panel, so each line is one variant (seed mean).
COMPARISON_PANELS = [
    ("training reward", ["reward"], False),
    ("held-out accuracy (avg@k)", ["eval/accuracy"], False),
    ("entropy of π_old (full vocabulary)", ["entropy"], False),
    ("training-inference KL k1 E_μ[log μ_old − log π_old]", ["kl/train_infer_k1"], True),
    ("clip fraction (Â > 0, r > 1+ε_high)", ["clip/frac_high"], False),
    ("clip fraction (Â < 0, r < 1−ε_low)", ["clip/frac_low"], False),
    ("IS weights truncated at C", ["is/frac_truncated"], False),
    ("routing mismatch (μ vs π_old experts)", ["routing/mismatch_rate"], False),
    ("Eq. 5 engine factor: std of log π_old/μ_old", ["eq5/engine_log_std"], True),
    ("Eq. 5 staleness factor: std of log π_θ/π_old", ["eq5/staleness_log_std"], True),
    ("first-order residual |Σ(ρ−1−log ρ)|", ["eq5/first_order_residual_abs"], True),
    ("gradient norm", ["grad_norm"], True),
]


def seed_mean(runs: list[list[dict]]) -> list[dict]:
    """Per-step mean over seeds of every metric (None where no seed has a value)."""
    by_step: dict[int, dict[str, list[float]]] = {}
    for records in runs:
        for r in records:
            row = by_step.setdefault(r["step"], {})
            for k, v in r.items():
                if k != "step" and v is not None:
                    row.setdefault(k, []).append(v)
    return [{"step": s, **{k: float(np.mean(v)) for k, v in row.items()}}
            for s, row in sorted(by_step.items())]


def _window(records: list[dict], key: str, part: slice) -> float | None:
    vals = [r[key] for r in records if r.get(key) is not None]
    vals = vals[part]
    return float(np.mean(vals)) if vals else None


def summary_rows(runs: dict[str, list[list[dict]]]) -> list[dict]:
    """Per variant, seed-averaged: held-out accuracy at start / best / final (the mean of
    the last evaluations, stats.final_accuracy), how many seeds collapsed and the mean
    collapse step (stats.collapse_step, censored at the run length + 1), training reward,
    entropy and training–inference KL over the first and last fifth of the steps, routing
    mismatch, the mean square of Eq. 5's two log factors, clip fraction and the fraction of
    updates skipped (non-finite loss or gradient)."""
    out = []
    for name, seeds in runs.items():
        per_seed = []
        for records in seeds:
            steps_ = [r for r in records if r["step"] > 0]
            fifth = max(1, len(steps_) // 5)
            first, last = slice(0, fifth), slice(-fifth, None)
            evals = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
            collapse = stats.collapse_step(records)
            per_seed.append({
                "acc_start": evals[0] if evals else None,
                "acc_best": max(evals) if evals else None,
                "acc_end": stats.final_accuracy(records),
                "collapse": collapse,
                "collapsed": float(collapse <= len(steps_)),
                "reward_first": _window(steps_, "reward", first),
                "reward_last": _window(steps_, "reward", last),
                "entropy_first": _window(steps_, "entropy", first),
                "entropy_last": _window(steps_, "entropy", last),
                "kl_first": _window(steps_, "kl/train_infer_k1", first),
                "kl_last": _window(steps_, "kl/train_infer_k1", last),
                "routing_mismatch": _window(steps_, "routing/mismatch_rate", slice(None)),
                "engine_log_sq": _window(steps_, "eq5/engine_log_sqmean", slice(None)),
                "stale_log_sq": _window(steps_, "eq5/staleness_log_sqmean", slice(None)),
                "clip_frac": _window(steps_, "clip/frac_high", slice(None)),
                "skipped": _window(steps_, "skipped_updates", slice(None)),
            })
        row = {"variant": name, "seeds": len(per_seed)}
        for k in per_seed[0]:
            vals = [s[k] for s in per_seed if s[k] is not None]
            row[k] = float((np.sum if k == "collapsed" else np.mean)(vals)) if vals else None
            if k == "acc_end" and len(vals) > 1:
                row["acc_end_sd"] = float(np.std(vals, ddof=1))
        out.append(row)
    return out


_COLUMNS = [("variant", "variant", "{}"), ("seeds", "seeds", "{}"),
            ("acc_start", "acc@0", "{:.3f}"), ("acc_best", "best acc", "{:.3f}"),
            ("acc_end", "final acc", "{:.3f}"), ("acc_end_sd", "± sd", "{:.3f}"),
            ("collapsed", "seeds collapsed", "{:.0f}"), ("collapse", "collapse step", "{:.0f}"),
            ("reward_first", "reward first⅕", "{:.3f}"), ("reward_last", "reward last⅕", "{:.3f}"),
            ("entropy_first", "entropy first⅕", "{:.3f}"),
            ("entropy_last", "entropy last⅕", "{:.3f}"),
            ("kl_first", "KL k1 first⅕", "{:.2e}"), ("kl_last", "KL k1 last⅕", "{:.2e}"),
            ("routing_mismatch", "routing mismatch", "{:.3f}"),
            ("engine_log_sq", "E[log² engine]", "{:.2e}"),
            ("stale_log_sq", "E[log² staleness]", "{:.2e}"),
            ("clip_frac", "clip frac", "{:.3f}"), ("skipped", "skipped frac", "{:.3f}")]


def markdown_table(rows: list[dict]) -> str:
    cols = [c for c in _COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |",
             "|" + "---|" * len(cols)]
    for r in rows:
        cells = [("—" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cold_start(cfg, workdir: str, progress: bool):
    """(TaskData, SFT params) of `cfg`, trained once and cached under `workdir`."""
    data = loop.task_data(cfg, workdir)
    preflight.check_eval_problems(cfg, data)  # before the cold start trains
    params, losses = sft.cold_start(cfg, data, workdir, progress=progress)
    if losses and distributed.is_main():
        print(f"SFT cold start: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
              f"in {len(losses)} steps", flush=True)
    return data, params


def run_variants(exp: Experiment, workdir: str, *, data, params, variants=None, seeds=None,
                 overrides=(), progress: bool = True, prefix: str = "",
                 allow_config_change=()) -> dict:
    """Every (variant, seed) RL run from `params`; returns {name: [records per seed]}."""
    runs = {}
    for v in variants or exp.variants:
        runs[prefix + v.name] = []
        for seed in seeds or exp.seeds:
            cfg = exp.config(v, seed, overrides)
            rundir = os.path.join(workdir, prefix + v.name, f"seed{seed}")
            t0 = time.time()
            s = loop.run(cfg, rundir, init_params=params, data=data, progress=progress,
                         allow_config_change=allow_config_change)
            if distributed.is_main():  # it alone writes (and so reads) the metrics
                print(f"{prefix}{v.name} seed {seed}: accuracy {s['start_accuracy']:.3f} -> "
                      f"{s['end_accuracy']:.3f}, reward {s['start_reward']:.3f} -> "
                      f"{s['end_reward']:.3f} ({time.time() - t0:.0f} s)", flush=True)
                runs[prefix + v.name].append(read_metrics(rundir))
    return runs


def finished_runs(workdir: str, variants, seeds):
    """({variant: [records per finished seed]}, {variant: its finished seeds}) of the runs
    that finished (wrote their summary.json); what is missing is printed."""
    done = {v.name: tuple(s for s in seeds if os.path.exists(
        os.path.join(workdir, v.name, f"seed{s}", "summary.json"))) for v in variants}
    for name, d in done.items():
        missing = sorted(set(seeds) - set(d))
        if missing:
            print(f"{name}: seeds {missing} not finished" + ("" if d else "; left out"))
    runs = {name: [read_metrics(os.path.join(workdir, name, f"seed{s}")) for s in d]
            for name, d in done.items() if d}
    return runs, {name: d for name, d in done.items() if d}


def report(runs: dict, workdir: str, title: str, command: str, groups=None,
           comparisons=(), seeds=None) -> str:
    """Write comparison.png (or comparison_<group>.png per group of variant names) and
    summary.md (+ summary.json): the per-variant table, then for each (A, B) of
    `comparisons` the seed-paired differences (stats.compare) over the seeds both ran
    (`seeds`: {variant: the seeds of its runs, in order}); return the markdown."""
    for group, names in (groups or {"": list(runs)}).items():
        plot_comparison({k: seed_mean(runs[k]) for k in names if k in runs},
                        os.path.join(workdir, f"comparison{'_' + group if group else ''}.png"),
                        COMPARISON_PANELS)
    rows = summary_rows(runs)
    table = markdown_table(rows)
    by_seed = {k: dict(zip(seeds[k], v)) for k, v in runs.items()} if seeds else {}
    compared = [r for a, b in comparisons for r in stats.compare(by_seed, a, b)]
    if compared:
        table += ("\n\nDifferences, seed by seed (experiments/stats.py: final accuracy is "
                  f"the mean of the last {stats.FINAL_EVALS} evaluations; collapse: the "
                  f"{stats.WINDOW}-step mean reward below {stats.COLLAPSE_FRACTION:g} × its "
                  "best so far, censored at steps + 1):\n\n" + stats.markdown(compared))
    with open(os.path.join(workdir, "summary.md"), "w") as f:
        f.write(f"# {title}\n\n```\n{command}\n```\n\n{table}\n")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump({"variants": rows, "comparisons": compared}, f, indent=2)
    return table


def command(module: str, argv=None) -> str:
    """The command line that produced a report (for its header)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python -m experiments." + module, *args])


def parser(description: str, presets: dict, default_workdir: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--preset", default="tiny", choices=sorted(presets))
    ap.add_argument("--workdir", default=default_workdir)
    ap.add_argument("--seeds", default=None, help="comma-separated; default: the preset's")
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--dry-run", action="store_true", help="print the runs' settings and exit")
    ap.add_argument("--report", action="store_true",
                    help="only rebuild the figures and summary.md from the finished runs' "
                         "stored metrics (runs not finished are left out and listed)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--allow-config-change", default="",
                    help="comma-separated section.field names a resumed run may change")
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
              f"compute={cfg.model.compute_dtype}\n"
              f"  rl steps={rl.steps} prompts={rl.prompts_per_step} G={rl.group_size} "
              f"N={rl.num_minibatches} replay={rl.replay} lr={rl.optim.learning_rate} "
              f"mesh={cfg.mesh}\n"
              f"  sampling numerics={sampling.numerics} "
              f"router_noise={sampling.router_noise_std} max_new_tokens="
              f"{sampling.max_new_tokens}\n"
              f"  loss {cfg.loss}")


@one_line_errors
def main(module: str, doc: str, presets: dict, title: str, argv=None, *, groups=None,
         comparisons=None, cold_start_per_variant: bool = False) -> dict:
    """The command line of an experiment module: parse, validate, (dry-)run, report.

    groups(variant names) -> {figure suffix: names} splits the comparison figure.
    cold_start_per_variant: each variant trains its own SFT cold start (its overrides
    change the SFT data) in `<workdir>/<variant>/`; otherwise one shared cold start.
    Returns {variant: [metrics records per seed]}.
    """
    ap = parser(doc.split("\n")[0], presets, f"runs/{module}")
    args = ap.parse_args(argv)
    try:
        distributed.initialize_from(args)
    except ValueError as e:
        ap.error(str(e))
    compile_cache.enable(args.compile_cache)
    exp = presets[args.preset]()
    variants, seeds = select(exp, args, ap)
    if args.dry_run:
        dry_run(exp, variants, seeds, args.overrides)
        return {}
    if args.report:
        runs, seeds = finished_runs(args.workdir, variants, seeds)
        names = list(runs)
        print(report(runs, args.workdir, title, command(module, argv),
                     groups(names) if groups else None,
                     comparisons(names) if comparisons else (), seeds))
        return runs
    try:  # what this machine must offer, before any work starts
        for v in variants:
            preflight.check(exp.config(v, seeds[0], args.overrides), args.workdir)
            preflight.allowed_changes(args.allow_config_change,
                                      exp.config(v, seeds[0], args.overrides))
    except (ValueError, PermissionError) as e:
        ap.error(str(e))
    with workdir.Lock(args.workdir, enabled=distributed.is_main()):
        return _train(exp, args, module, title, variants, seeds, groups, comparisons,
                      cold_start_per_variant, argv)


def _train(exp, args, module, title, variants, seeds, groups, comparisons,
           cold_start_per_variant, argv) -> dict:
    """main's training part, under the workdir's lock."""
    progress = not args.quiet
    allow = [f for f in args.allow_config_change.split(",") if f]  # checked in main
    run = functools.partial(run_variants, exp, args.workdir, seeds=seeds,
                            overrides=args.overrides, progress=progress,
                            allow_config_change=allow)
    if cold_start_per_variant:
        runs = {}
        for v in variants:
            data, params = cold_start(exp.config(v, seeds[0], args.overrides),
                                      os.path.join(args.workdir, v.name), progress)
            runs.update(run(data=data, params=params, variants=(v,)))
    else:
        data, params = cold_start(apply_overrides(exp.base, args.overrides),
                                  args.workdir, progress)
        runs = run(data=data, params=params, variants=variants)
    if distributed.is_main():
        names = [v.name for v in variants]
        table = report(runs, args.workdir, title, command(module, argv),
                       groups(names) if groups else None,
                       comparisons(names) if comparisons else (),
                       {n: seeds for n in names})
        print(table)
    return runs

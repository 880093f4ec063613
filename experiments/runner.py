"""Running an experiment: variants × seeds from one SFT cold start.

An experiment is a base `ExperimentConfig`, a list of named variants (override strings on
top of the base), a list of seeds and optionally a Hugging Face checkpoint every run starts
from (`Experiment`). `task_and_cold_start` trains the SFT cold start once (cached in
`<workdir>/sft`), from the checkpoint's weights when there is one; `run_variants` then
trains every (variant, seed) RL run from it in `<workdir>/<variant>/seed<k>` (each
resumable, see `rl.loop.run`);
`finished_runs` reads back the stored metrics of the runs that finished. The report is
`experiments/report.py`, the command line `experiments/cli.py`. `kept_cold_start` is the
benchmarks' cold start: one per set of settings, kept across runs and benchmarks.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

from stablerl_jax import distributed
from stablerl_jax.config import ExperimentConfig, apply_overrides
from stablerl_jax.interop import hf_checkpoint
from stablerl_jax.rl import loop, preflight, sft
from stablerl_jax.rl.engine import param_shardings, release_programs
from stablerl_jax.runs import checkpoint, storage
from stablerl_jax.runs.metrics_io import read_metrics

# Where `kept_cold_start` keeps the benchmarks' cold starts (STABLERL_COLDSTARTS overrides).
COLDSTARTS = os.environ.get("STABLERL_COLDSTARTS") or os.path.join(
    os.path.expanduser("~"), ".cache", "stablerl_jax", "coldstarts")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One preset of an experiment: what to run and how many times.

    hf: a Hugging Face Qwen3-MoE checkpoint directory every run starts from ("": a fresh
    init); its architecture and tokenizer replace the preset's in every config."""

    base: ExperimentConfig
    variants: tuple[Variant, ...]
    seeds: tuple[int, ...] = (0, 1)
    hf: str = ""

    def config(self, variant: Variant, seed: int, overrides=()) -> ExperimentConfig:
        return self.base_config((*variant.overrides, *overrides, f"rl.seed={seed}",
                                 f"name={variant.name}/seed{seed}"))

    def base_config(self, overrides=()) -> ExperimentConfig:
        """`base` with `overrides`, then the checkpoint's model fields and tokenizer: after
        the overrides, so that the model is the checkpoint's whatever the command line."""
        cfg = apply_overrides(self.base, overrides)
        return hf_checkpoint.experiment_with_checkpoint(cfg, self.hf) if self.hf else cfg


def task_and_cold_start(cfg, workdir: str, progress: bool, hf: str = "",
                        trackers=("tensorboard",)):
    """(TaskData, SFT params) of `cfg`, trained once and cached under `workdir`: from the
    weights of the checkpoint directory `hf` (cfg already carries its architecture,
    `Experiment.config`; read only if the cold start trains or sft.steps = 0), else from
    a fresh init. `trackers`: where the cold start logs (stablerl_jax/runs/trackers.py)."""
    data = loop.task_data(cfg, workdir)
    preflight.check_data(cfg, data)  # before the cold start trains
    # Straight onto the Engine's shardings: no host copy of the model.
    init = (lambda: hf_checkpoint.load_hf_params(hf, cfg.model, param_shardings(cfg))
            ) if hf else None
    params, losses = sft.cold_start(cfg, data, workdir, init_params=init,
                                    init=storage.abspath(hf) if hf else "",
                                    progress=progress, trackers=trackers)
    if losses and distributed.is_main():
        print(f"SFT cold start: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
              f"in {len(losses)} steps", flush=True)
    return data, params


def kept_dir(cfg, root: str = "") -> str:
    """Where `kept_cold_start` keeps cfg's data and cold start: `<root>/<task kind>-<hash
    of the settings they depend on>` (root: COLDSTARTS)."""
    wanted = {**sft.sft_settings(cfg), "rl.eval_sets": cfg.rl.eval_sets}
    key = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(root or COLDSTARTS, f"{cfg.task.kind}-{key}")


def kept_cold_start(cfg, root: str = ""):
    """`task_and_cold_start` in `kept_dir(cfg, root)`: a second benchmark with the same
    settings reuses its data and cold start. Says in one line which directory, and
    whether it trains (with its progress bar) or reuses."""
    path = kept_dir(cfg, root)
    params_dir = os.path.join(path, "sft")
    done = storage.isdir(params_dir) and checkpoint.is_complete(params_dir)
    print(f"cold start: {'reused from' if done else f'{cfg.sft.steps} SFT steps into'} "
          f"{path}", flush=True)
    return task_and_cold_start(cfg, path, progress=not done)


def run_dir(workdir: str, name: str, seed: int) -> str:
    """Where the run of variant `name` at `seed` lives."""
    return os.path.join(workdir, name, f"seed{seed}")


def run_variants(exp: Experiment, workdir: str, *, data, params, variants=None, seeds=None,
                 overrides=(), progress: bool = True, prefix: str = "",
                 allow_config_change=(), trackers=("tensorboard",),
                 replace_history: bool = False, profile=None) -> dict:
    """Every (variant, seed) RL run from `params`, each logging to `trackers`
    (stablerl_jax/runs/trackers.py); returns {name: [records per seed]}."""
    runs = {}
    for v in variants or exp.variants:
        runs[prefix + v.name] = []
        for seed in seeds or exp.seeds:
            cfg = exp.config(v, seed, overrides)
            rundir = run_dir(workdir, prefix + v.name, seed)
            t0 = time.time()
            s = loop.run(cfg, rundir, init_params=params, data=data, progress=progress,
                         allow_config_change=allow_config_change, trackers=trackers,
                         replace_history=replace_history, profile=profile)
            if distributed.is_main():  # it alone writes (and so reads) the metrics
                print(f"{prefix}{v.name} seed {seed}: accuracy {s['start_accuracy']:.3f} -> "
                      f"{s['end_accuracy']:.3f}, reward {s['start_reward']:.3f} -> "
                      f"{s['end_reward']:.3f} ({time.time() - t0:.0f} s)", flush=True)
                runs[prefix + v.name].append(read_metrics(rundir))
        release_programs()  # the next variant compiles its own; see its docstring
    return runs


def finished_runs(workdir: str, variants, seeds):
    """({variant: [records per finished seed]}, {variant: its finished seeds}) of the runs
    that finished (wrote their summary.json); what is missing is printed."""
    done = {v.name: tuple(s for s in seeds if storage.exists(
        os.path.join(workdir, v.name, f"seed{s}", "summary.json"))) for v in variants}
    for name, d in done.items():
        missing = sorted(set(seeds) - set(d))
        if missing:
            print(f"{name}: seeds {missing} not finished" + ("" if d else "; left out"))
    runs = {name: [read_metrics(os.path.join(workdir, name, f"seed{s}")) for s in d]
            for name, d in done.items() if d}
    return runs, {name: d for name, d in done.items() if d}

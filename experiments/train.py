"""SFT cold start, then MiniRL on the synthetic arithmetic task, with FP8 inference.

    python -m experiments.train [--workdir runs/train] [--preset tiny]
        [--layout auto|preset|single-host] [--hf CHECKPOINT_DIR] [--sft-only]
        [--export-hf OUT_DIR] [--export-dtype DTYPE] [--tracker NAMES] [key=value ...]

e.g. `rl.steps=20 rl.replay=r3`. --preset names what to train, --layout where: the
preset's own layout (`paper`'s is a v5p-256's mesh and TPU kernels), or single-host
(this host's devices, the kernels that compile here: presets.single_host); the default,
auto, keeps the preset's where it runs and otherwise says in one line that it runs the
preset single-host. Overrides apply last. Writes to the workdir: sft/ (cold-start params),
sft_run/ (the cold start's metrics.jsonl, TensorBoard and checkpoints), checkpoints/,
metrics.jsonl, samples.jsonl (decoded samples), tb/ (TensorBoard), plots/*.png and
summary.json; prints the start and end held-out accuracy, and the gain with its interval.
Re-running resumes from the last complete checkpoint (of the cold start, then of RL).

--hf: start from a Hugging Face Qwen3-MoE checkpoint instead of a fresh init (the
architecture and the tokenizer come from the checkpoint, every other model field from
the preset and the command line; parameters are read onto the mesh shard by shard, as
model.param_dtype: float32 master weights by default whatever the checkpoint stores).
The cold start runs when sft.steps > 0 (the `paper` preset has 0: its checkpoint is
taken as cold-started), on sft.data (chat or prompt/response records,
data/sft_data.py) or the task's worked solutions, rendered with the checkpoint's chat
template. --sft-only (= rl.steps=0): the cold start, then the eval sets and the export,
without an RL stage.
--export-hf: write the final policy as a Hugging Face checkpoint, in the --hf
checkpoint's dtype unless --export-dtype names another. `rl.offline_rollouts=FILE.npz`
trains on rollouts recorded by an external engine instead of sampling
(stablerl_jax/interop/rollouts.py).
"""
from __future__ import annotations

import argparse
import json
import os
import time

from flax import traverse_util

from experiments.cli_errors import one_line_errors
from stablerl_jax import distributed, presets
from stablerl_jax.config import DTYPES, ConfigError
from stablerl_jax.interop import hf_checkpoint
from stablerl_jax.rl import loop, preflight, profiling, sft
from stablerl_jax.rl.engine import param_shardings
from stablerl_jax.runs import compile_cache, storage, trackers
from stablerl_jax.runs import lock as run_lock


@one_line_errors
def main(argv=None, *, default_workdir: str = "runs/train") -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=default_workdir)
    ap.add_argument("--preset", default="tiny", help="what to train: " + ", ".join(
        presets.EXPERIMENT_PRESETS))
    ap.add_argument("--layout", default="auto", choices=("auto", *presets.LAYOUTS),
                    help="where it runs: the preset's own layout (mesh, kernels, the "
                         "sampler's pass size), 'single-host' (this host's devices, "
                         "kernels that compile here), or 'auto' (the preset's where it runs "
                         "here, else single-host, said in one line)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    trackers.add_argument(ap)
    profiling.add_argument(ap)
    preflight.add_arguments(ap, where="a workdir whose run left")
    ap.add_argument("--hf", default="", help="start from this HF Qwen3-MoE checkpoint dir")
    ap.add_argument("--sft-only", action="store_true",
                    help="the cold start, evaluated and exported; no RL stage (rl.steps=0)")
    ap.add_argument("--export-hf", default="", help="write the final policy here (HF format)")
    ap.add_argument("--export-dtype", default="", choices=("", *DTYPES),
                    help="the exported tensors' dtype (default: the --hf checkpoint's, else "
                         "model.param_dtype)")
    distributed.add_arguments(ap)
    compile_cache.add_argument(ap)
    ap.add_argument("--traceback", action="store_true",
                    help="on an error, print the full traceback (default: one line, exit 2)")
    ap.add_argument("overrides", nargs="*", help="section.field=value")
    args = ap.parse_args(argv)
    try:
        distributed.initialize_from(args)
        compile_cache.enable(args.compile_cache)
        cfg, said = preflight.choose_layout(args.layout, args.preset, [
            *args.overrides, *(["rl.steps=0"] if args.sft_only else [])])
        if said and distributed.is_main():
            print(said, flush=True)
        if args.sft_only and cfg.sft.steps == 0:
            raise ConfigError(f"--sft-only: sft.steps is 0 (preset {args.preset!r}), so there "
                              "is no cold start to train; give sft.steps=N with N > 0")
        preflight.check_run(cfg, args.workdir, hf=args.hf, export_hf=args.export_hf)
        allow = preflight.allowed_changes(args.allow_config_change, cfg)
    except (ConfigError, ValueError, PermissionError) as e:
        ap.error(str(e))
    main_process = distributed.is_main()
    with run_lock.Lock(args.workdir, enabled=main_process):  # before the cold start writes
        return _train(args, cfg, allow, main_process)


def _train(args, cfg, allow, main_process: bool) -> dict:
    t0 = time.time()
    preflight.check_history(cfg, args.workdir, args.replace_history,  # before the cold start
                            args.export_hf)
    export_dtype = args.export_dtype
    if args.hf:
        args.hf = storage.fetch_dir(args.hf)  # a gs:// checkpoint: read from a local copy
        cfg = hf_checkpoint.experiment_with_checkpoint(cfg, args.hf)
        export_dtype = export_dtype or hf_checkpoint.checkpoint_dtype(args.hf)
    data = loop.task_data(cfg, args.workdir)
    preflight.check_data(cfg, data)  # before the cold start trains
    loop.open_offline(cfg)  # likewise: a bad rollout file is refused before any training
    # Straight onto the Engine's mesh and shardings: no host copy of the model; read only
    # when used (a cold start already in the workdir supersedes it).
    init = (lambda: hf_checkpoint.load_hf_params(args.hf, cfg.model, param_shardings(cfg))
            ) if args.hf else None
    params, sft_losses = sft.cold_start(cfg, data, args.workdir, init_params=init,
                                        init=storage.abspath(args.hf) if args.hf else "",
                                        progress=not args.quiet, trackers=args.tracker)
    flat = traverse_util.flatten_dict(params, sep="/")
    if main_process:
        print(f"model: {sum(v.size for v in flat.values()):,} parameters in {len(flat)} "
              "arrays")
        if sft_losses:
            print(f"SFT: loss {sft_losses[0]:.3f} -> {sft_losses[-1]:.3f} in "
                  f"{len(sft_losses)} steps")
    summary = loop.run(cfg, args.workdir, init_params=params, data=data,
                       progress=not args.quiet, export_hf=args.export_hf,
                       export_dtype=export_dtype, allow_config_change=allow,
                       trackers=args.tracker, replace_history=args.replace_history,
                       profile=args.profile)
    summary["wall_seconds"] = round(time.time() - t0, 1)
    if main_process:
        print(json.dumps(summary, indent=2))
        print(f"plots: {os.path.join(args.workdir, 'plots')}")
        print(gain_line(summary, cfg.rl.eval_k))
    return summary


def gain_line(summary: dict, k: int) -> str:
    """The run's held-out avg@k at its first and last evaluation, and the gain with its
    95 % interval (rl/loop.accuracy_gain)."""
    start, end, gain = (summary.get(f) for f in ("start_accuracy", "end_accuracy",
                                                  "accuracy_gain"))
    if start is None:
        return "held-out accuracy: no evaluation ran"
    line = f"held-out avg@{k}: {start:.3f} -> {end:.3f}"
    if gain:
        lo, hi = gain["interval_95"]
        line += (f", gain {gain['gain']:+.3f} (95 % interval [{lo:+.3f}, {hi:+.3f}] from "
                 "the two evaluations' sampling error)")
    return line


if __name__ == "__main__":
    main()

"""Compile an experiment's steps for a TPU pod from this host and say whether they fit.

    python -m experiments.aot_compile --preset paper --topology v5p-256 [key=value ...]
    python -m experiments.aot_compile --preset moe1b --topology v5e-8 --kernels

Needs libtpu: `pip install -e '.[tpu]'` (no TPU is used: the compiler runs here). Lowers
the Engine's own sample, score and update steps (its mesh, shardings and jitted
functions, built on the topology's abstract devices; stablerl_jax/aot.py) and prints,
per step and per chip: argument / output / temp GiB and their total (argument + output +
temp − aliased), the chip's HBM, whether it fits, compile seconds, XLA's FLOP count of
the program (its cost analysis counts a loop body — the layer scan, the micro-batch scan,
the decode loop — once, so it undercounts looped programs), the step's model FLOPs per
chip (stablerl_jax/model/flops.py, every loop iteration counted) and the collective
instructions in the optimized HLO (an instruction inside a loop counts once). `--kernels` also compiles the Pallas
kernels for the topology inside shard_map: the fused log-prob (forward and backward)
and the grouped matmul (forward and backward). Exits 1 if any step does not fit.
`key=value` overrides apply to the preset (e.g. `mesh=1,16,8 model.num_layers=2`).
"""
from __future__ import annotations

import argparse
import sys

from experiments.cli_errors import one_line_errors
from stablerl_jax import aot, presets


def _row(c: aot.Compiled, hbm: float) -> str:
    fits = "yes" if c.total_gib <= hbm else "**no**"
    coll = c.collectives
    return (f"| {c.step} | {c.argument_gib:.2f} | {c.output_gib:.2f} | {c.temp_gib:.2f} | "
            f"{c.total_gib:.2f} | {hbm:.2f} | {fits} | {c.compile_s:.0f} | "
            f"{c.flops / 1e12:.2f} | "
            f"{'-' if c.model_flops != c.model_flops else f'{c.model_flops / 1e12:.1f}'} | "
            f"{coll['all-gather']} | {coll['all-to-all']} | "
            f"{coll['reduce-scatter']} | {coll['all-reduce']} |")


HEADER = ("| step | argument GiB | output GiB | temp GiB | total GiB | HBM GiB | fits? | "
          "compile s | XLA TFLOP / chip | model TFLOP / chip | all-gather | all-to-all | "
          "reduce-scatter | all-reduce |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


@one_line_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="paper", choices=sorted(presets.PRESETS))
    ap.add_argument("--topology", default="v5p-256", help="e.g. v5p-256, v5e-8, v6e-64")
    ap.add_argument("--steps", default="sample,score,update",
                    help="comma-separated, of sample, score, update, sft_update; or none")
    ap.add_argument("--kernels", action="store_true",
                    help="also compile the Pallas kernels inside shard_map")
    ap.add_argument("--traceback", action="store_true",
                    help="on an error, print the full traceback (default: one line, exit 2)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    aot.quiet_libtpu()
    topo = aot.topology(args.topology)
    cfg = presets.preset(args.preset, args.overrides)
    print(f"{args.preset} on {topo.name} ({topo.jax_name}, {topo.chips} chips, "
          f"{topo.hbm_gib} GiB HBM each), mesh {cfg.mesh}, overrides {args.overrides}",
          flush=True)
    print(HEADER, flush=True)
    steps = [] if args.steps == "none" else args.steps.split(",")
    results = aot.compile_steps(cfg, topo, steps,
                                on_done=lambda c: print(_row(c, topo.hbm_gib), flush=True))
    if args.kernels:
        for c in aot.compile_kernels(cfg, topo):
            results.append(c)
            print(_row(c, topo.hbm_gib), flush=True)
    return 0 if all(c.total_gib <= topo.hbm_gib for c in results) else 1


if __name__ == "__main__":
    sys.exit(main())

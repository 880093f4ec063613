"""What zero mismatch costs: the global step's hops with the `bitwise` sampler (and the
per-token trainer it implies) against `exact`, measured side by side in one process.

    python -m benchmarks.bitwise_cost [--steps 10] [--workdir /tmp/bench_bitwise]
        [--only onpolicy,onpolicy-long] [key=value ...]

For each setting of benchmarks/global_step.py it runs `hop_times` (the median of each hop
over the last `--steps` global steps, from the same cold start) under
`sampling.numerics=exact` and under `sampling.numerics=bitwise`, in that order, and
prints one table: the milliseconds of each hop under both and their ratio (bitwise /
exact). The overrides apply to both (e.g. model.compute_dtype=bfloat16).
"""
from __future__ import annotations

import argparse
import os

import jax

from benchmarks.global_step import SETTINGS, hop_times
from experiments import runner
from stablerl_jax import compile_cache
from stablerl_jax.config import apply_overrides

ARMS = ("exact", "bitwise")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--workdir", default="/tmp/bench_bitwise")
    ap.add_argument("--only", default="onpolicy")
    ap.add_argument("--cache", default="", help="persistent compilation cache directory")
    ap.add_argument("overrides", nargs="*", help="section.field=value, applied to both arms")
    args = ap.parse_args(argv)
    compile_cache.enable(args.cache)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPU cores")
    for name in args.only.split(","):
        base = apply_overrides(SETTINGS[name](), [f"rl.steps={args.steps}", *args.overrides])
        data, params = runner.task_and_cold_start(base, args.workdir, progress=False)
        hops = {arm: hop_times(apply_overrides(base, [f"sampling.numerics={arm}"]), data,
                               params, args.steps) for arm in ARMS}
        print(f"\n{name}: compute {base.model.compute_dtype}, "
              f"{base.rl.prompts_per_step * base.rl.group_size} responses per step, "
              f"median of {args.steps} steps\n")
        print("| hop | exact ms | bitwise ms | bitwise / exact |\n|---|---|---|---|")
        for hop, (_, exact) in hops["exact"].items():
            bitwise = hops["bitwise"][hop][1]
            print(f"| {hop} | {exact * 1e3:.1f} | {bitwise * 1e3:.1f} | "
                  f"{bitwise / exact:.2f} |")


if __name__ == "__main__":
    main()

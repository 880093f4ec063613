"""The main job at several seeds: does `python -m experiments.train` learn on any machine?

    python -m experiments.main_job_seeds [--workdir runs/main_job_seeds] [--seeds 0,1,2,3,4]
        [key=value ...]

Another CPU rounds float32 sums differently, and an RL trajectory amplifies that, so a
machine acts like another seed. This runs the main job's exact settings
(experiments/train.py, preset `tiny`) once per seed s, with `sft.seed=s rl.seed=s`: its own
cold start and its own RL trajectory, in `<workdir>/seed<s>` (each resumable: a finished
seed is read back by its run, which checks that its settings are these). Then it prints each seed's held-out avg@k at RL step 0 and
at the end (what the main job prints), the improvement, and the seed-paired 95 % interval
of the mean improvement (experiments/stats.py). Overrides apply to every seed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from experiments import stats, train
from experiments.cli_errors import one_line_errors

# What "learns on any machine" asks of the main job: every seed gains at least MIN_GAIN,
# the mean gain is at least MIN_MEAN_GAIN, and its interval excludes 0.
MIN_GAIN = 0.05
MIN_MEAN_GAIN = 0.08


def seed_run(workdir: str, seed: int, overrides, quiet: bool) -> dict:
    """The summary of the main job at `seed` in `<workdir>/seed<seed>`: trained, resumed,
    or (finished) read back by the run itself, which refuses a changed config."""
    rundir = os.path.join(workdir, f"seed{seed}")
    print(f"seed {seed}: the main job in {rundir}", flush=True)
    argv = ["--workdir", rundir, f"sft.seed={seed}", f"rl.seed={seed}", *overrides]
    return train.main([*argv, "--quiet"] if quiet else argv)


def table(summaries: dict[int, dict]) -> str:
    """Each seed's start → end accuracy and gain, then the mean gain with its interval
    and whether the goals hold."""
    lines = ["| seed | avg@k at step 0 | at the end | gain | wall s of this call |",
             "|---|---|---|---|---|"]
    start = np.array([s["start_accuracy"] for s in summaries.values()])
    end = np.array([s["end_accuracy"] for s in summaries.values()])
    for (seed, s), a, b in zip(summaries.items(), start, end):
        wall = s.get("wall_seconds")
        lines.append(f"| {seed} | {a:.3f} | {b:.3f} | {b - a:+.3f} | "
                     f"{'—' if wall is None else f'{wall:.0f}'} |")
    mean, lo, hi = stats.interval(end, start, paired=True)
    lines.append(f"| mean | {start.mean():.3f} | {end.mean():.3f} | {mean:+.3f} | |")
    gains = end - start
    ok = (len(gains) >= stats.MIN_SEEDS and gains.min() >= MIN_GAIN and mean >= MIN_MEAN_GAIN
          and lo > 0)
    lines += ["", f"mean gain {mean:+.3f}, seed-paired 95 % interval [{lo:+.3f}, {hi:+.3f}] "
              f"over {len(gains)} seeds; smallest gain {gains.min():+.3f}",
              f"goal (every seed >= {MIN_GAIN}, mean >= {MIN_MEAN_GAIN}, interval above 0): "
              + ("met" if ok else "not met")]
    return "\n".join(lines)


@one_line_errors
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="runs/main_job_seeds")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated integers")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("overrides", nargs="*", help="section.field=value, applied to every seed")
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if len(seeds) < stats.MIN_SEEDS or len(set(seeds)) != len(seeds):
        ap.error(f"--seeds: need {stats.MIN_SEEDS} or more distinct seeds for an interval, "
                 f"got {args.seeds!r}")
    t0 = time.time()
    summaries = {s: seed_run(args.workdir, s, args.overrides, args.quiet) for s in seeds}
    print(f"\npython -m experiments.main_job_seeds {' '.join(sys.argv[1:] if argv is None else argv)}"
          f"  ({time.time() - t0:.0f} s)\n")
    print(table(summaries))
    return summaries


if __name__ == "__main__":
    main()

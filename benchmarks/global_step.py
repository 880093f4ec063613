"""Wall time of the RL loop's global step at the experiments' tiny scale, on this machine.

    python -m benchmarks.global_step [--steps 40] [--workdir /tmp/bench_global_step]
        [--coldstarts DIR] [--only onpolicy,offpolicy-N8,onpolicy-long] [--costs] [key=value ...]

For each setting (on-policy: one update of 128 responses; off-policy N = 8: eight updates
of 32; `onpolicy-long`, not run by default: the on-policy setting on the long task,
responses of 220–370 tokens; `onpolicy-long-continuous` and `onpolicy-long-partial`: the
same with the continuous sampler over 64 slots, and with partial rollouts, S = 1, over
256) it prints two tables:

- hops: the median milliseconds of each hop of a global step (sample, reward, score,
  the N updates, the metrics pulled to the host), each waited for so that its own time is
  measured, over the last `--steps` steps of a run started from the cold start, run a
  second time on one engine (the first pass compiles the programs of every trimmed
  window the steps meet, which would otherwise land in some later step's median); and
  the first call of each from the first pass (after the end-to-end runs, so the programs
  already exist in this process: what is left is the first call's own overhead).
  `eval` is one avg@k evaluation.
- end to end: `rl.loop.run` for `--steps` global steps in a fresh workdir (eval every 10
  steps, two checkpoints, metrics, logs and plots written: an experiment's run), run
  first, twice in this process: `first` traces and compiles every program (or loads it,
  with `--cache DIR`, the persistent compilation cache the experiment modules turn on;
  start from an empty DIR to see a machine's first run), `again` is the next run of the
  same configuration in the process, which reuses the Engine's steps as the next seed of
  a variant does (rl/engine.program_config). seconds per global step = wall / steps.

With `--costs`, two more: the run's own record of what a step cost (rl/costs.py: the
mean `time/<phase>` over the rows after the first of the `again` run) beside the hops'
medians (partial rollouts have no hop timing: their sampler runs only inside the loop);
and the overhead of the explicit wait that ends the score phase: end-to-end runs with
`rl.phase_sync` on and off, alternated twice, their mean `time/step` over the rows after
the first.

The cold start (SFT, 300 steps; 1,200 for the long task) is trained once per set of
settings and kept for every later benchmark (experiments/runner.kept_cold_start, under
~/.cache/stablerl_jax/coldstarts or $STABLERL_COLDSTARTS). A line per phase says where
the benchmark is.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

import jax
import numpy as np

from benchmarks.timing import phase
from experiments import async_staleness, offpolicy, onpolicy, runner
from stablerl_jax import distributed
from stablerl_jax.config import apply_overrides
from stablerl_jax.method.diagnostics import reduce_metrics
from stablerl_jax.rl import costs, loop
from stablerl_jax.rl.engine import Engine
from stablerl_jax.runs import compile_cache
from stablerl_jax.runs.metrics_io import read_metrics

SETTINGS = {
    "onpolicy": lambda: onpolicy.tiny_base(),
    "onpolicy-long": lambda: onpolicy.long_base(),
    "offpolicy-N8": lambda: apply_overrides(offpolicy.tiny_base(), [
        "rl.num_minibatches=8", "rl.prompts_per_step=32", "rl.replay=r2"]),
    "onpolicy-long-continuous": lambda: async_staleness.with_continuous(onpolicy.long_base()),
    "onpolicy-long-partial": lambda: apply_overrides(
        async_staleness.with_continuous(onpolicy.long_base()),
        ["rl.max_staleness=1", "sampling.max_batch=256"]),
}


def _timed(fn):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def hop_times(cfg, data, params, steps: int) -> dict:
    """{hop: (first call s, median s)} of `steps` + 1 global steps from `params`, run
    twice on one engine: the first pass gives each hop's first call (with its compile)
    and compiles every shape the steps meet (trimmed windows vary by step), the second
    pass, the same steps again, gives the medians (of its steps after the first)."""
    engine = Engine.create(cfg, eos_id=data.tokenizer.eos_id, pad_id=data.tokenizer.pad_id)
    phase(f"hops: first pass of {steps + 1} global steps (compiles every window)")
    warm = _pass(engine, data, params, steps)
    phase(f"hops: timed pass of {steps + 1} global steps")
    return {k: (warm[k][0], float(np.median(v[1:])))
            for k, v in _pass(engine, data, params, steps).items()}


def _pass(engine, data, params, steps: int) -> dict[str, list[float]]:
    """Each hop's seconds in `steps` + 1 global steps, then 3 evaluations."""
    state = engine.init_state(params)
    rl = engine.cfg.rl
    times: dict[str, list[float]] = {}
    for step in range(steps + 1):
        t_step = time.perf_counter()
        idx = data.train_indices(step, rl.prompts_per_step, rl.seed)
        tokens, mask, answers = data.prompt_batch([data.train[i] for i in idx], rl.group_size)
        key = jax.random.fold_in(jax.random.key(rl.seed), step)
        rollout, t = _timed(lambda: engine.sample(state.params, tokens, mask, key))
        times.setdefault("sample", []).append(t)
        rewards, t = _timed(lambda: data.reward(rollout, answers))
        times.setdefault("reward", []).append(t)
        if rl.trim_bucket:
            rollout, t = _timed(lambda: engine.trim(rollout, rl.trim_bucket))
            times.setdefault("trim", []).append(t)
        (batch, score_metrics), t = _timed(lambda: engine.score(state.params, rollout, rewards))
        times.setdefault("score", []).append(t)
        t0 = time.perf_counter()
        order = loop.minibatch_order(rl.seed, step, len(rewards)).reshape(rl.num_minibatches, -1)
        update_metrics = []
        for rows in order:
            state, m = engine.update(state, engine.select(batch, rows))
            update_metrics.append(m)
        jax.block_until_ready(state)
        times.setdefault(f"{rl.num_minibatches} update(s)", []).append(time.perf_counter() - t0)
        _, t = _timed(lambda: (reduce_metrics([jax.tree.map(distributed.host, score_metrics)]),
                               reduce_metrics([jax.tree.map(distributed.host, m)
                                               for m in update_metrics])))
        times.setdefault("metrics to host", []).append(t)
        times.setdefault("global step (sum)", []).append(time.perf_counter() - t_step)
    for _ in range(3):
        _, t = _timed(lambda: loop.evaluate(engine, state.params, data, 0))
        times.setdefault("eval (avg@k)", []).append(t)
    return times


def end_to_end(cfg, data, params, workdir: str) -> float:
    shutil.rmtree(workdir, ignore_errors=True)
    t0 = time.perf_counter()
    loop.run(cfg, workdir, init_params=params, data=data, progress=False)
    return time.perf_counter() - t0


def cost_tables(cfg, data, params, run_dir: str, hops: dict | None) -> None:
    """The run's own phase split beside the hops, and the phase_sync overhead."""
    phase("costs: four end-to-end runs, rl.phase_sync off and on")
    split = costs.time_split(read_metrics(run_dir))
    hop_of = {"sample": "sample", "reward": "reward", "score": "score",
              "update": f"{cfg.rl.num_minibatches} update(s)", "eval": None}
    print("\n| phase | the run's time/<phase>, mean ms | hop median ms |\n|---|---|---|")
    for phase in ("step", *costs.PHASES, "other"):
        hop = hop_of.get(phase)
        ref = (f"{hops[hop][1] * 1e3:.1f}" if hops and hop in hops else
               f"{hops['global step (sum)'][1] * 1e3:.1f} (sum of hops)" if hops
               and phase == "step" else "—")
        if split.get(phase) or phase == "step":
            print(f"| {phase} | {split[phase] * 1e3:.1f} | {ref} |")
    per_step = {True: [], False: []}
    for sync in (False, True, False, True):
        c = cfg.replace(rl=cfg.rl.replace(phase_sync=sync))
        end_to_end(c, data, params, run_dir)
        per_step[sync].append(costs.time_split(read_metrics(run_dir))["step"])
    on, off = (float(np.mean(per_step[k])) for k in (True, False))
    print(f"\n| rl.phase_sync | runs | mean time/step s |\n|---|---|---|\n"
          f"| true | {per_step[True]} | {on:.3f} |\n| false | {per_step[False]} | {off:.3f} |"
          f"\n\noverhead of the wait: {on / off - 1:+.2%} of the global step")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workdir", default="/tmp/bench_global_step")
    ap.add_argument("--coldstarts", default="",
                    help="where cold starts are kept and reused (default: "
                         "$STABLERL_COLDSTARTS or ~/.cache/stablerl_jax/coldstarts)")
    ap.add_argument("--only", default="onpolicy,offpolicy-N8")
    ap.add_argument("--costs", action="store_true",
                    help="also the run's own cost record beside the hops, and the overhead "
                         "of rl.phase_sync")
    ap.add_argument("--cache", default="",
                    help="persistent compilation cache directory (default: none)")
    ap.add_argument("overrides", nargs="*", help="section.field=value, applied to every run")
    args = ap.parse_args(argv)
    compile_cache.enable(args.cache)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPU cores")
    for name in args.only.split(","):
        cfg = apply_overrides(SETTINGS[name](), [f"rl.steps={args.steps}", "rl.eval_every=10",
                                                 f"rl.checkpoint_every={args.steps // 2}",
                                                 *args.overrides])
        phase(f"{name}: data and cold start")
        data, params = runner.kept_cold_start(cfg, args.coldstarts)
        run_dir = os.path.join(args.workdir, "run_" + name)
        phase(f"{name}: end-to-end run of {args.steps} steps, first (compiles)")
        first = end_to_end(cfg, data, params, run_dir)
        phase(f"{name}: end-to-end run, again")
        again = end_to_end(cfg, data, params, run_dir)
        hops = None if cfg.rl.max_staleness else hop_times(cfg, data, params, args.steps)
        print(f"\n{name}: rl.num_minibatches={cfg.rl.num_minibatches}, "
              f"{cfg.rl.prompts_per_step * cfg.rl.group_size} responses per step\n")
        print("| hop | first call ms | median ms |\n|---|---|---|")
        for hop, (first_call, med) in (hops or {}).items():
            print(f"| {hop} | {first_call * 1e3:.1f} | {med * 1e3:.1f} |")
        print(f"\n| end to end ({args.steps} steps) | wall s | s per global step |\n"
              "|---|---|---|")
        for label, wall in (("first", first), ("again", again)):
            print(f"| {label} | {wall:.1f} | {wall / args.steps:.3f} |")
        if args.costs:
            cost_tables(cfg, data, params, run_dir, hops)


if __name__ == "__main__":
    main()

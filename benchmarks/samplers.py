"""Responses per second of the three samplers, side by side in one process: static
passes, continuous batching, and partial rollouts (S = 1, 2).

    python -m benchmarks.samplers [--preset long] [--slots 64,128] [--steps 6]
        [--warmup 2] [--rounds 3]
        [--sft-steps 200 | --params DIR] [--workdir /tmp/bench_samplers]
        [key=value ...]

Settings: the on-policy experiment's (`experiments/onpolicy.py`: `long_base`, or
`tiny_base` with `--preset tiny`), Q prompts × G responses = B per global step, `n`
sampler slots (sampling.max_batch) for each n of `--slots`. One Engine per sampler, the
task's tokenizer and stop ids, the same parameters throughout (sampling only: nothing
is trained between steps). For each sampler one untimed call (or `--warmup` global
steps) first, so compiles are excluded; then global steps `warmup` … `steps − 1`:

- static: `Engine.sample` with sampling.continuous=false, B rows in B/n strided passes
  of n rows, a pass decoding until its longest response stops.
- continuous: the same call with sampling.continuous=true, n slots refilled as
  responses finish. The same Rollout as the static sampler's by construction
  (continuous.py); the script prints how many responses' tokens came out identical and
  whether log μ did, bit for bit.
- partial S: rl.max_staleness = S, the loop's sampling of a global step
  (`rl/sources.Partial`): `Inflight.prepare` → `Engine.sample_partial` → host copy
  → `Inflight.take`; the queue holds B + n responses and a step ends when Q groups are
  complete.

Every sampler runs once per round (`--rounds`, one after another, so a slow minute of
a shared machine hits each of them); wall s is the median round's sum over the timed
steps (each round's in brackets), a call's copy of its result to the host included.
Columns: responses = those a step returns (B per step; for partial, the consumed
ones); tokens = their completion tokens (for partial some were generated in the step
before); ms per decode step = wall / decode steps (prefills and host work included);
host s (partial): `prepare` + `take`, the queue's bookkeeping on the host; decode
steps: static and continuous from `sampler_schedules.static/continuous` of the response lengths
(the continuous sampler's own count equals the latter, tests/sampling/continuous_test.py),
partial as the sampler returns it; occupancy = tokens generated in the timed calls /
(decode steps × n); dropped (partial): responses reset for staleness.

Parameters: the preset's SFT cold start trained for `--sft-steps` steps (kept for later
runs: experiments/runner.kept_cold_start; 0 = random init), or `--params DIR`, a saved params checkpoint (e.g. a
run's `<workdir>/sft`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

from benchmarks.timing import phase
from experiments import onpolicy, runner
from stablerl_jax import distributed
from stablerl_jax.config import apply_overrides
from stablerl_jax.model import transformer as tf
from stablerl_jax.pod import sampler_schedules
from stablerl_jax.rl import loop
from stablerl_jax.rl.engine import Engine
from stablerl_jax.rl.inflight import Inflight
from stablerl_jax.runs import checkpoint

PRESETS = {"long": onpolicy.long_base, "tiny": onpolicy.tiny_base}


def load_params(cfg, data, args):
    """(params, a line saying where they came from)."""
    if args.params:
        like = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), cfg.model))
        return checkpoint.load_params(args.params, like), f"params from {args.params}"
    if not args.sft_steps:
        return (tf.init_params(jax.random.key(cfg.sft.seed), cfg.model),
                "random init (no SFT)")
    sft_cfg = cfg.replace(sft=cfg.sft.replace(steps=args.sft_steps))
    _, params = runner.kept_cold_start(sft_cfg)  # one per step count, kept for every run
    return params, f"SFT cold start, {args.sft_steps} steps"


def engine_for(cfg, data) -> Engine:
    tok = data.tokenizer
    return Engine.create(cfg, eos_id=tok.eos_id, pad_id=tok.pad_id, stop_ids=tok.stop_ids)


def step_prompts(cfg, data, step: int):
    """Global step `step`'s prompts (as rl/loop.global_step draws them) and key."""
    rl = cfg.rl
    idx = data.train_indices(step, rl.prompts_per_step, rl.seed)
    tokens, mask, _ = data.prompt_batch([data.train[i] for i in idx], rl.group_size)
    return tokens, mask, jax.random.fold_in(jax.random.key(rl.seed), step)


def run_full(cfg, data, params, steps: range, warmup_step: int):
    """static / continuous: (wall s, [Rollout on the host] of `steps`), after one untimed
    call on `warmup_step`'s prompts. A call's wall includes the rollout's copy to the
    host (the loop's rewards read it there)."""
    engine = engine_for(cfg, data)
    jax.block_until_ready(engine.sample(params, *step_prompts(cfg, data, warmup_step)))
    inputs = [step_prompts(cfg, data, k) for k in steps]
    outs, wall = [], 0.0
    for tokens, mask, key in inputs:
        t0 = time.perf_counter()
        out = jax.tree.map(lambda x: np.asarray(distributed.host(x)),
                           engine.sample(params, tokens, mask, key))
        wall += time.perf_counter() - t0
        outs.append(out)
    return wall, outs


def run_partial(cfg, data, params, steps: int, warmup: int) -> dict:
    """Global steps 0 … steps − 1 of partial rollouts with fixed `params`; totals over
    the steps from `warmup` on (`host`: the seconds of `prepare` and `take`)."""
    engine = engine_for(cfg, data)
    pad_id = data.tokenizer.pad_id
    inflight = Inflight.create(cfg, pad_id)
    tot = dict(wall=0.0, host=0.0, responses=0, tokens=0, generated=0, decode_steps=0,
               dropped=0)
    lengths = []
    for step in range(steps):
        t0 = time.perf_counter()
        dropped = inflight.prepare(step, cfg, data, pad_id)
        t1 = time.perf_counter()
        before = int(inflight.queue.progress_I.sum())
        queue, decode_steps = engine.sample_partial(params, inflight.queue, step)
        inflight.queue = jax.tree.map(lambda x: np.array(distributed.host(x)), queue)
        t2 = time.perf_counter()
        rows, _ = inflight.take(cfg)
        t3 = time.perf_counter()
        if step < warmup:
            continue
        done = inflight.queue.completion_IxS[rows].sum(axis=1)
        lengths.append(done)
        tot["wall"] += t3 - t0
        tot["host"] += (t1 - t0) + (t3 - t2)
        tot["responses"] += len(rows)
        tot["tokens"] += int(done.sum())
        # Generated in this call: progress gained (resets happened in prepare, before).
        tot["generated"] += int(inflight.queue.progress_I.sum()) - before
        tot["decode_steps"] += int(distributed.host(decode_steps))
        tot["dropped"] += dropped
    tot["lengths"] = np.concatenate(lengths)
    return tot


def length_line(lengths, truncated, cap: int) -> str:
    q = np.percentile(lengths, [0, 10, 50, 90, 100])
    return (f"lengths (generated tokens, stop token included) over {len(lengths)} responses: "
            f"min {q[0]:.0f}, p10 {q[1]:.0f}, median {q[2]:.0f}, p90 {q[3]:.0f}, "
            f"max {q[4]:.0f}, mean {lengths.mean():.1f}; truncated at {cap}: "
            f"{np.mean(truncated):.1%}")


def bench_slots(base, data, params, n: int, args) -> None:
    """One table for `n` slots: every sampler once per round, rounds one after another
    (so a slow minute of a shared machine hits all of them); the median wall per sampler."""
    rl, c = base.rl, base.sampling.max_new_tokens
    b = rl.prompts_per_step * rl.group_size
    timed = range(args.warmup, args.steps)
    with_ = lambda *over: apply_overrides(base, [f"sampling.max_batch={n}", *over])
    walls: dict[str, list[float]] = {}
    rows: dict[str, tuple] = {}  # name: (responses, tokens, decode steps, occupancy, extra)
    for r in range(args.rounds):
        phase(f"{n} slots: round {r + 1} of {args.rounds}")
        static_wall, static = run_full(with_("sampling.continuous=false"), data, params,
                                       timed, 0)
        cont_wall, cont = run_full(with_("sampling.continuous=true"), data, params, timed, 0)
        for name, wall, outs, plan in (
                ("static", static_wall, static, sampler_schedules.static),
                ("continuous", cont_wall, cont, sampler_schedules.continuous)):
            walls.setdefault(name, []).append(wall)
            runs = [plan(r.lengths_B, n).runs for r in outs]
            steps = sum(r.steps for r in runs)
            tokens = int(sum(r.lengths_B.sum() for r in outs))
            rows[name] = (b * len(outs), tokens, steps, tokens / (steps * n), "–", "–")
        for s in args.staleness:
            p = run_partial(with_("sampling.continuous=true", f"rl.max_staleness={s}"), data,
                            params, args.steps, args.warmup)
            name = f"partial S={s}"
            walls.setdefault(name, []).append(p["wall"])
            walls.setdefault(name + " host", []).append(p["host"])
            rows[name] = (p["responses"], p["tokens"], p["decode_steps"],
                          p["generated"] / (p["decode_steps"] * n), str(p["dropped"]), None)
            lengths_p = p["lengths"]
    same_BxS = np.concatenate([s.tokens_BxS == k.tokens_BxS for s, k in zip(static, cont)])
    same_logp = all(np.array_equal(s.logp_mu_BxS, k.logp_mu_BxS) for s, k in zip(static, cont))
    lengths = np.concatenate([r.lengths_B for r in static])
    truncated = np.concatenate([r.truncated_B for r in static])
    print(f"\n### n = {n} slots ({b // n} static passes of {n} rows; partial queue "
          f"{b + n} responses), global steps {args.warmup}–{args.steps - 1} timed, "
          f"median of {args.rounds} round(s)\n")
    print("static: " + length_line(lengths, truncated, c))
    if args.staleness:
        print(f"partial, consumed responses: mean length {lengths_p.mean():.1f}, "
              f"median {np.median(lengths_p):.0f}")
    print(f"continuous vs static: tokens of {same_BxS.all(1).sum()} of {len(same_BxS)} "
          f"responses identical, log μ bit for bit: {same_logp}")
    print("\n| sampler | responses | tokens | wall s (rounds) | responses/s | tokens/s "
          "| decode steps | ms per decode step | occupancy | host s | dropped "
          "| responses/s vs static |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ref = rows["static"][0] / float(np.median(walls["static"]))
    for name, (resp, tok, steps, occ, dropped, host) in rows.items():
        wall = float(np.median(walls[name]))
        if host is None:
            host = f"{np.median(walls[name + ' host']):.1f}"
        spread = ", ".join(f"{w:.1f}" for w in walls[name])
        print(f"| {name} | {resp} | {tok} | {wall:.1f} ({spread}) | {resp / wall:.1f} "
              f"| {tok / wall:.0f} | {steps} | {wall / steps * 1e3:.1f} | {occ:.0%} | {host} "
              f"| {dropped} | {resp / wall / ref:.2f}× |")
    sys.stdout.flush()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="long", choices=sorted(PRESETS))
    ap.add_argument("--slots", default="64", help="comma-separated sampler slots n")
    ap.add_argument("--steps", type=int, default=6, help="global steps per sampler")
    ap.add_argument("--warmup", type=int, default=2, help="untimed global steps of partial")
    ap.add_argument("--rounds", type=int, default=3, help="repeats of every sampler")
    ap.add_argument("--staleness", default="1,2", help="S of the partial rows ('' = none)")
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--params", default="", help="a saved params checkpoint directory")
    ap.add_argument("--workdir", default="/tmp/bench_samplers")
    ap.add_argument("overrides", nargs="*", help="section.field=value")
    args = ap.parse_args(argv)
    args.staleness = [int(s) for s in args.staleness.split(",") if s]
    if not 0 < args.warmup < args.steps:
        ap.error(f"need 0 < --warmup < --steps, got {args.warmup} and {args.steps}")
    print("python -m benchmarks.samplers " + " ".join(argv if argv is not None
                                                      else sys.argv[1:]))
    base = apply_overrides(PRESETS[args.preset](), args.overrides)
    data = loop.task_data(base, args.workdir)
    params, source = load_params(base, data, args)
    rl = base.rl
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPU cores; "
          f"preset {args.preset}: {rl.prompts_per_step} prompts × {rl.group_size} = "
          f"{rl.prompts_per_step * rl.group_size} responses per step, "
          f"{base.sampling.max_new_tokens} completion slots, {source}; compiles excluded "
          f"(one untimed call or {args.warmup} untimed global steps per sampler)")
    for n in (int(x) for x in args.slots.split(",")):
        bench_slots(base, data, params, n, args)


if __name__ == "__main__":
    main()

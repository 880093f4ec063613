"""Score and update seconds per global step, padded rows vs token-budget packed rows
(rl.pack_tokens), side by side in one process.

    python -m benchmarks.packing [--preset long] [--lengths uniform] [--reps 3]
        [--pack 800,1200] [--pack-rows 8] [--chunk 64] [key=value ...]

The long preset's model and batch (B = prompts_per_step × G responses, one mini-batch),
with a batch of synthetic responses of the task's shape: prompts of 10–24 tokens
left-padded to task.max_prompt_len, completions of `--lengths` tokens (`uniform`: 220–370,
the long task's solutions; or any sampler_schedules.py spec, e.g.
`lognormal:mean=150,sigma=0.75`,
capped at sampling.max_new_tokens), random tokens, μ log-probs and R3 routes (the update
replays them), rl.score_in_update off (score and update timed apart). Each configuration is one Engine: its score step and its update step,
each timed over `--reps` calls after one compile call; the median is printed.

- padded: the rollout cut to its used slots (`Engine.trim`, rl.trim_bucket 8, as the
  loop does), every row at the longest row's width; with the preset's attention and
  with the causal path (query blocks of `--chunk`).
- packed T: rl.pack_tokens = T for each T of `--pack`, the causal path with blocks of
  `--chunk` (a block pair of two segments is skipped), rl.pack_rows = each of
  `--pack-rows` (packed rows per micro-batch).

Columns: rows (padded rows, or packed rows in use), slots = rows × width (the tokens the
forward computes), fill = real tokens / slots, score s, update s, and the speed-up of
score + update over the padded preset row.
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from stablerl_jax import presets
from stablerl_jax.config import apply_overrides
from stablerl_jax.model import transformer as tf
from stablerl_jax.pod import sampler_schedules
from stablerl_jax.rl.engine import Engine
from stablerl_jax.sampling.rollout import Rollout


def synthetic_batch(cfg, lengths: str, seed: int = 0) -> tuple[Rollout, np.ndarray]:
    """B responses of the task's shape (module docstring) and random 0/1 rewards."""
    rng = np.random.default_rng(seed)
    m, p, n = cfg.model, cfg.task.max_prompt_len, cfg.sampling.max_new_tokens
    b = cfg.rl.prompts_per_step * cfg.rl.group_size
    if lengths == "uniform":
        comp = rng.integers(220, 371, b)
    else:
        comp = sampler_schedules.lengths_from_spec(lengths, n, b, rng)
    prompt_len = np.repeat(rng.integers(10, p + 1, b // cfg.rl.group_size), cfg.rl.group_size)
    s = p + n
    slot = np.arange(s)[None]
    prompt = (slot >= p - prompt_len[:, None]) & (slot < p)
    completion = (slot >= p) & (slot < p + comp[:, None])
    tokens = np.where(prompt | completion, rng.integers(4, m.vocab_size, (b, s)), 0)
    logp = np.where(completion, -rng.uniform(0.0, 3.0, (b, s)), 0.0).astype(np.float32)
    routes = np.argsort(rng.uniform(size=(b, s, m.num_layers, m.num_experts)),
                        axis=-1)[..., :m.top_k].astype(np.int32)
    ro = Rollout(tokens.astype(np.int32), prompt, completion, comp.astype(np.int32), logp,
                 routes, truncated_B=np.zeros(b, bool))
    return ro, rng.integers(0, 2, b).astype(np.float32)


def timed(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run(cfg, ro, rewards, reps: int) -> dict:
    eng = Engine.create(cfg, eos_id=3, pad_id=0)
    params = tf.init_params(jax.random.key(0), cfg.model)
    ro = eng.trim(ro, cfg.rl.trim_bucket) if cfg.rl.trim_bucket else ro
    batch, _ = eng.score(params, ro, rewards)
    score_s = timed(lambda: eng.score(params, ro, rewards), reps)
    state = [eng.init_state(params)]

    def update():  # the update donates its state: each call takes the last one's
        state[0], metrics = eng.update(state[0], batch)
        return metrics

    update_s = timed(update, reps)
    return {"score": score_s, "update": update_s, "width": int(ro.tokens_BxS.shape[1])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="long")
    ap.add_argument("--lengths", default="uniform")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pack", default="800,1200")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--pack-rows", default="8", help="comma-separated rl.pack_rows values")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    base = apply_overrides(presets.preset(args.preset), args.overrides)
    base = base.replace(rl=base.rl.replace(replay="r3", num_minibatches=1, trim_bucket=8,
                                           score_in_update=False))
    ro, rewards = synthetic_batch(base, args.lengths)
    real = int((ro.prompt_mask_BxS | ro.completion_mask_BxS).sum())
    causal = base.model.replace(attention_impl="causal", attention_chunk=args.chunk)
    configs = [(f"padded ({base.model.attention_impl})", base, 0),
               (f"padded (causal {args.chunk})", base.replace(model=causal), 0)]
    for t in (int(x) for x in args.pack.split(",")):
        for rows in (int(x) for x in args.pack_rows.split(",")):
            configs.append((f"packed T={t} ×{rows} (causal {args.chunk})", base.replace(
                model=causal.replace(max_seq_len=max(t, causal.max_seq_len)),
                rl=base.rl.replace(pack_tokens=t, pack_rows=rows)), t))
    b = ro.tokens_BxS.shape[0]
    print(f"{args.preset}: B = {b} responses, completions {args.lengths} "
          f"(mean {ro.completion_mask_BxS.sum(1).mean():.0f}, max "
          f"{ro.completion_mask_BxS.sum(1).max()}), {real} real tokens; median of "
          f"{args.reps} calls, {jax.devices()[0].platform}")
    print(f"| {'configuration':<28} | rows | slots  | fill | score s | update s | speed-up |")
    print(f"|{'-' * 30}|-----:|-------:|-----:|--------:|---------:|---------:|")
    first = None
    for name, cfg, t in configs:
        r = run(cfg, ro, rewards, args.reps)
        if t:
            from stablerl_jax import packing
            p = packing.plan(ro.prompt_mask_BxS | ro.completion_mask_BxS, t, 1)
            rows, slots = int(p.rows_used_D.sum()), int(p.rows_used_D.sum()) * t
        else:
            rows, slots = b, b * r["width"]
        total = r["score"] + r["update"]
        first = first or total
        print(f"| {name:<28} | {rows:>4} | {slots:>6} | {real / slots:.2f} | "
              f"{r['score']:>7.2f} | {r['update']:>8.2f} | {first / total:>7.2f}× |",
              flush=True)


if __name__ == "__main__":
    main()

"""A run's phases measured against their compiled estimates, on random weights and
prompts (no data set, no tokenizer: what a machine without the data stack can run).

    python -m benchmarks.run_costs [--preset tiny] [--steps 5] [key=value ...]
    python -m benchmarks.run_costs --topology v5p-256 --preset paper [key=value ...]

Builds the preset's Engine, prices its sample, score and update programs as a run does
at its start (rl/costs.estimate_phases: roofline.estimate, what experiments.aot_compile
prints; on a device with chip constants only), then runs `--steps` global steps of the
loop's phases on random prompts (sample, score on random rewards, the N updates), each
timed by rl/costs.PhaseTimer with the loop's waits, and prints per step the `time/`,
`perf/` and `est/` values a run logs, and the measured / estimated table over the steps
after the first (whose compiles dominate).

With `--topology` it is a dry start on that TPU topology's abstract devices (libtpu, no
TPU: stablerl_jax/pod/aot.py): only the estimates a run there would log at its start, the
numbers `experiments.aot_compile` prints for the same preset and topology.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax import presets
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import costs
from stablerl_jax.rl.engine import Engine


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--topology", default="",
                    help="a dry start on this TPU topology (e.g. v5p-256): estimates only")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = presets.preset(args.preset, args.overrides)
    rl = cfg.rl
    b, p = rl.prompts_per_step * rl.group_size, cfg.task.max_prompt_len
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} × {jax.device_count()}, "
          f"preset {args.preset} {args.overrides}: {b} responses of up to "
          f"{cfg.sampling.max_new_tokens} tokens, {rl.num_minibatches} update(s)", flush=True)
    if args.topology:
        from stablerl_jax.pod import aot
        engine = Engine.for_topology(cfg, aot.topology(args.topology))
    else:
        engine = Engine.create(cfg, eos_id=1, pad_id=0)
    estimates, said = costs.estimate_phases(engine)
    print(said, flush=True)
    if args.topology:
        return
    state = engine.init_state(tf.init_params(jax.random.key(rl.seed), cfg.model))
    rng = np.random.default_rng(0)
    records = []
    with costs.PhaseTimer() as timer:
        for step in range(args.steps):
            prompts = rng.integers(4, cfg.model.vocab_size, (b, p)).astype(np.int32)
            mask = np.ones((b, p), bool)
            timer.row()
            with timer.phase("sample"):
                rollout, n = engine.sample_counted(state.params, prompts, mask,
                                                   jax.random.key(step))
                decode_steps = int(n)
            rewards = rng.integers(0, 2, b).astype(np.float32)
            with timer.phase("score"):
                batch, _ = timer.wait(engine.score(state.params, rollout, rewards))
            order = rng.permutation(b).reshape(rl.num_minibatches, -1)
            for i, rows in enumerate(order):
                with timer.phase("update", key=f"update_{i}"):
                    state, m = engine.update(state, engine.select(batch, rows))
                    jax.block_until_ready(m)
            times = timer.row()
            row = {"step": step + 1, **times, **costs.perf_row(
                cfg, times, generated=float(jnp.sum(rollout.lengths_B)),
                trained=float(jnp.sum(batch.mask_BxT)), rows=b,
                width=int(batch.tokens_BxS.shape[1]), decode_steps=decode_steps,
                estimates=estimates)}
            records.append(row)
            print({k: f"{v:.4g}" for k, v in row.items()
                   if k == "step" or k.startswith(("time/s", "time/update", "time/compile",
                                                   "perf/", "est/"))}, flush=True)
    pairs = costs.measured_vs_estimated(records[1:])
    print("\n| phase | measured s | estimated s | measured / estimated |\n|---|---|---|---|")
    for phase, m, e, q in pairs:
        print(f"| {phase} | {m:.4g} | {e:.4g} | {q:.2f} |")
    if not pairs:
        print("| (no estimate on this device) | | | |")
    mfu = {k: np.mean([r[f"perf/{k}_mfu"] for r in records[1:]]) for k in ("score", "update")}
    print(f"\nMFU over the steps after the first: score {mfu['score']:.3%}, "
          f"update {mfu['update']:.3%} (peak: {costs.peak_flops(jax.devices()[0])[1]})")


if __name__ == "__main__":
    main()

"""Model FLOP/s of the jitted `update_step` vs this machine's measured matmul peak.

    python -m benchmarks.train_step [--sizes tiny,small] [--reps 3]
    python -m benchmarks.train_step --sizes moe1b --dispatch loop,ragged_dot,dense --reps 1

For each preset: a synthetic rollout of full-length sequences (prompt + completion,
random tokens), scored by the Engine's score step (R2: the update replays the routes it
records), then the Engine's jitted,
sharded, state-donating update step timed over `reps` steps after one compile/warm-up
step. Model FLOPs per step count the matmuls of one forward and backward (3× forward):
attention projections, causal attention (half the T×T scores), router, the K active
SwiGLU experts and the unembedding; element-wise work is not counted. XLA's own FLOP count
of the compiled step is printed beside it. The peak is the median FLOP/s of a bare
`jnp.dot` of two 4096×4096 matrices in the preset's compute dtype.

`--dispatch` runs each preset with every listed expert path: a row of GMM_IMPLS
(kernels/gmm_impls.py, ModelConfig.gmm_impl of the grouped dispatch; the Pallas ones need
their accelerator) or `dense`. `moe1b` is the ≈1B-parameter bf16 MoE of
presets.moe1b (16 layers, D 1024, 32 experts top-4) at 4 × 256 tokens on one device;
on a CPU its parameters and AdamW moments are kept in bf16 (param_dtype) to fit the
memory of a small machine. `moe1b_gpu` is the same model at 64 × 1,024 tokens with
float32 parameters, the size for one accelerator.

    python -m benchmarks.train_step --options [--reps 3]

times the score and update steps of the tiny preset (FP8 sampler, 128 responses of 63
scored positions, N = 1, separate score pass) under each stabilizer option against MiniRL
in one process (OPTIONS: score centering exact and top-k, trust-region masking, the
drift monitor), with the ratios, and the top-k head's error against the exact drift on
the same batch: ‖d_K − d‖₁ / ‖d‖₁ with d = q − π_old per position.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import matmul_peak
from stablerl_jax import presets
from stablerl_jax.config import ExperimentConfig, ModelConfig, apply_overrides
from stablerl_jax.method import centering
from stablerl_jax.model import transformer as tf
from stablerl_jax.model.flops import train_flops
from stablerl_jax.rl.engine import Engine
from stablerl_jax.sampling.rollout import Rollout


def small() -> ExperimentConfig:
    """A 112M-total / ~24M-active-parameter MoE: the size at which the matmuls of a
    step are large enough to measure arithmetic efficiency on a CPU."""
    base = presets.tiny()
    model = ModelConfig(vocab_size=8192, d_model=512, num_layers=4, num_heads=8,
                        num_kv_heads=4, head_dim=64, num_experts=16, top_k=2,
                        expert_ffn_dim=1024, max_seq_len=512, moe_tile=128)
    rl = base.rl.replace(prompts_per_step=4, group_size=8, num_minibatches=1)
    return base.replace(name="small", model=model, rl=rl)


def moe1b_cpu() -> ExperimentConfig:
    """presets.moe1b on one device: 4 responses of 256 tokens, bf16 parameters."""
    base = presets.moe1b()
    model = base.model.replace(param_dtype="bfloat16")
    rl = base.rl.replace(prompts_per_step=1, group_size=4, microbatches=1)
    return base.replace(model=model, rl=rl, mesh=(1, 1, 1), sft=base.sft.replace(
        batch_size=4, microbatches=1), sampling=base.sampling.replace(max_batch=0))


def moe1b_gpu() -> ExperimentConfig:
    """presets.moe1b on one accelerator: 64 responses of 1,024 tokens (65k tokens per
    update), float32 parameters and moments, bf16 compute, one micro-batch."""
    base = presets.moe1b()
    rl = base.rl.replace(prompts_per_step=4, group_size=16, microbatches=1)
    return base.replace(rl=rl, mesh=(1, 1, 1), sft=base.sft.replace(batch_size=4,
                        microbatches=1), sampling=base.sampling.replace(max_batch=0))


# The benchmarked sizes: (config, sequence length).
MODEL_SIZES = {"tiny": (presets.tiny, 64), "small": (small, 256), "moe1b": (moe1b_cpu, 256),
               "moe1b_gpu": (moe1b_gpu, 1024)}


def synthetic_rollout(cfg, batch: int, seq: int) -> tuple[Rollout, np.ndarray]:
    """A full-length rollout (the first quarter prompt) and random 0/1 rewards."""
    rng = np.random.default_rng(0)
    m = cfg.model
    tokens = rng.integers(4, m.vocab_size, (batch, seq), dtype=np.int32)
    prompt = np.zeros((batch, seq), bool)
    prompt[:, :seq // 4] = True
    logp = np.where(prompt, 0.0, -rng.uniform(0.0, 5.0, (batch, seq))).astype(np.float32)
    routes = np.argsort(rng.uniform(size=(batch, seq, m.num_layers, m.num_experts)),
                        axis=-1)[..., :m.top_k].astype(np.int32)
    routes[:, -1] = -1  # the last token is never fed back
    rollout = Rollout(tokens, prompt, ~prompt, np.full((batch,), seq - seq // 4, np.int32),
                      logp, routes)
    return rollout, rng.integers(0, 2, batch).astype(np.float32)


def bench(name: str, reps: int, dispatch: str = "loop") -> dict:
    make, seq = MODEL_SIZES[name]
    cfg = make()
    path = ({"dispatch": "dense"} if dispatch == "dense"
            else {"dispatch": "grouped", "gmm_impl": dispatch})
    cfg = cfg.replace(rl=cfg.rl.replace(replay="r2"),
                      model=cfg.model.replace(max_seq_len=max(seq, cfg.model.max_seq_len),
                                              **path))
    batch_size = cfg.rl.prompts_per_step * cfg.rl.group_size // cfg.rl.num_minibatches
    engine = Engine.create(cfg, eos_id=3, pad_id=0)
    state = engine.init_state(tf.init_params(jax.random.key(0), cfg.model))
    batch, _ = engine.score(state.params, *synthetic_rollout(cfg, batch_size, seq))

    state, m = engine.update(state, batch)  # compile + warm-up
    jax.block_until_ready((state, m))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state, m = engine.update(state, batch)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
    sec = float(np.median(times))
    flops = train_flops(cfg.model, batch_size, seq - 1)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    return {"name": name, "params": n_params, "batch": batch_size, "seq": seq - 1,
            "sec": sec, "flops": flops,
            "dtype": cfg.model.compute_dtype}


OPTIONS = {"minirl": (), "center exact": ("loss.center=exact",),
           "center topk K=8": ("loss.center=topk", "loss.center_k=8"),
           "center topk K=32": ("loss.center=topk", "loss.center_k=32"),
           "trust region k1": ("loss.trust_region=k1",),
           "drift monitor": ("rl.drift_monitor=true",)}


def options_table(reps: int) -> None:
    """The score and update seconds of each of OPTIONS on one batch, and the ratios to
    MiniRL's; then the top-k drift's error against the exact one."""
    base = presets.tiny()
    base = base.replace(rl=base.rl.replace(score_in_update=False))
    seq, rows = 64, base.rl.prompts_per_step * base.rl.group_size
    rollout, rewards = synthetic_rollout(base, rows, seq)
    params = tf.init_params(jax.random.key(0), base.model)
    times = {}
    print("| option | score s | update s | score × | update × | score + update × |")
    print("|---|---|---|---|---|---|")
    for name, over in OPTIONS.items():
        engine = Engine.create(apply_overrides(base, over), eos_id=3, pad_id=0)
        state = engine.init_state(params)
        score = lambda: jax.block_until_ready(engine.score(state.params, rollout, rewards))
        batch, _ = score()
        update = engine.update
        state, m = update(state, batch)  # compile + warm-up
        jax.block_until_ready((state, m))
        t_score, t_update = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            batch, _ = score()
            t_score.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            state, m = update(state, batch)
            jax.block_until_ready((state, m))
            t_update.append(time.perf_counter() - t0)
        times[name] = (float(np.median(t_score)), float(np.median(t_update)))
        ts, tu = times[name]
        s0, u0 = times["minirl"]
        print(f"| {name} | {ts:.3f} | {tu:.3f} | {ts / s0:.2f} | {tu / u0:.2f} | "
              f"{(ts + tu) / (s0 + u0):.2f} |", flush=True)
    # The drift monitor with attribution keeps log π_old over the vocabulary in the batch.
    engine = Engine.create(apply_overrides(base, (
        "loss.center=exact", "rl.drift_monitor=true", "rl.attribution=true",
        "rl.attribution_every=0")), eos_id=3, pad_id=0)
    batch, _ = engine.score(params, rollout, rewards)
    logq, old_V = batch.sampler_logq_BxTxK, batch.old_vocab_logp_BxTxV
    mask = np.asarray(batch.mask_BxT) > 0
    d = np.asarray(centering.drift(logq, None, old_V))[mask]
    print(f"\ntop-k drift error (‖d_K − d‖₁ / ‖d‖₁ over {int(mask.sum())} positions, "
          f"V = {base.model.vocab_size}; exact mean ‖d‖₁ {np.abs(d).sum(-1).mean():.3e}):")
    for k in (1, 4, 8, 16, 32):
        head, idx = jax.lax.top_k(logq, k)
        dk = np.asarray(centering.drift(head, idx, old_V))[mask]
        print(f"  K = {k:2d}: {np.abs(dk - d).sum() / np.abs(d).sum():.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--options", action="store_true",
                    help="the stabilizer options' score and update cost against MiniRL")
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dispatch", default="loop",
                    help="comma-separated expert paths: rows of GMM_IMPLS (grouped "
                         "gmm_impl; kernels/gmm_impls.py) or dense")
    args = ap.parse_args()
    if args.options:
        print(f"jax {jax.__version__}, backend {jax.default_backend()}, tiny preset, "
              f"median of {args.reps} after warm-up")
        options_table(args.reps)
        return
    names = args.sizes.split(",")
    for n in names:
        if n not in MODEL_SIZES:
            raise SystemExit(f"--sizes: unknown {n!r}; choose from {sorted(MODEL_SIZES)}")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{jax.device_count()} device(s), update step with R2 replay, "
          f"median of {args.reps} after warm-up")
    peaks = {}
    print("| preset | experts | params | batch × T | dtype | step s | model GFLOP | "
          "model GFLOP/s | matmul peak GFLOP/s | % of peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        for d in args.dispatch.split(","):
            r = bench(n, args.reps, d)
            dt = r["dtype"]
            if dt not in peaks:
                peaks[dt] = matmul_peak(jnp.dtype(dt), n=4096, reps=3)
            rate = r["flops"] / r["sec"]
            print(f"| {n} | {d} | {r['params'] / 1e6:.2f}M | {r['batch']} × {r['seq']} | "
                  f"{dt} | {r['sec']:.3f} | {r['flops'] / 1e9:.1f} | {rate / 1e9:.1f} | "
                  f"{peaks[dt] / 1e9:.1f} | {100 * rate / peaks[dt]:.0f}% |", flush=True)


if __name__ == "__main__":
    main()

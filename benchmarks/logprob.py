"""Fused log-prob / entropy: naive vs chunked vs Pallas, time and compiled temp memory.

    python -m benchmarks.logprob [--reps 3] [--shapes 4096,512,32768 8192,512,65536]
                                 [--pallas-shape 1024,512,32768] [--dtype float32]

For each (T, D, V): forward and forward+backward median wall time (after a warm-up) and
the compiled executable's temp memory, with ratios to naive; plus a bare `hidden @
unembed` as the floor of the forward. On CPU the Pallas kernel runs in the interpreter,
which is orders of magnitude slower than compiled code, so it is timed at the smaller
`--pallas-shape` only (its memory is still reported at every shape).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_seconds
from kernels.fused_logprob import BlockSizes, fused_logprob


def _temp_mb(fn, args):
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def bench(t, d, v, dtype, reps, impls, block, pallas_block):
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (t, d), dtype)
    w = (jax.random.normal(k[1], (d, v)) / np.sqrt(d)).astype(dtype)
    y = jax.random.randint(k[2], (t,), 0, v)
    args = (h, w, y)
    rows = {}
    for impl in impls:
        blk = pallas_block if impl == "pallas" else block
        fwd = jax.jit(lambda h, w, y, i=impl, b=blk: fused_logprob(h, w, y, impl=i, block=b))
        loss = lambda h, w, y, i=impl, b=blk: sum(jnp.sum(o) for o in
                                                  fused_logprob(h, w, y, impl=i, block=b))
        bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
        rows[impl] = (median_seconds(fwd, *args, reps=reps),
                      median_seconds(bwd, *args, reps=reps),
                      _temp_mb(fwd, args), _temp_mb(bwd, args))
    mm = jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32))
    return rows, median_seconds(mm, h, w, reps=reps)


def matmul_peak_tflops(dtype, n=8192, reps=5) -> float:
    """Measured dense matmul rate at this dtype (random data), TFLOP/s."""
    a = jax.random.normal(jax.random.key(1), (n, n), dtype)
    b = jax.random.normal(jax.random.key(2), (n, n), dtype)
    return 2 * n**3 / median_seconds(jax.jit(jnp.dot), a, b, reps=reps) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=["4096,512,32768", "8192,512,65536"])
    ap.add_argument("--pallas-shape", default="1024,512,32768")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-vocab", type=int, default=2048, help="chunked: vocab chunk")
    ap.add_argument("--pallas-block", default="128,512", help="pallas: tokens,vocab block")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    block = BlockSizes(vocab=args.block_vocab)
    pallas_block = BlockSizes(*map(int, args.pallas_block.split(",")))
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {dtype.name}, "
          f"chunked vocab chunk {block.vocab}, pallas block {pallas_block}, "
          f"median of {args.reps}")
    print("| T | D | V | impl | fwd s | fwd+bwd s | fwd temp MiB | fwd+bwd temp MiB | "
          "fwd / naive | fwd+bwd / naive | temp fwd+bwd / naive | fwd / matmul |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    on_cpu = jax.default_backend() == "cpu"
    if not on_cpu:
        peak = matmul_peak_tflops(dtype)
        print(f"measured {dtype.name} matmul peak: {peak:.0f} TFLOP/s (8192^3)")
    for shape in args.shapes + ([args.pallas_shape] if on_cpu else []):
        t, d, v = map(int, shape.split(","))
        impls = ["naive", "chunked"] + (["pallas"] if (not on_cpu or shape == args.pallas_shape)
                                        else [])
        rows, mm = bench(t, d, v, dtype, args.reps, impls, block, pallas_block)
        nf, nb, _, nmb = rows["naive"]
        for impl, (f, b, mf, mb) in rows.items():
            print(f"| {t} | {d} | {v} | {impl} | {f:.4f} | {b:.4f} | {mf:.1f} | {mb:.1f} | "
                  f"{f / nf:.2f} | {b / nb:.2f} | {mb / nmb:.3f} | {f / mm:.2f} |", flush=True)
            if not on_cpu:  # fwd: 2TDV flops; fwd+bwd: fwd + recompute + dh + dW = 8TDV
                fwd_pct = 100 * 2 * t * d * v / f / 1e12 / peak
                bwd_pct = 100 * 8 * t * d * v / b / 1e12 / peak
                print(f"|   |   |   | {impl} % of peak | {fwd_pct:.0f}% | {bwd_pct:.0f}% "
                      "| | | | | | |")


if __name__ == "__main__":
    main()

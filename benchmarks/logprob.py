"""Fused log-prob / entropy: naive vs chunked vs Pallas, time and compiled temp memory.

    python -m benchmarks.logprob [--reps 3] [--shapes 4096,512,32768 8192,512,65536]
        [--impls naive chunked pallas_gpu] [--pallas-shape 256,512,4096] [--dtype float32]
        [--chunk 2048] [--pallas-blocks tokens=64,vocab=128 tokens=128,vocab=64 ...]

Letters: T tokens, D model, V vocab.

For each (T, D, V): forward and forward+backward median wall time (after a warm-up) and
the compiled executable's temp memory, with ratios to naive; plus a bare `hidden @
unembed` as the floor of the forward. `--impls` names rows of the op's table
(kernels/fused_logprob_impls.py, LOGPROB_IMPLS; default: naive, chunked and the Pallas
kernels compiled for this backend). Each `--pallas-blocks` entry (LogprobBlocks fields as
key=value, over the row's default blocks) is one Pallas row. On CPU the Pallas kernels
run in the interpreter, orders
of magnitude slower than compiled code, so there they are timed at `--pallas-shape`
only. On an accelerator the table adds % of the measured matmul peak of the dtype,
counting 2·T·D·V FLOPs forward and 8·T·D·V forward+backward (logits, recomputed logits,
d hidden, d unembed).
"""
from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import matmul_peak, median_seconds
from stablerl_jax.kernels.fused_logprob import fused_logprob
from stablerl_jax.kernels.fused_logprob_impls import LOGPROB_IMPLS

# The benchmark chooses how Pallas runs: interpreted on a CPU, compiled for the backend.
_INTERPRET = jax.default_backend() == "cpu"
_PALLAS_HERE = "pallas_tpu" if jax.default_backend() == "tpu" else "pallas_gpu"


def _temp_mb(fn, args):
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def _row(impl, block, args, reps):
    op = lambda h, w, y: fused_logprob(h, w, y, impl=impl, block=block, interpret=_INTERPRET)
    fwd = jax.jit(op)
    loss = lambda h, w, y: sum(jnp.sum(o) for o in op(h, w, y))
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return (median_seconds(fwd, *args, reps=reps), median_seconds(bwd, *args, reps=reps),
            _temp_mb(fwd, args), _temp_mb(bwd, args))


def _block(impl: str, spec: str, chunk: int):
    """The row's default blocks with `chunk` and the `spec` fields replaced (None for an
    implementation without blocks)."""
    blocks = LOGPROB_IMPLS[impl].blocks
    if blocks is None:
        return None
    kw = dict(kv.split("=") for kv in spec.split(",") if kv)
    return dataclasses.replace(blocks, chunk=chunk, **{k: int(v) for k, v in kw.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=["4096,512,32768", "8192,512,65536"])
    ap.add_argument("--impls", nargs="+", default=["naive", "chunked", _PALLAS_HERE],
                    choices=tuple(LOGPROB_IMPLS))
    ap.add_argument("--pallas-shape", default="256,512,4096")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chunk", type=int, default=2048, help="chunked: vocab chunk")
    ap.add_argument("--pallas-blocks", nargs="+", default=[""],
                    help="one Pallas row per entry: LogprobBlocks fields as key=value,...")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    on_cpu = jax.default_backend() == "cpu"
    print(f"jax {jax.__version__}, backend {jax.default_backend()} "
          f"({jax.devices()[0].device_kind}), {dtype.name}, chunk {args.chunk}, "
          f"median of {args.reps}")
    peak = None if on_cpu else matmul_peak(dtype) / 1e12  # TFLOP/s
    if peak:
        print(f"measured {dtype.name} matmul peak: {peak:.0f} TFLOP/s (8192^3)")
    print("| T | D | V | impl | fwd s | fwd+bwd s | fwd temp MiB | fwd+bwd temp MiB | "
          "fwd / naive | fwd+bwd / naive | temp fwd+bwd / naive | fwd / matmul |"
          + (" fwd % peak | fwd+bwd % peak |" if peak else ""))
    print("|---" * (12 + 2 * bool(peak)) + "|")
    shapes = list(args.shapes)
    pallas = {i for i in args.impls if LOGPROB_IMPLS[i].pallas}
    if on_cpu and pallas and args.pallas_shape not in shapes:
        shapes.append(args.pallas_shape)
    for shape in shapes:
        t, d, v = map(int, shape.split(","))
        k = jax.random.split(jax.random.key(0), 3)
        h = jax.random.normal(k[0], (t, d), dtype)
        w = (jax.random.normal(k[1], (d, v)) / np.sqrt(d)).astype(dtype)
        y = jax.random.randint(k[2], (t,), 0, v)
        rows = []
        for impl in args.impls:
            if impl in pallas and on_cpu and shape != args.pallas_shape:
                continue
            specs = args.pallas_blocks if impl in pallas else [""]
            for spec in specs:
                name = f"{impl} {spec}".strip()
                try:
                    rows.append((name, _row(impl, _block(impl, spec, args.chunk), (h, w, y),
                                            args.reps)))
                # A block choice the compiler rejects (any error type): say so, go on.
                except Exception as e:  # noqa: BLE001
                    print(f"| {t} | {d} | {v} | {name} | failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]} |", flush=True)
        mm = median_seconds(jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32)),
                            h, w, reps=args.reps)
        nf, nb, _, nmb = dict(rows).get("naive", rows[0][1])
        for name, (f, b, mf, mb) in rows:
            line = (f"| {t} | {d} | {v} | {name} | {f:.4f} | {b:.4f} | {mf:.1f} | {mb:.1f} | "
                    f"{f / nf:.2f} | {b / nb:.2f} | {mb / nmb:.3f} | {f / mm:.2f} |")
            if peak:
                line += (f" {100 * 2 * t * d * v / f / 1e12 / peak:.0f}% |"
                         f" {100 * 8 * t * d * v / b / 1e12 / peak:.0f}% |")
            print(line, flush=True)


if __name__ == "__main__":
    main()

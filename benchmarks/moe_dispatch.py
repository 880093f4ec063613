"""Dense (every expert, one-hot combine) vs grouped (sorted, dropless) expert dispatch.

    python -m benchmarks.moe_dispatch [--tokens 8192] [--reps 3] [--tile 64]

Prints forward and forward+backward median wall time (after one warm-up) for
(E, K) = (16, 2) and (32, 4) at D=512, F=1024, and the ratio grouped / dense.
Routing is drawn from a random router, so expert loads are uneven as in a real model.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.timing import median_seconds
from stablerl_jax.model import moe


def bench(tokens: int, d: int, f: int, e: int, k: int, tile: int, reps: int) -> dict:
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (tokens, d))
    ws = tuple(jax.random.normal(kk, s) * 0.02 for kk, s in
               zip(ks[1:4], [(e, d, f), (e, d, f), (e, f, d)]))
    logits = jax.random.normal(ks[4], (tokens, e))

    def run(path, x, ws, logits):
        idx, w, _ = moe.route(logits, k)
        if path == "dense":
            return moe.experts_dense(x, idx, w, *ws)
        return moe.experts_grouped(x, idx, w, *ws, tile=tile)

    out = {}
    for path in ("dense", "grouped"):
        fwd = jax.jit(lambda *a, p=path: run(p, *a))
        bwd = jax.jit(jax.grad(lambda *a, p=path: jnp.sum(run(p, *a) ** 2), argnums=(0, 1, 2)))
        out[path] = (median_seconds(fwd, x, ws, logits, reps=reps),
                     median_seconds(bwd, x, ws, logits, reps=reps))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--tile", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    d, f = 512, 1024
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, T={args.tokens}, D={d}, "
          f"F={f}, tile={args.tile}, median of {args.reps} after warm-up")
    print("| E | K | dense fwd s | grouped fwd s | ratio fwd | dense fwd+bwd s | "
          "grouped fwd+bwd s | ratio fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|")
    for e, k in [(16, 2), (32, 4)]:
        r = bench(args.tokens, d, f, e, k, args.tile, args.reps)
        (df, db), (gf, gb) = r["dense"], r["grouped"]
        print(f"| {e} | {k} | {df:.3f} | {gf:.3f} | {gf / df:.3f} | {db:.3f} | {gb:.3f} | "
              f"{gb / db:.3f} |", flush=True)


if __name__ == "__main__":
    main()

"""Grouped matmul (the MoE expert FFN's matmul): Pallas kernel vs jax.lax.ragged_dot vs the
pure-JAX reference, as model FLOP/s against this device's measured matmul peak.

    python -m benchmarks.gmm [--m 65536 --d 2048 --f 768 --e 128 --tile 128] [--sweep]

Default shape: Qwen3-30B-A3B's expert FFN (M = tokens × top-k routed rows, D 2048,
F 768, E 128), bfloat16. Rows are routed to experts by a multinomial draw over skewed
expert popularities (as a trained router's loads are uneven), each expert's group padded
up to a multiple of `--tile` in a buffer sized for the worst case (M + E·tile rows).
FLOPs count the M routed rows only: 2·M·D·F forward, twice that backward (d lhs and
d rhs). The peak is the median rate of a bare 8192³ `jnp.dot` in the same dtype.

`--paths` names rows of the op's table (kernels/gmm_impls.py, GMM_IMPLS), each run as
the model runs it (its default blocks; precision HIGHEST, which bf16 operands ignore).
For each path: forward and forward+backward (jax.vjp of the public op) times, and for
this project's Pallas kernels d lhs (transposed-rhs gmm) and d rhs (tgmm) apart; median
of `--reps` after a warm-up. `--sweep` first times each Pallas kernel of the first
pallas_* path at several block sizes (GmmBlocks: tiles, Triton warps and stages), then
runs that path with the best gmm and the best tgmm blocks. Values are checked against
ragged_dot first (relative Frobenius error; bf16 operands, float32 accumulation in both).
`--interpret` runs the Pallas paths in the interpreter (a smoke run on a CPU at a small
--m).
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import matmul_peak, median_seconds
from stablerl_jax.kernels import gmm_pallas
from stablerl_jax.kernels.gmm import gmm
from stablerl_jax.kernels.gmm_impls import GMM_IMPLS, GmmBlocks

# gmm (forward and d lhs): rows, cols, depth, warps, stages
GMM_SWEEP = [(128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
             (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3),
             (256, 128, 64, 8, 4), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
             (128, 256, 32, 8, 5)]
# tgmm (d rhs): t_rows (its contraction), t_cols, t_depth, warps, stages
TGMM_SWEEP = [(128, 128, 64, 4, 3), (64, 128, 128, 4, 3), (64, 128, 128, 8, 4),
              (64, 256, 128, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4),
              (32, 128, 128, 4, 4), (64, 256, 64, 8, 4)]


def group_sizes(m: int, e: int, tile: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    popularity = rng.dirichlet(np.full(e, 2.0))
    counts = rng.multinomial(m, popularity)
    return (-(-counts // tile) * tile).astype(np.int32)


def fwd_bwd(fn):
    def run(lhs, rhs, sizes, cot):
        out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
        return (out,) + vjp(cot)
    return jax.jit(run)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=65536)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--f", type=int, default=768)
    ap.add_argument("--e", type=int, default=128)
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--paths", default="pallas_gpu,ragged_dot",
                    help=f"comma-separated names of {tuple(GMM_IMPLS)}")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    paths = args.paths.split(",")
    if bad := [p for p in paths if p not in GMM_IMPLS]:
        ap.error(f"--paths {bad}: choose among {tuple(GMM_IMPLS)}")
    # This project's Pallas kernels (d lhs and d rhs timed apart, blocks swept).
    ours = [p for p in paths if isinstance(GMM_IMPLS[p].blocks, GmmBlocks)]
    dtype = jnp.dtype(args.dtype)
    sizes_np = group_sizes(args.m, args.e, args.tile)
    rows = args.m + args.e * args.tile
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k1, (rows, args.d), jnp.float32).astype(dtype)
    rhs = (jax.random.normal(k2, (args.e, args.d, args.f), jnp.float32) * 0.02).astype(dtype)
    cot = jax.random.normal(k3, (rows, args.f), jnp.float32).astype(dtype)
    valid = np.arange(rows) < sizes_np.sum()
    lhs = jnp.where(valid[:, None], lhs, 0).astype(dtype)
    sizes = jnp.asarray(sizes_np)
    useful = 2 * args.m * args.d * args.f
    peak = matmul_peak(dtype)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.dtype}, "
          f"M {args.m} (buffer {rows}, routed+padding {int(sizes_np.sum())}), D {args.d}, "
          f"F {args.f}, E {args.e}, tile {args.tile}; measured {args.dtype} matmul peak "
          f"{peak / 1e12:.0f} TFLOP/s; median of {args.reps}", flush=True)

    want = jax.jit(lambda a, b, s: gmm(a, b, s, args.tile, impl="ragged_dot"))(lhs, rhs, sizes)

    def rel(got):
        g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
        return float(np.linalg.norm(g - w) / np.linalg.norm(w))

    def timed(fn, *a):
        try:
            return median_seconds(fn, *a, reps=args.reps)
        except Exception as e:  # a block size a lowering refuses: report it, go on
            print(f"  refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            return float("nan")

    def kernels(block, target):
        call = functools.partial(gmm_pallas._gmm_call, tile=args.tile, block=block,
                                 target=target, interpret=args.interpret)
        fwd = jax.jit(lambda a, b, s: call(a, b, s, transpose=False))
        dl = jax.jit(lambda c, b, s: call(c, b, s, transpose=True))
        dr = jax.jit(lambda a, c, s: gmm_pallas._tgmm_call(
            a, c, s, args.tile, rhs.dtype, block, target, args.interpret))
        return fwd, dl, dr

    one = useful / 1e12
    blocks = {p: GMM_IMPLS[p].blocks for p in ours}
    if args.sweep and ours:
        target = GMM_IMPLS[ours[0]].options["target"]
        print("| gmm blocks (rows/cols/depth, warps, stages) | fwd ms | fwd TFLOP/s | "
              "d lhs ms | d lhs TFLOP/s |")
        print("|---|---|---|---|---|")
        best = (float("inf"), None)
        for r, c, d, w, st in GMM_SWEEP:
            b = GmmBlocks(rows=r, cols=c, depth=d, num_warps=w, num_stages=st)
            fwd, dl, _ = kernels(b, target)
            t_f, t_l = timed(fwd, lhs, rhs, sizes), timed(dl, cot, rhs, sizes)
            print(f"| {r}/{c}/{d}, {w}, {st} | {t_f * 1e3:.2f} | {one / t_f:.0f} | "
                  f"{t_l * 1e3:.2f} | {one / t_l:.0f} |", flush=True)
            if t_f + t_l < best[0]:
                best = (t_f + t_l, (r, c, d, w, st))
        print("| tgmm blocks (t_rows/t_cols/t_depth, warps, stages) | d rhs ms | "
              "d rhs TFLOP/s |")
        print("|---|---|---|")
        tbest = (float("inf"), None)
        for r, c, d, w, st in TGMM_SWEEP:
            b = GmmBlocks(t_rows=r, t_cols=c, t_depth=d, t_num_warps=w, t_num_stages=st)
            t_r = timed(kernels(b, target)[2], lhs, cot, sizes)
            print(f"| {r}/{c}/{d}, {w}, {st} | {t_r * 1e3:.2f} | {one / t_r:.0f} |",
                  flush=True)
            if t_r < tbest[0]:
                tbest = (t_r, (r, c, d, w, st))
        if best[1] is None or tbest[1] is None:
            raise SystemExit("every block size of the sweep was refused (see above)")
        (r, c, d, w, st), (tr, tc, td, tw, ts) = best[1], tbest[1]
        blocks[ours[0]] = GmmBlocks(rows=r, cols=c, depth=d, num_warps=w, num_stages=st,
                                    t_rows=tr, t_cols=tc, t_depth=td, t_num_warps=tw,
                                    t_num_stages=ts)
        print(f"best: {blocks[ours[0]]}")

    print("| path | blocks | fwd ms | d lhs ms | d rhs ms | fwd+bwd ms | fwd+bwd TFLOP/s | "
          "% of peak | rel. err. fwd |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        op = functools.partial(gmm, tile=args.tile, impl=path, block=blocks.get(path),
                               interpret=args.interpret)
        if path in ours:
            block = blocks[path]
            fwd, dl, dr = kernels(block, GMM_IMPLS[path].options["target"])
            name = (f"{block.rows}/{block.cols}/{block.depth} w{block.num_warps} "
                    f"s{block.num_stages}; t{block.t_rows}/{block.t_cols}/{block.t_depth} "
                    f"w{block.t_num_warps} s{block.t_num_stages}")
        else:
            fwd = jax.jit(lambda a, b, s, op=op: op(a, b, s))
            dl = dr = None
            name = "-"
        try:
            err = rel(fwd(lhs, rhs, sizes))
        except Exception as e:
            print(f"| {path} | {name} | failed: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120]} |||||||", flush=True)
            continue
        t_f = timed(fwd, lhs, rhs, sizes)
        t_l = timed(dl, cot, rhs, sizes) if dl else float("nan")
        t_r = timed(dr, lhs, cot, sizes) if dr else float("nan")
        t_fb = timed(fwd_bwd(op), lhs, rhs, sizes, cot)
        rate = 3 * useful / t_fb
        print(f"| {path} | {name} | {t_f * 1e3:.2f} | {t_l * 1e3:.2f} | {t_r * 1e3:.2f} | "
              f"{t_fb * 1e3:.2f} | {rate / 1e12:.0f} | {100 * rate / peak:.0f}% | "
              f"{err:.1e} |", flush=True)


if __name__ == "__main__":
    main()

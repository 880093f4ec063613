"""The grouped matmul's table: implementations, block sizes, example shapes. No JAX (the
config validates ModelConfig.gmm_impl against `GMM_IMPLS`).

Letters: R rows (sorted by group), D input width, F output width, E groups (experts),
T tokens, K top-k; Bm, Bn, Bk the Pallas row, column and contraction blocks (gmm_pallas.py).

Every implementation computes out_RxF = fn(lhs_RxD, rhs_ExDxF, group_sizes_E, tile,
precision[, block=][, interpret=]): rows sorted by group, each group a multiple of
`tile` rows (gmm.py; `gmm.gmm(..., impl=name)` runs a row). Each row of `GMM_IMPLS` says
what it is; the reference is "loop".
"""
from __future__ import annotations

import dataclasses

from stablerl_jax.kernels import Arg, Impl, check_blocks


@dataclasses.dataclass(frozen=True)
class GmmBlocks:
    """Pallas tiles: gmm's (forward and d lhs) `rows` (Bm; its gcd with the MoE tile is used,
    so it always divides it), `cols` (Bn), `depth` (Bk, the K-loop slice); tgmm's (d rhs;
    contraction over rows) `t_rows`, `t_cols`, `t_depth`; GPU only, Triton's `num_warps` /
    `num_stages` for gmm, `t_num_warps` / `t_num_stages` for tgmm; TPU only,
    `vmem_limit_mib` raises Mosaic's scoped VMEM limit (0: the compiler's default). TPU wants
    multiples of (8, 128); Triton powers of two ≥ 16, stages × (A + B tiles) within shared
    memory (227 KiB on an H100). Defaults: `GMM_GPU_BLOCKS` / `GMM_TPU_BLOCKS`."""

    rows: int = 128
    cols: int = 256
    depth: int = 256
    t_rows: int = 256
    t_cols: int = 256
    t_depth: int = 256
    num_warps: int = 4
    num_stages: int = 3
    t_num_warps: int = 4
    t_num_stages: int = 3
    vmem_limit_mib: int = 0

    def __post_init__(self):
        check_blocks(self, zero_ok=("vmem_limit_mib",))


# Mosaic: lane-aligned tiles of (8, 128) multiples, one weight tile of 256 × 256 bf16.
GMM_TPU_BLOCKS = GmmBlocks()
# Triton on an H100: the best of the block sweep at the Qwen3-30B-A3B expert shape
# (docs/records/benchmarks.md, `python -m benchmarks.gmm --sweep`).
GMM_GPU_BLOCKS = GmmBlocks(rows=128, cols=256, depth=32, t_rows=64, t_cols=256, t_depth=128,
                           num_warps=8, num_stages=5, t_num_warps=8, t_num_stages=3)

@dataclasses.dataclass(frozen=True)
class GmmImpl(Impl):
    """A row of GMM_IMPLS. invariant: an output row is fixed by its lhs row and its group's
    matrix, whatever the other rows and their number (fixed tiles, fixed reduction order);
    the batch-invariant expert FFN (model/invariant.py) runs the model's row if so marked,
    else `loop`; tests/model/invariant_test.py checks every marked row."""

    invariant: bool = False


_OP = "stablerl_jax.kernels.gmm"
_ALL = ("cpu", "gpu", "tpu")
GMM_IMPLS: dict[str, GmmImpl] = {
    # The reference: pure JAX, a loop over groups and their tiles; the CPU default.
    "loop": GmmImpl(f"{_OP}:loop", _ALL, invariant=True),
    # Pure JAX, every tile in one batched matmul against its gathered expert weight:
    # fewer, larger ops (small models on CPU), at one weight copy per tile.
    "tiles": GmmImpl(f"{_OP}:tiles", _ALL),
    # jax.lax.ragged_dot.
    "ragged_dot": GmmImpl(f"{_OP}:ragged_dot", _ALL),
    # This project's Pallas kernels (gmm_pallas.py) compiled by Triton / Mosaic; a program
    # multiplies fixed [Bm, Bk] x [Bk, Bn] tiles in K order, so they are batch-invariant.
    "pallas_gpu": GmmImpl(f"{_OP}_pallas:pallas", ("gpu",), {"target": "gpu"},
                          GMM_GPU_BLOCKS, pallas=True, invariant=True),
    "pallas_tpu": GmmImpl(f"{_OP}_pallas:pallas", ("tpu",), {"target": "tpu"},
                          GMM_TPU_BLOCKS, pallas=True, invariant=True),
    # jax's TPU megablox kernel.
    "megablox": GmmImpl(f"{_OP}:megablox", ("tpu",), pallas=True),
}


def padded_rows(num_assignments: int, num_experts: int, tile: int) -> int:
    """Static size R of the sorted buffer: Σ_e ceil(n_e/tile)·tile ≤ TK + E·(tile−1)."""
    worst = num_assignments + num_experts * (tile - 1)
    return -(-worst // tile) * tile


def gmm_example_args(tokens: int, model) -> tuple[tuple[Arg, ...], dict]:
    """(arguments, static keywords) of one MoE layer's gate projection of `model` (a
    ModelConfig) for `tokens` tokens per device; only the expert weights whole on each."""
    e, d, f, tile = model.num_experts, model.d_model, model.expert_ffn_dim, model.moe_tile
    dt = model.compute_dtype
    return (Arg("lhs_RxD", (padded_rows(tokens * model.top_k, e, tile), d), dt, True, True),
            Arg("rhs_ExDxF", (e, d, f), dt, False, True),
            Arg("group_sizes_E", (e,), "int32", True, False)), {"tile": tile}

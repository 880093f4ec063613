"""The Pallas grouped matmul against the pure-JAX reference (kernels/gmm.py), in value and
gradient, for both lowerings; its Triton lowering and its TPU compile.

On CPU both lowerings ("gpu": whole-array refs sliced in the kernel; "tpu": scalar
prefetch and revisited output blocks) run in the checking interpreter, which raises on a
read outside a block and fills unwritten memory with NaN; on a GPU backend the "gpu"
lowering runs compiled. The test chooses: the kernel never looks at the platform.
"""
import functools

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stablerl_jax.kernels import gmm_pallas
from stablerl_jax.kernels.gmm import loop as reference
from stablerl_jax.kernels.gmm_impls import GMM_IMPLS, GmmBlocks
from tolerance import assert_close

INTERPRET = jax.default_backend() == "cpu"
TARGETS = ["gpu", "tpu"] if INTERPRET else ["tpu" if jax.default_backend() == "tpu" else "gpu"]
# Blocks smaller than the shapes below, so every call spans several row, column and K
# tiles (16: Triton's smallest dot when the suite runs compiled on a GPU).
BLOCK = GmmBlocks(rows=16, cols=16, depth=16, t_rows=16, t_cols=16, t_depth=16)


def _inputs(sizes, d, f, rows, dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(k1, (rows, d), jnp.float32).astype(dtype)
    rhs = jax.random.normal(k2, (len(sizes), d, f), jnp.float32).astype(dtype)
    cot = jax.random.normal(k3, (rows, f), jnp.float32).astype(dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), cot


def _value_and_grads(fn, lhs, rhs, sizes, cot, tile):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes, tile), lhs, rhs)
    return (out,) + vjp(cot)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("sizes", [[32, 0, 64, 32], [0, 0, 0, 128], [0, 0, 0, 0],
                                   [32, 32, 32, 32]])
def test_value_and_grads_equal_reference(x64, target, sizes):
    """float64: two algorithms for one function (tests/tolerance.py). 160 rows > Σ sizes:
    trailing rows must come back zero, and their gradient rows too. D = 40 is not a
    multiple of the 16-wide K slices (the GPU lowering pads it, the TPU one takes a
    whole-D block); groups are multiples of the MoE tile 32, twice the row block."""
    tile, d, f, rows = 32, 40, 48, 160
    args = _inputs(sizes, d, f, rows, jnp.float64)
    kernel = functools.partial(gmm_pallas.pallas, block=BLOCK, target=target,
                               interpret=INTERPRET)
    got = jax.jit(functools.partial(_value_and_grads, kernel, tile=tile))(*args)
    want = _value_and_grads(reference, *args, tile=tile)
    # out: a dot over d; d lhs: a dot over f; d rhs: a sum over a group's rows (≤ 128).
    for a, b, n in zip(got, want, (d, f, rows)):
        assert_close(a, b, n=n, dtype="float64", scale="max")


@settings(max_examples=3, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=5), st.sampled_from([16, 48]),
       st.sampled_from([16, 40]), st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_random_groups_and_dtypes(tiles_per_group, d, f, dtype):
    """Random group layouts, widths and dtypes, both lowerings, against the reference on
    the same (rounded) inputs. float32: sums over d (out), f (d lhs) and ≤ 48 rows
    (d rhs) in another order, float32 accumulation in both. bfloat16: both round the same
    float32 accumulation to bf16 once (≤ 1 bf16 ulp apart: n = 1), plus the float32
    reordering, far below it (n = 2 with margin)."""
    tile = 16
    sizes = [t * tile for t in tiles_per_group]
    rows = sum(sizes) + tile
    args = _inputs(sizes, d, f, rows, dtype, seed=len(sizes))
    want = _value_and_grads(reference, *args, tile=tile)
    for target in TARGETS:
        kernel = functools.partial(gmm_pallas.pallas, block=BLOCK, target=target,
                                   interpret=INTERPRET)
        got = _value_and_grads(kernel, *args, tile=tile)
        for a, b, n in zip(got, want, (d, f, rows)):
            if dtype == jnp.bfloat16:
                assert_close(a, b, n=2, dtype="bfloat16", scale="max")
            else:
                assert_close(a, b, n=n, scale="max")


def test_gpu_lowering_is_valid_triton():
    """The "gpu" lowering lowers through Pallas's Triton backend at the Qwen3-30B-A3B
    expert shape (bf16, D 2048, F 768, 128 experts, 512-row tiles): block shapes, dots
    and dynamic slices are all legal Triton (lowering for CUDA needs no GPU)."""
    e, d, f, tile = 128, 2048, 768, 512
    rows = 64 * tile
    sds = jax.ShapeDtypeStruct

    def fwd_bwd(lhs, rhs, sizes, cot):
        return _value_and_grads(GMM_IMPLS["pallas_gpu"].load(), lhs, rhs, sizes, cot, tile)

    lowered = jax.jit(fwd_bwd).trace(
        sds((rows, d), jnp.bfloat16), sds((e, d, f), jnp.bfloat16), sds((e,), jnp.int32),
        sds((rows, f), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    # gmm, the transposed-rhs gmm (d lhs) and tgmm (d rhs): three Triton kernels.
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 3


def test_errors_name_the_values():
    lhs, rhs, sizes = jnp.zeros((24, 4)), jnp.zeros((2, 4, 3)), jnp.array([8, 0])
    kernel = functools.partial(gmm_pallas.pallas, block=BLOCK)
    with pytest.raises(ValueError, match="tile=16"):
        kernel(lhs, rhs, sizes, 16, target="gpu")
    with pytest.raises(ValueError, match="D=5"):
        kernel(jnp.zeros((16, 5)), rhs, sizes, 8, target="gpu")
    with pytest.raises(ValueError, match="group_sizes shape"):
        kernel(jnp.zeros((16, 4)), rhs, jnp.array([8]), 8, target="tpu")
    with pytest.raises(ValueError, match="target='cpu'"):
        kernel(jnp.zeros((16, 4)), rhs, sizes, 8, target="cpu")
    with pytest.raises(ValueError, match="GmmBlocks.rows=0"):
        GmmBlocks(rows=0)

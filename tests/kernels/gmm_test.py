"""The pure-JAX grouped matmuls (`loop`, `tiles`) equal a per-row reference in value and
gradient (float64: two algorithms for one function, see tests/tolerance.py); every
implementation in the table (kernels/gmm_impls.py), run by the dispatcher `gmm`, equals
the loop."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import INTERPRET, impl_params
from stablerl_jax.kernels.gmm import gmm, loop, tiles
from stablerl_jax.kernels.gmm_impls import GMM_IMPLS
from tolerance import assert_close

run = functools.partial(gmm, interpret=INTERPRET)


def _reference(lhs, rhs, sizes, tile):
    group_of_row = np.repeat(np.arange(len(sizes)), sizes)
    rows = len(group_of_row)
    out = jnp.einsum("pd,pdf->pf", lhs[:rows], rhs[group_of_row], precision="highest")
    return jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype).at[:rows].set(out)


@pytest.mark.parametrize("impl", [loop, tiles])
@pytest.mark.parametrize("sizes", [[8, 0, 16, 8], [0, 0, 0, 32], [0, 0, 0, 0], [8, 8, 8, 8]])
def test_value_and_grad_match_reference(x64, sizes, impl):
    tile, d, f = 8, 5, 7
    rows = 40  # > Σ sizes: trailing rows must come back zero
    sizes = np.array(sizes, np.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k1, (rows, d), jnp.float64)
    rhs = jax.random.normal(k2, (len(sizes), d, f), jnp.float64)
    cot = jax.random.normal(k3, (rows, f), jnp.float64)
    got = jax.jit(impl, static_argnums=3)(lhs, rhs, jnp.asarray(sizes), tile)
    want = _reference(lhs, rhs, sizes, tile)
    # Norm-wise (a dot over d = 5 can cancel): d roundings.
    assert_close(got, want, n=d, dtype="float64", scale="max")
    g_got = jax.grad(lambda a, b: jnp.sum(impl(a, b, jnp.asarray(sizes), tile) * cot),
                     argnums=(0, 1))(lhs, rhs)
    g_want = jax.grad(lambda a, b: jnp.sum(_reference(a, b, sizes, tile) * cot),
                      argnums=(0, 1))(lhs, rhs)
    # d lhs: a dot over f = 7; d rhs: a sum over a group's rows (≤ 32, of 40).
    for a, b in zip(g_got, g_want):
        assert_close(a, b, n=f + rows, dtype="float64", scale="max")


def test_shape_errors_name_values():
    lhs, rhs = jnp.zeros((12, 4)), jnp.zeros((2, 4, 3))
    with pytest.raises(ValueError, match="tile=8"):
        tiles(lhs, rhs, jnp.array([8, 0]), 8)
    with pytest.raises(ValueError, match="tile=8"):
        loop(lhs, rhs, jnp.array([8, 0]), 8)
    with pytest.raises(ValueError, match="lhs width"):
        loop(jnp.zeros((8, 5)), rhs, jnp.array([8, 0]), 8)
    with pytest.raises(ValueError, match="group_sizes shape"):
        loop(jnp.zeros((8, 4)), rhs, jnp.array([8]), 8)
    with pytest.raises(ValueError, match="impl='fast'"):
        gmm(jnp.zeros((8, 4)), rhs, jnp.array([8, 0]), 8, impl="fast")


@pytest.mark.parametrize("impl", impl_params(GMM_IMPLS))
def test_every_implementation_in_the_table_equals_the_loop(impl):
    """float32, each row of GMM_IMPLS this backend runs (Pallas interpreted on a CPU) at
    its own default blocks, in value and gradient. The groups fill every row: megablox
    leaves rows past Σ group_sizes unwritten (the MoE dispatch never reads them)."""
    tile, d, f = 16, 40, 48
    sizes = jnp.array([32, 0, 64, 16], jnp.int32)
    rows = int(sizes.sum())
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    lhs = jax.random.normal(k1, (rows, d), jnp.float32)
    rhs = jax.random.normal(k2, (len(sizes), d, f), jnp.float32)
    cot = jax.random.normal(k3, (rows, f), jnp.float32)

    def value_and_grads(fn):
        out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes, tile), lhs, rhs)
        return (out,) + vjp(cot)

    got = jax.jit(lambda: value_and_grads(functools.partial(run, impl=impl)))()
    want = value_and_grads(loop)
    # out: a dot over d; d lhs: a dot over f; d rhs: a sum over a group's rows (≤ 64).
    for a, b, n in zip(got, want, (d, f, rows)):
        assert_close(a, b, n=n, scale="max")

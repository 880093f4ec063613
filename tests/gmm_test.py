"""The pure-JAX grouped matmuls (tile loop, batched tiles) equal a per-row reference in
value and gradient (float64: two algorithms for one function, see tests/tolerance.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablerl_jax.model.gmm import gmm, gmm_tiles
from tolerance import assert_close


def _reference(lhs, rhs, sizes, tile):
    group_of_row = np.repeat(np.arange(len(sizes)), sizes)
    rows = len(group_of_row)
    out = jnp.einsum("pd,pdf->pf", lhs[:rows], rhs[group_of_row], precision="highest")
    return jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype).at[:rows].set(out)


@pytest.mark.parametrize("impl", [gmm, gmm_tiles])
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
        gmm_tiles(lhs, rhs, jnp.array([8, 0]), 8)
    with pytest.raises(ValueError, match="tile=8"):
        gmm(lhs, rhs, jnp.array([8, 0]), 8)
    with pytest.raises(ValueError, match="lhs width"):
        gmm(jnp.zeros((8, 5)), rhs, jnp.array([8, 0]), 8)
    with pytest.raises(ValueError, match="group_sizes shape"):
        gmm(jnp.zeros((8, 4)), rhs, jnp.array([8]), 8)

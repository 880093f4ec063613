"""The pure-JAX grouped matmul equals a per-row reference in value and gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablerl_jax.model.gmm import gmm


def _reference(lhs, rhs, sizes, tile):
    group_of_row = np.repeat(np.arange(len(sizes)), sizes)
    rows = len(group_of_row)
    out = jnp.einsum("pd,pdf->pf", lhs[:rows], rhs[group_of_row])
    return jnp.zeros((lhs.shape[0], rhs.shape[2])).at[:rows].set(out)


@pytest.mark.parametrize("sizes", [[8, 0, 16, 8], [0, 0, 0, 32], [0, 0, 0, 0], [8, 8, 8, 8]])
def test_value_and_grad_match_reference(sizes):
    tile, d, f = 8, 5, 7
    rows = 40  # > Σ sizes: trailing rows must come back zero
    sizes = np.array(sizes, np.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k1, (rows, d))
    rhs = jax.random.normal(k2, (len(sizes), d, f))
    cot = jax.random.normal(k3, (rows, f))
    got = jax.jit(gmm, static_argnums=3)(lhs, rhs, jnp.asarray(sizes), tile)
    want = _reference(lhs, rhs, sizes, tile)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    g_got = jax.grad(lambda a, b: jnp.sum(gmm(a, b, jnp.asarray(sizes), tile) * cot),
                     argnums=(0, 1))(lhs, rhs)
    g_want = jax.grad(lambda a, b: jnp.sum(_reference(a, b, sizes, tile) * cot),
                      argnums=(0, 1))(lhs, rhs)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_shape_errors_name_values():
    lhs, rhs = jnp.zeros((12, 4)), jnp.zeros((2, 4, 3))
    with pytest.raises(ValueError, match="tile=8"):
        gmm(lhs, rhs, jnp.array([8, 0]), 8)
    with pytest.raises(ValueError, match="lhs width"):
        gmm(jnp.zeros((8, 5)), rhs, jnp.array([8, 0]), 8)
    with pytest.raises(ValueError, match="group_sizes shape"):
        gmm(jnp.zeros((8, 4)), rhs, jnp.array([8]), 8)

"""RoPE, RMSNorm and position counting."""
import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax.model.attention import positions_from_mask, rms_norm, rope


def test_rope_scores_depend_only_on_relative_position():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))

    def score(pq, pk):
        rq = rope(q, jnp.array([[pq]]), 10_000.0)
        rk = rope(k, jnp.array([[pk]]), 10_000.0)
        return float(jnp.sum(rq * rk))

    np.testing.assert_allclose(score(3, 1), score(10, 8), rtol=1e-5)
    np.testing.assert_allclose(score(0, 0), float(jnp.sum(q * k)), rtol=1e-6)  # angle 0
    # A rotation preserves the norm.
    np.testing.assert_allclose(jnp.linalg.norm(rope(q, jnp.array([[7]]), 1e4)),
                               jnp.linalg.norm(q), rtol=1e-6)


def test_rms_norm_by_hand():
    x = jnp.array([[3.0, 4.0]])  # mean square 12.5
    np.testing.assert_allclose(rms_norm(x, jnp.array([1.0, 2.0]), 0.0),
                               [[3 / 12.5**0.5, 8 / 12.5**0.5]], rtol=1e-6)
    assert rms_norm(x.astype(jnp.bfloat16), jnp.ones(2), 1e-6).dtype == jnp.bfloat16


def test_positions_skip_left_padding():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(positions_from_mask(mask)[:, 2:], [[0, 1, 2], [2, 3, 4]])
    np.testing.assert_array_equal(positions_from_mask(mask[:, :1], jnp.array([3, 5])),
                                  [[3], [5]])

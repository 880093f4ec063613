"""RoPE, RMSNorm and position counting."""
import jax
import jax.numpy as jnp
import numpy as np
from tolerance import assert_close

from stablerl_jax.model.attention import positions_from_mask, rms_norm, rope


def test_rope_scores_depend_only_on_relative_position():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))

    def score(pq, pk):
        rq = rope(q, jnp.array([[pq]]), 10_000.0)
        rk = rope(k, jnp.array([[pk]]), 10_000.0)
        return float(jnp.sum(rq * rk))

    # Each score: the angles (position × frequency: 2), cos/sin (1), the rotation (2), a
    # dot over 8 (8): n = 13 on each side, relative to Σ|q_i k_i| (the dot's terms have
    # both signs).
    terms = float(jnp.sum(jnp.abs(q * k)))
    assert_close(score(3, 1), score(10, 8), n=13, scale=terms)
    assert_close(score(0, 0), float(jnp.sum(q * k)), n=13, scale=terms)  # angle 0
    # A rotation preserves the norm: the rotation (5) and a norm over 8 (8 + sqrt).
    assert_close(jnp.linalg.norm(rope(q, jnp.array([[7]]), 1e4)), jnp.linalg.norm(q), n=14)


def test_rms_norm_by_hand():
    x = jnp.array([[3.0, 4.0]])  # mean square 12.5
    # Mean square (3), rsqrt (1), two products (2).
    assert_close(rms_norm(x, jnp.array([1.0, 2.0]), 0.0), [[3 / 12.5**0.5, 8 / 12.5**0.5]],
                 n=6)
    assert rms_norm(x.astype(jnp.bfloat16), jnp.ones(2), 1e-6).dtype == jnp.bfloat16


def test_positions_skip_left_padding():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(positions_from_mask(mask)[:, 2:], [[0, 1, 2], [2, 3, 4]])
    np.testing.assert_array_equal(positions_from_mask(mask[:, :1], jnp.array([3, 5])),
                                  [[3], [5]])

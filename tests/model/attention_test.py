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

    # Each rotated component x1·cos − x2·sin: the angle (pow and product: ≤ 3 absolute on
    # angles ≤ 1 rad; frequency 1 gives exact integer angles), cos/sin (2: ≤ 2 ulp on a
    # GPU), the products and difference (2): ≤ 7 relative to |x1| + |x2|. A score takes two
    # (14) over a pair's two components (×√2: 20) and a dot over 8 (8): n = 28, relative
    # to S = Σ_pairs (|q1| + |q2|)(|k1| + |k2|), which bounds the dot's (signed) terms too.
    qa, ka = np.abs(np.asarray(q, np.float64)).ravel(), np.abs(np.asarray(k, np.float64)).ravel()
    pairs = float(np.sum((qa[:4] + qa[4:]) * (ka[:4] + ka[4:])))
    assert_close(score(3, 1), score(10, 8), n=28, scale=pairs)
    # Angle 0: cos 1 and sin 0 exactly, so only the two dots' order differs (8), relative
    # to the dot's terms.
    assert_close(score(0, 0), float(jnp.sum(q * k)), n=8, scale=float(jnp.sum(jnp.abs(q * k))))
    # A rotation preserves the norm, whatever the angle's error: cos/sin (2 each), the
    # products and sum (2), ≤ 6 relative; a norm over 8 (8 + sqrt, each side): n = 15.
    assert_close(jnp.linalg.norm(rope(q, jnp.array([[7]]), 1e4)), jnp.linalg.norm(q), n=15)


def test_rope_is_the_half_split_rotation():
    # HF Qwen3 rotate_half: [x1, x2] -> [x1·cos − x2·sin, x2·cos + x1·sin], angle
    # position · θ^(−i/half). Positions 0 and 1 keep angles ≤ 1 rad; each component is as
    # in the test above (≤ 7 relative to |x1| + |x2|), taken norm-wise.
    x = jax.random.normal(jax.random.key(2), (2, 3, 2, 8))
    pos = jnp.array([[0, 1, 1], [1, 0, 1]])
    xd, half = np.asarray(x, np.float64), 4
    angle = np.asarray(pos, np.float64)[..., None, None] * 1e4 ** (-np.arange(half) / half)
    x1, x2 = xd[..., :half], xd[..., half:]
    want = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                           x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)
    assert_close(rope(x, pos, 1e4), want, n=7, scale=float(np.max(np.abs(x1) + np.abs(x2))))


def test_rms_norm_by_hand():
    x = jnp.array([[3.0, 4.0]])  # mean square 12.5
    # Mean square (3), rsqrt (2: ≤ 2 ulp on a GPU), two products (2).
    assert_close(rms_norm(x, jnp.array([1.0, 2.0]), 0.0), [[3 / 12.5**0.5, 8 / 12.5**0.5]],
                 n=7)
    assert rms_norm(x.astype(jnp.bfloat16), jnp.ones(2), 1e-6).dtype == jnp.bfloat16


def test_positions_skip_left_padding():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(positions_from_mask(mask)[:, 2:], [[0, 1, 2], [2, 3, 4]])
    np.testing.assert_array_equal(positions_from_mask(mask[:, :1], jnp.array([3, 5])),
                                  [[3], [5]])

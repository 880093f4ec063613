"""Batch log-probs from hidden states: invariance, temperature, IS quantities."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablerl_jax.logprobs import is_quantities, token_logprobs


def _inputs(b=4, t=6, d=16, v=50):
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (b, t, d)), jax.random.normal(k[1], (d, v)) * 0.5,
            jax.random.randint(k[2], (b, t), 0, v))


def test_row_does_not_depend_on_other_rows_bitwise():
    h, w, y = _inputs()
    f = jax.jit(token_logprobs)
    logp, ent = f(h, w, y)
    other = h.at[1:].set(jax.random.normal(jax.random.key(9), h[1:].shape) * 10)
    logp2, ent2 = f(other, w, y)
    np.testing.assert_array_equal(logp2[0], logp[0])
    np.testing.assert_array_equal(ent2[0], ent[0])


def test_temperature_scales_logits():
    h, w, y = _inputs()
    logp, ent = token_logprobs(h, w, y, temperature=0.7, impl="chunked")
    z = jnp.einsum("btd,dv->btv", h, w, precision="highest") / 0.7
    ls = jax.nn.log_softmax(z)
    np.testing.assert_allclose(logp, jnp.take_along_axis(ls, y[..., None], -1)[..., 0],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, -jnp.sum(jnp.exp(ls) * ls, -1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs(h, w, y, temperature=0)


def test_is_quantities_by_definition():
    h, w, y = _inputs()
    logp, _ = token_logprobs(h, w, y)
    old = logp - 0.1
    mu = logp - jnp.log(8.0)  # ρ = 8 > cap 5
    mask = jnp.ones_like(logp).at[0, 0].set(0)
    q = is_quantities(h, w, y, old, mu, mask)
    np.testing.assert_allclose(q["log_ratio_old_BxT"][1], 0.1, rtol=1e-4)
    assert float(q["log_ratio_old_BxT"][0, 0]) == 0.0  # off-mask
    np.testing.assert_allclose(q["tis_weight_BxT"][1], 5.0, rtol=1e-6)
    np.testing.assert_allclose(q["logp_BxT"], logp, rtol=1e-6)

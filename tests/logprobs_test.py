"""Batch log-probs from hidden states: invariance, temperature, IS quantities.

Letters: B batch, T tokens, D model, V vocab.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.fused_logprob import BlockSizes
from stablerl_jax.logprobs import is_quantities, token_logprobs

BLOCK = BlockSizes(chunk=16, tokens=16, vocab=16, vocab_tiles=2, dim=16, bwd_chunk=16,
                   bwd_tokens=16, bwd_vocab=16)


def _inputs(b=4, t=6, d=16, v=50):
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (b, t, d)), jax.random.normal(k[1], (d, v)) * 0.5,
            jax.random.randint(k[2], (b, t), 0, v))


def _naive(h, w, y, temperature=1.0):
    z = jnp.einsum("btd,dv->btv", h, w, precision="highest") / temperature
    ls = jax.nn.log_softmax(z)
    return jnp.take_along_axis(ls, y[..., None], -1)[..., 0], -jnp.sum(jnp.exp(ls) * ls, -1)


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
def test_row_does_not_depend_on_other_rows_bitwise(impl):
    h, w, y = _inputs()
    f = jax.jit(lambda h, w, y: token_logprobs(h, w, y, impl=impl, block=BLOCK))
    logp, ent = f(h, w, y)
    other = h.at[1:].set(jax.random.normal(jax.random.key(9), h[1:].shape) * 10)
    logp2, ent2 = f(other, w, y)
    np.testing.assert_array_equal(logp2[0], logp[0])
    np.testing.assert_array_equal(ent2[0], ent[0])


def test_temperature_scales_logits_in_value_and_gradient():
    h, w, y = _inputs()
    tau = 0.7
    logp, ent = token_logprobs(h, w, y, temperature=tau, block=BLOCK)
    want_logp, want_ent = _naive(h, w, y, tau)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, want_ent, rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda h, w: sum(jnp.sum(o * c) for o, c in zip(f(h, w), (1.0, 0.3)))
    got = jax.grad(loss(lambda h, w: token_logprobs(h, w, y, temperature=tau, block=BLOCK)),
                   argnums=(0, 1))(h, w)
    want = jax.grad(loss(lambda h, w: _naive(h, w, y, tau)), argnums=(0, 1))(h, w)
    for g, wg in zip(got, want):
        np.testing.assert_allclose(g, wg, rtol=1e-4, atol=1e-5)


def test_bad_arguments_name_the_value():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs(h, w, y, temperature=0)
    with pytest.raises(ValueError, match="targets_BxT.shape"):
        token_logprobs(h, w, y[:, :3])
    with pytest.raises(ValueError, match="cap=0"):
        is_quantities(h, w, y, y * 0.0, y * 0.0, y, cap=0.0)


def test_is_quantities_by_definition():
    h, w, y = _inputs()
    logp, ent = token_logprobs(h, w, y)
    old = logp - 0.1
    mu = (logp - jnp.log(8.0)).at[2].set(logp[2] + 30.0)  # ρ = 8 > cap; row 2: ρ = e^-30
    mu = mu.at[0, 1].set(jnp.nan)                          # garbage off the mask
    mask = jnp.ones_like(logp).at[0, :2].set(0)
    q = jax.jit(is_quantities)(h, w, y, old, mu, mask)
    np.testing.assert_allclose(q["logp_BxT"], logp, rtol=1e-6)
    np.testing.assert_allclose(q["entropy_BxT"], ent, rtol=1e-6)
    np.testing.assert_allclose(q["log_ratio_old_BxT"][1], 0.1, rtol=1e-4)
    np.testing.assert_allclose(q["log_ratio_mu_BxT"][1], np.log(8.0), rtol=1e-5)
    np.testing.assert_allclose(q["log_ratio_mu_BxT"][2], -30.0, rtol=1e-5)  # not clipped
    np.testing.assert_allclose(q["tis_weight_BxT"][1], 5.0, rtol=1e-6)      # capped
    np.testing.assert_allclose(q["tis_weight_BxT"][2], np.exp(-20.0), rtol=1e-4)  # clipped
    for k in ("log_ratio_mu_BxT", "log_ratio_old_BxT", "tis_weight_BxT"):
        np.testing.assert_array_equal(q[k][0, :2], 0.0)  # off the mask, NaN or not
    np.testing.assert_array_equal(q["mask_BxT"], mask)


def test_is_weight_is_stop_gradient_and_ratio_gradient_is_logp_gradient():
    h, w, y = _inputs()
    logp = token_logprobs(h, w, y)[0]
    mask = jnp.ones_like(logp).at[3].set(0)
    q = lambda k: lambda h: jnp.sum(is_quantities(h, w, y, logp, logp - 1.0, mask)[k])
    np.testing.assert_array_equal(jax.grad(q("tis_weight_BxT"))(h), 0.0)
    want = jax.grad(lambda h: jnp.sum(token_logprobs(h, w, y)[0] * mask))(h)
    np.testing.assert_allclose(jax.grad(q("log_ratio_mu_BxT"))(h), want, rtol=1e-6)

"""Diagnostics by hand."""
import jax.numpy as jnp
import numpy as np

from stablerl_jax import diagnostics as dg

LOG = np.log


def _ratio(pair):
    return float(pair[0] / pair[1])


def test_kl_estimators_by_hand():
    mu = jnp.log(jnp.array([[0.5, 0.25, 0.9]]))
    pi = jnp.log(jnp.array([[0.25, 0.25, 0.1]]))
    mask = jnp.array([[1, 1, 0]])
    np.testing.assert_allclose(_ratio(dg.kl_k1(mu, pi, mask)), LOG(2) / 2, rtol=1e-6)
    # k3: ρ = [0.5, 1]: (0.5 − 1 − log 0.5) / 2.
    np.testing.assert_allclose(_ratio(dg.kl_k3(mu, pi, mask)), (-0.5 + LOG(2)) / 2, rtol=1e-5)
    np.testing.assert_allclose(_ratio(dg.chi2(mu, pi, mask)), (0.25 + 1) / 2 - 1, rtol=1e-5)
    np.testing.assert_allclose(dg.ppl_ratio(mu, pi, mask), np.sqrt(2), rtol=1e-6)


def test_entropy_and_ess():
    np.testing.assert_allclose(dg.entropy_from_logits(jnp.zeros((1, 2, 8))), LOG(8), rtol=1e-6)
    m = jnp.ones((1, 4))
    np.testing.assert_allclose(dg.is_ess(jnp.full((1, 4), 3.0), m), 1.0, rtol=1e-6)
    np.testing.assert_allclose(dg.is_ess(jnp.array([[1.0, 0, 0, 0]]), m), 0.25, rtol=1e-6)


def test_is_weight_stats_and_clip_fractions():
    s = dg.is_weight_stats(jnp.log(jnp.array([[0.5, 2.0, 8.0, 100.0]])),
                           jnp.array([[1, 1, 1, 0]]), cap=5.0)
    assert float(s["is/weight_min"]) == 0.5 and abs(float(s["is/weight_max"]) - 8) < 1e-4
    np.testing.assert_allclose(_ratio(s["is/frac_truncated"]), 1 / 3, rtol=1e-6)
    c = dg.clip_fractions(jnp.log(jnp.array([[1.5, 0.5, 1.5]])), jnp.zeros((1, 3)),
                          jnp.array([[1.0, -1.0, -1.0]]), jnp.ones((1, 3)), 0.2, 0.27)
    np.testing.assert_allclose(_ratio(c["clip/frac_high"]), 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(_ratio(c["clip/frac_low"]), 1 / 3, rtol=1e-6)


def test_eq5_factors_sum_to_full_ratio():
    logp, old, mu = (jnp.log(jnp.array([[a, b]])) for a, b in [(0.4, 0.3), (0.5, 0.2), (0.25, 0.2)])
    f = dg.eq5_factors(logp, old, mu, jnp.ones((1, 2)))
    np.testing.assert_allclose(_ratio(f["eq5/engine_log_mean"]), (LOG(2) + 0) / 2, rtol=1e-6)
    np.testing.assert_allclose(_ratio(f["eq5/staleness_log_mean"]), (LOG(0.8) + LOG(1.5)) / 2,
                               rtol=1e-6)


def test_first_order_residual_stable_and_exact():
    d = np.array([[1e-4, -2e-4, 3e-4]])
    exact = np.prod(1 + d) - (1 + d.sum())  # ≈ Σ_{s<t} δ_s δ_t ~ 1e-8
    got = dg.first_order_residual(jnp.log1p(jnp.asarray(d, jnp.float32)), jnp.ones((1, 3)))
    np.testing.assert_allclose(got, [exact], rtol=1e-3)
    # Masked tokens and huge log-ratios: finite.
    big = dg.first_order_residual(jnp.array([[500.0, 1.0]]), jnp.array([[1, 0]]))
    assert np.isfinite(big).all()


def test_routing_mismatch_by_hand():
    # L=2, B=1, T=3, K=2. Layer 0: token 0 same, token 1 one of two differs; layer 1: same.
    a = jnp.array([[[[0, 1], [2, 3], [4, 5]]], [[[0, 1], [2, 3], [4, 5]]]])
    b = jnp.array([[[[1, 0], [2, 7], [-1, -1]]], [[[0, 1], [3, 2], [-1, -1]]]])
    r = dg.routing_mismatch(a, b, jnp.ones((1, 3)))
    np.testing.assert_allclose(r["mismatch_rate"], [0.25, 0.0], rtol=1e-6)  # token 2 excluded
    np.testing.assert_allclose(r["any_flip"], 0.5, rtol=1e-6)

"""Diagnostics by hand."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablerl_jax import diagnostics as dg
from stablerl_jax import losses

LOG = np.log


def _ratio(pair):
    return float(pair[0] / pair[1])


def test_kl_estimators_by_hand():
    mu = jnp.log(jnp.array([[0.5, 0.25, 0.9]]))
    pi = jnp.log(jnp.array([[0.25, 0.25, 0.1]]))
    mask = jnp.array([[1, 1, 0]])  # the third token is excluded
    np.testing.assert_allclose(_ratio(dg.kl_k1(mu, pi, mask)), LOG(2) / 2, rtol=1e-6)
    # k3: ρ = π/μ = [0.5, 1]: (0.5 − 1 − log 0.5) / 2.
    np.testing.assert_allclose(_ratio(dg.kl_k3(mu, pi, mask)), (-0.5 + LOG(2)) / 2, rtol=1e-5)
    # χ² = E[ρ²] − 1 = (0.25 + 1)/2 − 1.
    np.testing.assert_allclose(_ratio(dg.chi2(mu, pi, mask)), (0.25 + 1) / 2 - 1, rtol=1e-5)
    np.testing.assert_allclose(dg.ppl_ratio(mu, pi, mask), np.sqrt(2), rtol=1e-6)


def test_k3_is_accurate_near_one_and_finite_far_away():
    mu = jnp.zeros((1, 1))
    x = 1e-4  # ρ − 1 − log ρ ≈ x²/2 = 5e-9, lost entirely by a naive exp(x) − 1 − x in float32
    num, _ = dg.kl_k3(mu, jnp.full((1, 1), x), jnp.ones((1, 1)))
    np.testing.assert_allclose(num, x**2 / 2, rtol=1e-3)
    for fn in (dg.kl_k3, dg.chi2):
        num, _ = fn(mu, jnp.full((1, 1), 1e4), jnp.ones((1, 1)))
        assert np.isfinite(num)


def test_entropy_by_hand():
    logits = jnp.zeros((1, 2, 8)).at[0, 1].set(jnp.array([0.0, 0.0] + [-jnp.inf] * 6))
    # Token 0 uniform over 8, token 1 uniform over 2 (the −inf logits have p = 0).
    np.testing.assert_allclose(_ratio(dg.entropy_from_logits(logits, jnp.ones((1, 2)))),
                               (LOG(8) + LOG(2)) / 2, rtol=1e-6)
    np.testing.assert_allclose(_ratio(dg.entropy_from_logits(logits, jnp.array([[0, 1]]))),
                               LOG(2), rtol=1e-6)


def test_ess_by_hand():
    m = jnp.ones((1, 4))
    np.testing.assert_allclose(dg.is_ess(jnp.full((1, 4), 3.0), m), 1.0, rtol=1e-6)
    np.testing.assert_allclose(dg.is_ess(jnp.array([[1.0, 0, 0, 0]]), m), 0.25, rtol=1e-6)
    # Masked tokens are not samples: one real token is always ESS 1.
    np.testing.assert_allclose(dg.is_ess(jnp.array([[7.0, 1, 1, 1]]), jnp.array([[1, 0, 0, 0]])),
                               1.0, rtol=1e-6)


def test_is_weight_stats_by_hand():
    s = dg.is_weight_stats(jnp.log(jnp.array([[0.5, 2.0, 8.0, 100.0]])),
                           jnp.array([[1, 1, 1, 0]]), cap=5.0)
    r = losses.reduce_metrics([s])
    np.testing.assert_allclose(r["is/weight_min"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(r["is/weight_max"], 8.0, rtol=1e-5)
    np.testing.assert_allclose(r["is/weight_mean"], 10.5 / 3, rtol=1e-5)
    np.testing.assert_allclose(r["is/frac_truncated"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(r["is/ess"], 10.5**2 / (3 * (0.25 + 4 + 64)), rtol=1e-5)
    # No counted token: min/max carry a zero denominator and are ignored by the reduction.
    empty = dg.is_weight_stats(jnp.zeros((1, 2)), jnp.zeros((1, 2)), cap=5.0)
    assert float(empty["is/weight_max"][1]) == 0.0
    assert losses.reduce_metrics([s, empty])["is/weight_min"] == r["is/weight_min"]


def test_clip_fractions_by_hand():
    logp = jnp.log(jnp.array([[1.5, 0.5, 1.5, 0.5]]))
    c = dg.clip_fractions(logp, jnp.zeros((1, 4)), jnp.array([[1.0, -1.0, -1.0, 1.0]]),
                          jnp.ones((1, 4)), 0.2, 0.27)
    # Token 0: Â > 0, r = 1.5 > 1.27 → high. Token 1: Â < 0, r = 0.5 < 0.8 → low.
    # Tokens 2, 3: the ratio moved the other way; the clip does not bind.
    np.testing.assert_allclose(_ratio(c["clip/frac_high"]), 1 / 4, rtol=1e-6)
    np.testing.assert_allclose(_ratio(c["clip/frac_low"]), 1 / 4, rtol=1e-6)
    per_response = dg.clip_fractions(logp[:, :2], jnp.zeros((1, 2)), jnp.array([1.0]),
                                     jnp.ones((1, 2)), 0.2, 0.27)
    np.testing.assert_allclose(_ratio(per_response["clip/frac_high"]), 1 / 2, rtol=1e-6)
    assert _ratio(per_response["clip/frac_low"]) == 0.0


def test_eq5_factors_by_hand():
    logp, old, mu = (jnp.log(jnp.array([[a, b]])) for a, b in [(0.4, 0.3), (0.5, 0.2), (0.25, 0.2)])
    r = losses.reduce_metrics([dg.eq5_factors(logp, old, mu, jnp.ones((1, 2)))])
    # engine π_old/μ = [2, 1]; staleness π_θ/π_old = [0.8, 1.5].
    np.testing.assert_allclose(r["eq5/engine_log_mean"], LOG(2) / 2, rtol=1e-6)
    np.testing.assert_allclose(r["eq5/engine_log_std"], LOG(2) / 2, rtol=1e-5)
    np.testing.assert_allclose(r["eq5/staleness_log_mean"], (LOG(0.8) + LOG(1.5)) / 2, rtol=1e-6)
    np.testing.assert_allclose(r["eq5/staleness_log_std"], abs(LOG(1.5) - LOG(0.8)) / 2,
                               rtol=1e-5)


def test_first_order_residual_by_hand_and_stable():
    # ρ = [2, 0.8, 1.5]: Π = 2.4, 1 + Σδ = 1 + 1 − 0.2 + 0.5 = 2.3.
    got = dg.first_order_residual_B(jnp.log(jnp.array([[2.0, 0.8, 1.5]])), jnp.ones((1, 3)))
    np.testing.assert_allclose(got, [0.1], rtol=1e-5)
    # Tiny δ: the residual ≈ Σ_{s<t} δ_s δ_t ~ 1e-8 keeps its precision in float32.
    d = np.array([[1e-4, -2e-4, 3e-4, 5e-5]])
    exact = np.prod(1 + d) - (1 + d.sum())
    got = dg.first_order_residual_B(jnp.log1p(jnp.asarray(d, jnp.float32)), jnp.ones((1, 4)))
    np.testing.assert_allclose(got, [exact], rtol=1e-4)
    # Masked tokens count as ρ = 1; huge log-ratios stay finite; the pair averages |R| over
    # non-empty responses.
    x = jnp.array([[LOG(2.0), 9.0, LOG(0.8)], [500.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    m = jnp.array([[1, 0, 1], [1, 1, 1], [0, 0, 0]])
    r_B = dg.first_order_residual_B(x, m)
    assert np.isfinite(r_B).all()
    np.testing.assert_allclose(r_B[0], 1.6 - 1.8, rtol=1e-5)
    assert float(r_B[2]) == 0.0
    num, den = dg.first_order_residual(x, m)
    assert float(den) == 2.0
    np.testing.assert_allclose(num, abs(r_B[0]) + abs(r_B[1]), rtol=1e-6)


def test_routing_mismatch_by_hand():
    # L=2, B=1, T=3, K=2. -1 marks "no route recorded" for one (layer, token) entry.
    a = jnp.array([[[[0, 1], [2, 3], [4, 5]]], [[[0, 1], [2, 3], [4, 5]]]])
    b = jnp.array([[[[1, 0], [2, 7], [-1, -1]]], [[[0, 1], [3, 2], [4, 6]]]])
    r = dg.routing_mismatch(a, b, jnp.ones((1, 3)))
    # Layer 0: tokens 0, 1 counted: 0 (order ignored) and 1/2. Layer 1: 0, 0, 1/2.
    np.testing.assert_allclose(r["mismatch_rate"], [0.25, 1 / 6], rtol=1e-6)
    np.testing.assert_allclose(r["mismatch_pair"][1], [2, 3])
    # Token 1 flips in layer 0, token 2 in layer 1.
    np.testing.assert_allclose(r["any_flip"], 2 / 3, rtol=1e-6)
    # Masking token 1 out.
    r = dg.routing_mismatch(np.asarray(a), np.asarray(b), np.array([[1, 0, 1]]))
    np.testing.assert_allclose(r["mismatch_rate"], [0.0, 0.25], rtol=1e-6)
    np.testing.assert_allclose(r["any_flip"], 0.5, rtol=1e-6)
    # Identical routes: no mismatch; all unrecorded: rate 0 with zero denominators.
    same = jax.jit(dg.routing_mismatch)(a, a, jnp.ones((1, 3)))
    assert not np.any(same["mismatch_rate"]) and float(same["any_flip"]) == 0.0
    none = dg.routing_mismatch(a, -jnp.ones_like(b), jnp.ones((1, 3)))
    assert not np.any(none["mismatch_pair"][1]) and float(none["any_flip_pair"][1]) == 0.0


def test_routing_mismatch_rejects_bad_shapes():
    a = jnp.zeros((2, 1, 3, 2), jnp.int32)
    with pytest.raises(ValueError, match="L, B, T, K"):
        dg.routing_mismatch(a, a[:1], jnp.ones((1, 3)))
    with pytest.raises(ValueError, match="mask shape"):
        dg.routing_mismatch(a, a, jnp.ones((1, 4)))


def test_pairs_accumulate_exactly_and_jit_with_numpy():
    rng = np.random.default_rng(0)
    mu, pi = np.log(rng.uniform(0.05, 1, (2, 6, 5))).astype(np.float32)
    m = rng.uniform(size=(6, 5)) > 0.3
    for fn in (dg.kl_k1, dg.kl_k3, dg.chi2):
        whole = _ratio(jax.jit(fn)(mu, pi, m))
        halves = [fn(mu[s], pi[s], m[s]) for s in (slice(0, 2), slice(2, 6))]
        np.testing.assert_allclose(sum(h[0] for h in halves) / sum(h[1] for h in halves),
                                   whole, rtol=1e-5)

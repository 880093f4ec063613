"""Diagnostics by hand: every monitor, the training–inference mismatch of the score step,
and the pair arithmetic of reduce_metrics. Tolerances: tests/tolerance.py (float32
formulas of a few roundings, counted per call)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close

from stablerl_jax.method import diagnostics as dg
from stablerl_jax.method import losses

LOG = np.log


def _ratio(pair):
    return float(pair[0] / pair[1])


def test_kl_estimators_by_hand():
    mu = jnp.log(jnp.array([[0.5, 0.25, 0.9]]))
    pi = jnp.log(jnp.array([[0.25, 0.25, 0.1]]))
    mask = jnp.array([[1, 1, 0]])  # the third token is excluded
    # log of the inputs (2), their difference (1), a sum of 2 and a division (2).
    assert_close(_ratio(dg.kl_k1(mu, pi, mask)), LOG(2) / 2, n=6, cond=3.0)
    # k3: ρ = π/μ = [0.5, 1]: (0.5 − 1 − log 0.5) / 2. Each term of e^x − 1 − x carries
    # ≤ 4 roundings relative (x = log π − log μ: 2.77u absolute on log 2, as for k1), then
    # the subtraction, sum and division: n = 8; the subtraction cancels:
    # cond = (0.5 + log 2) / (log 2 − 0.5) ≈ 6.2.
    assert_close(_ratio(dg.kl_k3(mu, pi, mask)), (-0.5 + LOG(2)) / 2, n=8,
                 cond=(0.5 + LOG(2)) / (LOG(2) - 0.5))


def test_k3_is_accurate_near_one_and_finite_far_away():
    mu = jnp.zeros((1, 1))
    x = 1e-4  # ρ − 1 − log ρ ≈ x²/2 = 5e-9, lost entirely by a naive exp(x) − 1 − x in float32
    num, _ = dg.kl_k3(mu, jnp.full((1, 1), x), jnp.ones((1, 1)))
    # Series to x⁵ in float32: x's input rounding (doubled by x²: 2) and the Horner steps
    # (6): n = 8. The expected value's omitted x⁴/24 is 1e-9 relative (0.01u).
    assert_close(num, x**2 / 2 + x**3 / 6, n=8)
    num, _ = dg.kl_k3(mu, jnp.full((1, 1), 1e4), jnp.ones((1, 1)))
    assert np.isfinite(num)


def test_weight_stats_by_hand():
    w = jnp.array([[0.5, 2.0, 8.0, 100.0]])
    altered = jnp.array([[0.0, 0.0, 1.0, 1.0]])
    s = dg.weight_stats(w, altered, jnp.array([[1, 1, 1, 0]]))
    r = dg.reduce_metrics([s])
    assert r["is/weight_min"] == 0.5 and r["is/weight_max"] == 8.0  # exact picks
    assert_close(r["is/weight_mean"], 10.5 / 3, n=4)
    assert_close(r["is/frac_truncated"], 1 / 3, n=4)
    assert_close(r["is/ess"], 10.5**2 / (3 * (0.25 + 4 + 64)), n=12)
    # No counted token: min/max carry a zero denominator and are ignored by the reduction.
    empty = dg.weight_stats(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros((1, 2)))
    assert float(empty["is/weight_max"][1]) == 0.0
    assert dg.reduce_metrics([s, empty])["is/weight_min"] == r["is/weight_min"]
    # ESS: equal weights give 1; one weight carrying everything gives 1/n.
    ones = dg.reduce_metrics([dg.weight_stats(jnp.full((1, 4), 3.0), jnp.zeros((1, 4)),
                                              jnp.ones((1, 4)))])
    assert_close(ones["is/ess"], 1.0, n=12)
    spike = dg.reduce_metrics([dg.weight_stats(jnp.array([[1.0, 0, 0, 0]]), jnp.zeros((1, 4)),
                                               jnp.ones((1, 4)))])
    assert_close(spike["is/ess"], 0.25, n=12)


def test_clip_fractions_by_hand():
    logp = jnp.log(jnp.array([[1.5, 0.5, 1.5, 0.5]]))
    hi, lo = losses.clip_sides(jnp.array([[1.0, -1.0, -1.0, 1.0]]), logp, 0.8, 1.27, True)
    c = dg.clip_fractions(hi, lo, jnp.ones((1, 4)))
    # Token 0: Â > 0, r = 1.5 > 1.27 → high. Token 1: Â < 0, r = 0.5 < 0.8 → low.
    # Tokens 2, 3: the ratio moved the other way; the clip does not bind. Counts of 0/1
    # over 4 tokens are exact.
    assert _ratio(c["clip/frac_high"]) == 0.25 and _ratio(c["clip/frac_low"]) == 0.25
    # A masked token does not count, whatever its mask; a bool mask works too.
    masked = dg.clip_fractions(hi, lo, jnp.array([[True, False, True, True]]))
    assert tuple(map(float, masked["clip/frac_high"])) == (1.0, 3.0)
    assert tuple(map(float, masked["clip/frac_low"])) == (0.0, 3.0)
    off = dg.clip_fractions(*losses.clip_sides(jnp.ones((1, 4)), logp, 0.8, 1.27, False),
                            jnp.ones((1, 4)))
    assert _ratio(off["clip/frac_high"]) == 0.0 and _ratio(off["clip/frac_low"]) == 0.0


def test_eq5_factors_by_hand():
    logp, old, mu = (jnp.log(jnp.array([[a, b]])) for a, b in [(0.4, 0.3), (0.5, 0.2), (0.25, 0.2)])
    r = dg.reduce_metrics([dg.eq5_factors(logp, old, mu, jnp.ones((1, 2)))])
    # engine π_old/μ = [2, 1] (the second exactly 0: equal inputs); staleness π_θ/π_old =
    # [0.4/0.5, 0.3/0.2]. A mean of log-ratios: each input (≤ 1, relative to |log p| ≥ 0.9
    # when inexact) and its log (1), the difference (1), the sum (1), the division (1):
    # n = 6 relative to the input logs, cond = Σ|log p| / |result|.
    assert_close(r["eq5/engine_log_mean"], LOG(2) / 2, n=6, cond=(LOG(2) + LOG(4)) / LOG(2))
    stale = [LOG(0.8), LOG(1.5)]
    logs = sum(abs(LOG(p)) for p in (0.4, 0.5, 0.3, 0.2))
    assert_close(r["eq5/staleness_log_mean"], sum(stale) / 2, n=6, cond=logs / abs(sum(stale)))
    # std = sqrt(mean(x²) − mean(x)²) = |x_1 − x_0| / 2: the log-ratios' 6 (cond of the
    # input logs against |x_1 − x_0|), the square, sum, difference and sqrt (4), times the
    # difference's cond (sq + mean²) / (sq − mean²).
    sq, mean = LOG(2) ** 2 / 2, LOG(2) / 2
    assert_close(r["eq5/engine_log_std"], LOG(2) / 2, n=10,
                 cond=3.0 * (sq + mean**2) / (sq - mean**2))
    sq, mean = (stale[0] ** 2 + stale[1] ** 2) / 2, sum(stale) / 2
    assert_close(r["eq5/staleness_log_std"], abs(stale[1] - stale[0]) / 2, n=10,
                 cond=logs / abs(stale[1] - stale[0]) * (sq + mean**2) / (sq - mean**2))


def test_first_order_residual_by_hand_and_stable():
    # ρ = [2, 0.8, 1.5]: Π = 2.4, 1 + Σδ = 1 + 1 − 0.2 + 0.5 = 2.3. R = Σ_t
    # expm1(prefix_t)·expm1(x_t) = 0 + 1·(−0.2) + 0.6·0.5: cond (0.2 + 0.3) / 0.1 = 5. Each
    # product: the prefix's absolute error (the inputs' and the cumsum − x's, ≈ 4u) ×2.7 by
    # expm1's slope at log 1.6, the factors' expm1 and the product: ≤ 15 relative.
    got = dg.first_order_residual_B(jnp.log(jnp.array([[2.0, 0.8, 1.5]])), jnp.ones((1, 3)))
    assert_close(got, [0.1], n=15, cond=5.0)
    # Tiny δ: the residual ≈ Σ_{s<t} δ_s δ_t ~ 1e-8 keeps its precision in float32 (the
    # cancellation-free form: each product is accurate to a few roundings; the 6 pair
    # products of both signs sum to `exact`, cond ≈ 3.5).
    d = np.array([[1e-4, -2e-4, 3e-4, 5e-5]])
    exact = np.prod(1 + d) - (1 + d.sum())
    got = dg.first_order_residual_B(jnp.log1p(jnp.asarray(d, jnp.float32)), jnp.ones((1, 4)))
    pairs = [abs(d[0, s] * d[0, t]) for s in range(4) for t in range(s + 1, 4)]
    assert_close(got, [exact], n=12, cond=sum(pairs) / abs(exact))
    # Masked tokens count as ρ = 1; huge log-ratios stay finite; the pair averages |R| over
    # non-empty responses.
    x = jnp.array([[LOG(2.0), 9.0, LOG(0.8)], [500.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    m = jnp.array([[1, 0, 1], [1, 1, 1], [0, 0, 0]])
    r_B = dg.first_order_residual_B(x, m)
    assert np.isfinite(r_B).all()
    # One product, expm1(≈ log 2)·expm1(log 0.8) = 1·(−0.2), nothing cancels: the prefix's
    # ≈ 2u absolute error (input, cumsum, difference) ×2 by expm1's slope, log 0.8's
    # rounding ×4, the two expm1 and the product: n = 8.
    assert_close(r_B[0], 1.6 - 1.8, n=8)
    assert float(r_B[2]) == 0.0
    num, den = dg.first_order_residual(x, m)
    assert float(den) == 2.0
    assert_close(num, abs(r_B[0]) + abs(r_B[1]), n=1)


def test_routing_mismatch_by_hand():
    # B=1, T=3, L=2, K=2. -1 marks "no route recorded" for one (token, layer) entry.
    a_LxBxTxK = np.array([[[[0, 1], [2, 3], [4, 5]]], [[[0, 1], [2, 3], [4, 5]]]])
    b_LxBxTxK = np.array([[[[1, 0], [2, 7], [-1, -1]]], [[[0, 1], [3, 2], [4, 6]]]])
    a, b = (jnp.asarray(x.transpose(1, 2, 0, 3)) for x in (a_LxBxTxK, b_LxBxTxK))
    r = dg.routing_mismatch(a, b, jnp.ones((1, 3)))
    # Layer 0: tokens 0, 1 counted: 0 (order ignored) and 1/2. Layer 1: 0, 0, 1/2. Sums of
    # halves and a division: exact but for the last rounding of 1/6.
    assert_close(r["mismatch_rate"], [0.25, 1 / 6], n=1)
    np.testing.assert_array_equal(r["mismatch_pair"][1], [2, 3])
    # Token 1 flips in layer 0, token 2 in layer 1.
    assert_close(r["any_flip"], 2 / 3, n=1)
    # Masking token 1 out.
    r = dg.routing_mismatch(np.asarray(a), np.asarray(b), np.array([[1, 0, 1]]))
    np.testing.assert_array_equal(r["mismatch_rate"], [0.0, 0.25])
    assert float(r["any_flip"]) == 0.5
    # Identical routes: no mismatch; all unrecorded: rate 0 with zero denominators.
    same = jax.jit(dg.routing_mismatch)(a, a, jnp.ones((1, 3)))
    assert not np.any(same["mismatch_rate"]) and float(same["any_flip"]) == 0.0
    none = dg.routing_mismatch(a, -jnp.ones_like(b), jnp.ones((1, 3)))
    assert not np.any(none["mismatch_pair"][1]) and float(none["any_flip_pair"][1]) == 0.0


def test_routing_mismatch_rejects_bad_shapes():
    a = jnp.zeros((1, 3, 2, 2), jnp.int32)
    with pytest.raises(ValueError, match="B, T, L, K"):
        dg.routing_mismatch(a, a[:, :2], jnp.ones((1, 3)))
    with pytest.raises(ValueError, match="mask shape"):
        dg.routing_mismatch(a, a, jnp.ones((1, 4)))


def test_train_infer_mismatch_pairs_by_hand():
    # Two completion tokens (the third is prompt/padding): log μ − log π = [log 2, 0].
    mu = jnp.log(jnp.array([[0.5, 0.25, 0.9]]))
    pi = jnp.log(jnp.array([[0.25, 0.25, 0.1]]))
    mask = jnp.array([[1.0, 1.0, 0.0]])
    routes_mu = jnp.array([[[[0, 1]], [[2, 3]], [[4, 5]]]])  # [B=1, T=3, L=1, K=2]
    routes_pi = jnp.array([[[[1, 0]], [[2, 5]], [[-1, -1]]]])
    pairs = dg.train_infer_mismatch(mu, pi, mask, routes_mu, routes_pi, jnp.ones((1, 3)),
                                    per_layer=True)
    r = dg.reduce_metrics([pairs])
    assert_close(r["kl/train_infer_k1"], LOG(2) / 2, n=6, cond=3.0)
    assert_close(r["kl/train_infer_k3"], (-0.5 + LOG(2)) / 2, n=8,  # as in kl_k3 above
                 cond=(0.5 + LOG(2)) / (LOG(2) - 0.5))
    assert_close(r["mismatch/abs_logp_gap"], LOG(2) / 2, n=6, cond=3.0)
    assert_close(r["mismatch/abs_logp_gap_max"], LOG(2), n=3, cond=3.0)
    # Routes: token 0 same set, token 1 half flipped, token 2 not recorded by π.
    assert float(r["routing/mismatch_rate"]) == 0.25 and float(r["routing/any_flip"]) == 0.5
    np.testing.assert_array_equal(r["routing/mismatch_rate_per_layer"], [0.25])
    # One response: s = log π(y)/μ(y) = log(0.25/0.5) + 0 = −log 2, under the cap.
    assert_close(r["seq/log_ratio"], -LOG(2), n=3, cond=3.0)
    assert_close(r["seq/log_ratio_sq"], LOG(2) ** 2, n=6, cond=3.0)
    assert float(r["seq/beyond_cap"]) == 0.0
    assert "routing/mismatch_rate_per_layer" not in dg.train_infer_mismatch(
        mu, pi, mask, routes_mu, routes_pi, jnp.ones((1, 3)))


def test_sequence_log_ratio_counts_responses_not_tokens():
    # Row 0: three tokens of +log 2 -> s = 3 log 2, weight 8 > 5. Row 1: one token of
    # −log 2 -> s = −log 2. Row 2: no completion token (not a response). Masked slots hold
    # NaN, which must not leak.
    pi = jnp.array([[LOG(2), LOG(2), LOG(2)], [-LOG(2), jnp.nan, 0.0], [0.0, 0.0, 0.0]])
    mu = jnp.zeros((3, 3))
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    r = dg.reduce_metrics([dg.sequence_log_ratio(pi, mu, mask, tis_cap=5.0)])
    assert_close(r["seq/log_ratio"], LOG(2), n=8, cond=3.0)  # (3 log 2 − log 2) / 2
    assert_close(r["seq/log_ratio_sq"], 5 * LOG(2) ** 2, n=8, cond=3.0)  # (9 + 1) / 2
    assert float(r["seq/beyond_cap"]) == 0.5
    r = dg.reduce_metrics([dg.sequence_log_ratio(pi, mu, mask, tis_cap=10.0)])
    assert float(r["seq/beyond_cap"]) == 0.0


def test_reduce_metrics_sums_pairs_and_picks_extremes():
    a = {"x": (jnp.array(3.0), jnp.array(2.0)), "w_max": (jnp.array(5.0), jnp.array(1.0)),
         "v": (np.array([1.0, 0.0]), np.array([2.0, 0.0]))}
    b = {"x": (jnp.array(1.0), jnp.array(2.0)), "w_max": (jnp.array(9.0), jnp.array(0.0)),
         "v": (np.array([1.0, 0.0]), np.array([2.0, 0.0]))}
    r = dg.reduce_metrics([a, b])
    assert r["x"] == 1.0 and r["w_max"] == 5.0  # b's max has no counted token
    np.testing.assert_array_equal(r["v"], [0.5, np.nan])  # a zero denominator is NaN
    with pytest.raises(ValueError, match="no metric dicts"):
        dg.reduce_metrics([])


def test_pairs_accumulate_exactly_and_jit_with_numpy(x64):
    # Pair algebra, so float64: halves add up to the whole.
    rng = np.random.default_rng(0)
    mu, pi = np.log(rng.uniform(0.05, 1, (2, 6, 5)))
    m = rng.uniform(size=(6, 5)) > 0.3
    for fn in (dg.kl_k1, dg.kl_k3):
        whole = _ratio(jax.jit(fn)(mu, pi, m))
        halves = [fn(mu[s], pi[s], m[s]) for s in (slice(0, 2), slice(2, 6))]
        # 30 terms of both signs, each ≤ log(20) ≈ 3 (k1) or ≤ 20 (k3) in size.
        assert_close(sum(h[0] for h in halves) / sum(h[1] for h in halves), whole, n=32,
                     dtype="float64", scale=20.0 * 30)

"""Losses on tiny batches with hand-derived values and gradients, and the first-order claim."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close, bound

from stablerl_jax import diagnostics as dg
from stablerl_jax import losses
from stablerl_jax.config import LOSS_NAMES, ConfigError, LossConfig
from stablerl_jax.losses import LossBatch

L = np.log
# float32 roundings behind a hand-sized loss value or gradient entry. A weight
# exp(log a − log b): the inputs' float32 roundings are absolute errors ≤ 2.3u each
# (|log p| ≤ 2.3), which the difference (1) and exp (1) turn into relative error: ≤ 7.
# Then the product keep·w·Â·log π with log π's own rounding (3), the sums over tokens and
# responses (2), the aggregation's division (1) and a length normalization (1): 14.
# Values whose terms cancel pass their cond.
N = 14


def _batch(logp, old, mu, adv, mask):
    return (jnp.asarray(L(logp), jnp.float32),
            LossBatch(old_logp_BxT=jnp.asarray(L(old), jnp.float32),
                      rollout_logp_BxT=jnp.asarray(L(mu), jnp.float32),
                      mask_BxT=jnp.asarray(mask, jnp.float32),
                      advantages_B=jnp.asarray(adv, jnp.float32)))


# Response 0: Â=+1, ρ = π_θ/μ = [2, 0.8], r = π_θ/π_old = [1, 0.8] (kept), engine
# π_old/μ = [2, 1]. Response 1: Â=−1, r_0 = 0.5 < 0.8 → masked by the clip; its second
# token is padding.
LOGP, BATCH = _batch(logp=[[0.5, 0.4], [0.1, 0.9]], old=[[0.5, 0.5], [0.2, 0.9]],
                     mu=[[0.25, 0.5], [0.2, 0.9]], adv=[1.0, -1.0], mask=[[1, 1], [1, 0]])
# Same shapes, μ = π_old: response 0 has r = [1.5 (clipped at 1.27), 1.0], response 1 r = 0.5.
LOGP2, BATCH2 = _batch([[0.75, 0.5], [0.1, 0.9]], [[0.5, 0.5], [0.2, 0.9]],
                       [[0.5, 0.5], [0.2, 0.9]], [1.0, -1.0], [[1, 1], [1, 0]])


@functools.partial(jax.jit, static_argnums=(0, 1))
def _vg(name, cfg, logp, batch):
    return jax.value_and_grad(lambda lp: losses.LOSSES[name](lp, batch, cfg), has_aux=True)(logp)


def _value_and_grad(name, cfg, logp=LOGP, batch=BATCH):
    (v, _), g = _vg(name, cfg, logp, batch)
    return v, g


def test_minirl_by_hand():
    v, g = _value_and_grad("minirl", LossConfig())
    # Weights sg[min(ρ, 5)] = [2, 0.8]; response 1 masked; 1/B = 1/2.
    assert_close(v, -(2 * L(0.5) + 0.8 * L(0.4)) / 2, n=N)
    assert_close(g, [[-1.0, -0.4], [0.0, 0.0]], n=N)


def test_minirl_ablations_by_hand():
    # + length normalization: response 0's sum divided by |y_0| = 2.
    v, g = _value_and_grad("minirl", LossConfig(aggregation="seq_mean_token_mean"))
    assert_close(v, -(2 * L(0.5) + 0.8 * L(0.4)) / 2 / 2, n=N)
    assert_close(g, [[-0.5, -0.2], [0.0, 0.0]], n=N)
    # w/o train–inference IS: weight 1.
    v, g = _value_and_grad("minirl", LossConfig(use_is=False))
    assert_close(v, -(L(0.5) + L(0.4)) / 2, n=N)
    assert_close(g, [[-0.5, -0.5], [0.0, 0.0]], n=N)
    # no clipping: response 1's token counts with ρ = 0.1/0.2 = 0.5 and Â = −1.
    v, g = _value_and_grad("minirl", LossConfig(clip=False))
    assert_close(g, [[-1.0, -0.4], [0.25, 0.0]], n=N)
    # Terms of both signs: cond = Σ|terms| / |Σ terms|.
    terms = [2 * L(0.5), 0.8 * L(0.4), -0.5 * L(0.1)]
    assert_close(v, -sum(terms) / 2, n=N, cond=sum(map(abs, terms)) / abs(sum(terms)))


def test_aggregations_by_hand():
    base = LossConfig(clip=False, use_is=False)  # term = Â log π on 3 real tokens
    terms = [L(0.5), L(0.4), -L(0.1)]
    cond = sum(map(abs, terms)) / abs(sum(terms))  # terms of both signs
    for agg, want in [("response_sum", sum(terms) / 2),
                      ("seq_mean_token_mean", ((terms[0] + terms[1]) / 2 + terms[2]) / 2),
                      ("token_mean", sum(terms) / 3),
                      ("seq_mean_token_sum_norm", sum(terms) / (2 * 2))]:
        v, _ = _value_and_grad("minirl", base.replace(aggregation=agg))
        assert_close(v, -want, n=N, cond=cond, err_msg=agg)
    v, _ = _value_and_grad("minirl", base.replace(aggregation="seq_mean_token_sum_norm",
                                                  norm_length=10))
    assert_close(v, -sum(terms) / (2 * 10), n=N, cond=cond)


def test_minirl_cap_and_engine_target():
    logp, batch = _batch([[0.5]], [[0.5]], [[0.05]], [1.0], [[1]])  # ρ = 10 > C = 5
    _, g = _value_and_grad("minirl", LossConfig(), logp, batch)
    assert_close(g, [[-5.0]], n=N)
    # Cap on π_old/μ = 10 only, times the uncapped staleness ratio r = 0.6/0.5.
    logp, batch = _batch([[0.6]], [[0.5]], [[0.05]], [1.0], [[1]])
    _, g = _value_and_grad("minirl", LossConfig(cap_target="engine"), logp, batch)
    assert_close(g, [[-5.0 * 1.2]], n=N)
    # The full-ratio cap binds on ρ = 12 instead.
    _, g = _value_and_grad("minirl", LossConfig(), logp, batch)
    assert_close(g, [[-5.0]], n=N)


def test_is_corrections_by_hand():
    x = jnp.log(jnp.array([[0.3, 1.5, 3.0, 7.0]]))
    m = jnp.array([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding
    x = x * m

    def w(mode, **kw):
        weight, altered = losses.is_weight(x, m, LossConfig(is_correction=mode, **kw))
        return np.asarray(weight)[:, :3], np.asarray(altered)[:, :3]

    # Token weights: float32 log (1) then exp (1 + the log's error, |log ρ| ≤ 2): n = 5.
    assert_close(w("tis", tis_cap=2.0)[0], [[0.3, 1.5, 2.0]], n=5)
    np.testing.assert_array_equal(w("tis", tis_cap=2.0)[1], [[0, 0, 1]])
    assert_close(w("mis")[0], [[0.3, 1.5, 0.0]], n=5)
    np.testing.assert_array_equal(w("mis")[1], [[0, 0, 1]])
    assert_close(w("icepop")[0], [[0.0, 1.5, 0.0]], n=5)
    np.testing.assert_array_equal(w("icepop")[1], [[1, 0, 1]])
    # Sequence level: Π = 1.35 (below C = 5); geometric mean over |y| = 3 tokens. exp turns
    # the absolute error of the log-sum into relative error: each x_i carries its input's
    # rounding (u) and its log's (u·|x_i|), the sum 2 roundings of ≤ Σ|x| = 2.71, so
    # ≤ (3 + 3·2.71)u, and exp 1: n = 13 (the mean's division by 3 only shrinks it).
    assert_close(w("seq_product")[0], np.full((1, 3), 1.35), n=13)
    assert_close(w("seq_geomean")[0], np.full((1, 3), 1.35 ** (1 / 3)), n=13)
    assert_close(w("seq_product", tis_cap=1.2)[0], np.full((1, 3), 1.2), n=2)
    np.testing.assert_array_equal(w("seq_product", tis_cap=1.2)[1], np.ones((1, 3)))
    np.testing.assert_array_equal(w("none")[0], np.ones((1, 3)))
    # A mode LossConfig would refuse (set past its check) is an error, not a silent weight.
    bogus = LossConfig()
    object.__setattr__(bogus, "is_correction", "bogus")
    with pytest.raises(ValueError, match="is_correction.*bogus.*tis"):
        losses.is_weight(x, m, bogus)


def test_grpo_and_dapo_by_hand():
    # Response 0: r = [1.5 → clip 1.27 (no grad), 1.0]; response 1: r = 0.5, Â = −1:
    # min(−0.5, −0.8) = −0.8, the clipped branch (no grad).
    v, g = _value_and_grad("grpo", LossConfig(name="grpo", use_is=False), LOGP2, BATCH2)
    terms = [(1.27 + 1.0) / 2, -0.8]  # of both signs
    cond = sum(map(abs, terms)) / abs(sum(terms))
    assert_close(v, -sum(terms) / 2, n=N, cond=cond)
    # d(r Â)/d log π = r Â: token (0, 1) has r = 1, weight 1/(2·2).
    assert_close(g, [[0.0, -0.25], [0.0, 0.0]], n=N)
    # DAPO: same term, token mean over 3 tokens.
    v, g = _value_and_grad("dapo", LossConfig(name="dapo", use_is=False), LOGP2, BATCH2)
    assert_close(v, -(1.27 + 1.0 - 0.8) / 3, n=N, cond=(1.27 + 1.0 + 0.8) / 1.47)
    assert_close(g, [[0.0, -1 / 3], [0.0, 0.0]], n=N)
    # DAPO's clip-higher ε_high = 0.6 lets r = 1.5 through with its gradient r Â / 3.
    v, g = _value_and_grad("dapo", LossConfig(name="dapo", use_is=False, eps_high=0.6),
                           LOGP2, BATCH2)
    assert_close(v, -(1.5 + 1.0 - 0.8) / 3, n=N, cond=(1.5 + 1.0 + 0.8) / 1.7)
    assert_close(g, [[-0.5, -1 / 3], [0.0, 0.0]], n=N)


def test_dual_clip_by_hand():
    # One response, Â = −1, μ = π_old, r = [4, 2]. Without dual-clip both tokens take the
    # unclipped branch min(rÂ, clip(r)Â) = rÂ: J = (−4 − 2)/2, d(−J)/d log π = −rÂ/2.
    # With c = 3 token 0 (r > c) contributes the constant cÂ = −3 and no gradient.
    logp, batch = _batch([[0.8, 0.4]], [[0.2, 0.2]], [[0.2, 0.2]], [-1.0], [[1, 1]])
    base = LossConfig(name="grpo", use_is=False)
    v, g = _value_and_grad("grpo", base, logp, batch)
    assert_close(v, 3.0, n=N)
    assert_close(g, [[2.0, 1.0]], n=N)
    dual = base.replace(clip_ratio_c=3.0)
    v, g = _value_and_grad("grpo", dual, logp, batch)
    assert_close(v, 2.5, n=N)
    assert_close(g, [[0.0, 1.0]], n=N)
    (_, metrics), _ = _vg("grpo", dual, logp, batch)
    assert float(metrics["clip/frac_dual"][0] / metrics["clip/frac_dual"][1]) == 0.5
    # A positive advantage is never dual-clipped: the value is the ordinary PPO-clip one.
    logp, batch = _batch([[0.8, 0.4]], [[0.2, 0.2]], [[0.2, 0.2]], [1.0], [[1, 1]])
    assert_close(_value_and_grad("grpo", dual, logp, batch)[0],
                 _value_and_grad("grpo", base, logp, batch)[0], n=N)


def test_grpo_with_engine_tis_by_hand():
    # On BATCH: engine factor π_old/μ = [2, 1 | 1]; r = [1, 0.8 | 0.5].
    # ε_low = 0.25 keeps r = 0.8 strictly inside the clip range [0.75, 1.2]: at r = 1 − ε
    # exactly (float32 exp(log 0.8) lands on 0.8 on some backends) clip's derivative is a
    # tie. Response 0: 2·1 + 1·0.8, mean over 2 tokens; response 1: min(−0.5, −0.75).
    v, g = _value_and_grad("grpo", LossConfig(name="grpo", eps_low=0.25), LOGP, BATCH)
    assert_close(v, -((2.0 + 0.8) / 2 - 0.75) / 2, n=N, cond=(1.4 + 0.75) / 0.65)
    assert_close(g, [[-2.0 / 4, -0.8 / 4], [0.0, 0.0]], n=N)


def test_cispo_by_hand():
    v, g = _value_and_grad("cispo", LossConfig(name="cispo", use_is=False), LOGP2, BATCH2)
    terms = [1.27 * L(0.75), L(0.5), -0.8 * L(0.1)]
    assert_close(v, -sum(terms) / 3, n=N, cond=sum(map(abs, terms)) / abs(sum(terms)))
    # Every token keeps a gradient, scaled by its clipped ratio.
    assert_close(g, [[-1.27 / 3, -1 / 3], [0.8 / 3, 0.0]], n=N)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_by_hand(name):
    # r = [1.0002, 1]: s = 1.0002^(1/2) inside [1 − 3e-4, 1 + 4e-4]; ds/dlog π_t = s/2.
    logp, batch = _batch([[0.50010, 0.5]], [[0.5, 0.5]], [[0.5, 0.5]], [1.0], [[1, 1]])
    v, g = _value_and_grad(name, LossConfig(name=name, use_is=False), logp, batch)
    s = np.sqrt(0.5001 / 0.5)
    # log r = 2e-4 is the difference of two float32 logs ≈ −0.69: its absolute error
    # (2 roundings of 0.69) goes straight into s = exp(mean log r) as relative error.
    assert_close(v, -s, n=N)
    assert_close(g, [[-s / 2, -s / 2]], n=N)
    # Outside the tiny range the clipped branch has no gradient.
    logp, batch = _batch([[0.51, 0.5]], [[0.5, 0.5]], [[0.5, 0.5]], [1.0], [[1, 1]])
    v, g = _value_and_grad(name, LossConfig(name=name, use_is=False), logp, batch)
    assert_close(v, -(1 + 4e-4), n=N)
    np.testing.assert_array_equal(g, 0.0)  # the clipped branch is a constant


def test_gspo_token_uses_per_token_advantages():
    # s ≈ 1 (inside the range); Â_t = [2, −1]: gradient s·Â_t/|y| per token; GSPO proper
    # would give both tokens s·mean(Â)/|y|.
    logp, batch = _batch([[0.50010, 0.5]], [[0.5, 0.5]], [[0.5, 0.5]], [0.0], [[1, 1]])
    batch = batch._replace(advantages_BxT=jnp.array([[2.0, -1.0]]))
    s = np.sqrt(0.5001 / 0.5)
    _, g = _value_and_grad("gspo_token", LossConfig(name="gspo_token", use_is=False), logp,
                           batch)
    assert_close(g, [[-s * 2 / 2, s / 2]], n=N)
    _, g = _value_and_grad("gspo", LossConfig(name="gspo", use_is=False), logp, batch)
    # mean(Â) = 0.5 from terms 2 and −1 (cond 3).
    assert_close(g, [[-s * 0.5 / 2, -s * 0.5 / 2]], n=N, cond=3.0)


@pytest.mark.parametrize("name", ["minirl", "grpo", "cispo"])
def test_per_token_advantages_equal_broadcast_per_response(name):
    per_token = BATCH._replace(advantages_B=None, advantages_BxT=jnp.broadcast_to(
        BATCH.advantages_B[:, None], (2, 2)))
    v1, g1 = _value_and_grad(name, LossConfig(name=name))
    v2, g2 = _value_and_grad(name, LossConfig(name=name), LOGP, per_token)
    # The same float32 arithmetic on the same values: equal up to operation order. The
    # values cancel (cispo: terms −1.39, −0.73, +1.84 over 3 tokens), so the scale is the
    # size of the terms: Σ|term| / (aggregation's denominator) ≤ 1.32 for all three.
    assert_close(v2, v1, n=N, scale=1.5)
    assert_close(g2, g1, n=N, scale="max")


def test_minirl_metrics_by_hand():
    _, metrics = jax.jit(losses.minirl, static_argnums=2)(LOGP, BATCH, LossConfig())
    r = dg.reduce_metrics([metrics])
    # Real tokens: ρ = [2, 0.8, 0.5], r = [1, 0.8, 0.5], engine = [2, 1, 1]; Â = [+, +, −].
    assert_close(r["is/weight_mean"], 3.3 / 3, n=N)
    assert_close(r["is/weight_max"], 2.0, n=N)
    assert_close(r["is/weight_min"], 0.5, n=N)
    assert_close(r["is/ess"], 1.1**2 / ((4 + 0.64 + 0.25) / 3), n=2 * N + 4)
    assert r["is/frac_truncated"] == 0.0 and r["clip/frac_high"] == 0.0
    assert_close(r["clip/frac_low"], 1 / 3, n=4)
    assert "kl/engine_k1" not in r  # the KL is the score step's monitor, computed once
    # Means of log-ratios (as in diagnostics_test): each input log (1), the differences (1),
    # the sum (2), the division (1): n = 6 relative to the input logs, Σ|log p| / |result|.
    # staleness = [log 0.4 − log 0.5, log 0.1 − log 0.2]; engine = [log 0.5 − log 0.25].
    assert_close(r["eq5/staleness_log_mean"], (L(0.8) + L(0.5)) / 3, n=6,
                 cond=-(L(0.4) + L(0.5) + L(0.1) + L(0.2)) / -(L(0.8) + L(0.5)))
    # std = sqrt(mean(x²) − mean(x)²) of x = [log 2, 0, 0]: the log-ratio's 6 (cond 3 from
    # its input logs) and the square, sum, difference and sqrt (4); the difference cancels
    # (cond (mean2 + mean²) / (mean2 − mean²) = 2).
    mean2, mean = L(2) ** 2 / 3, L(2) / 3
    assert_close(r["eq5/engine_log_std"], np.sqrt(mean2 - mean**2), n=10,
                 cond=3.0 * (mean2 + mean**2) / (mean2 - mean**2))
    # Response 0: R = expm1(prefix)·expm1(log 0.8) = 1 · (−0.2), no sum cancels. The
    # prefix (log 2 − log 0.25's 3 roundings, the cumsum and difference 2, ≈ 4u absolute)
    # doubled by expm1's slope at log 2 (e^x / expm1 x = 2), expm1 (1); log 0.8's absolute
    # error (≈ 2u, from log 0.4 − log 0.5) ×4 by expm1's slope at log 0.8, expm1 (1); the
    # product (1): n = 20. Response 1 (one token) is 0 exactly.
    assert_close(r["eq5/first_order_residual_abs"], 0.1, n=20)
    assert_close(r["loss"], -(2 * L(0.5) + 0.8 * L(0.4)) / 2, n=N)


def test_minirl_gradient_equals_eq4_when_no_cap_binds(x64):
    """∇ of Eq. 7 == ∇ of the Eq. 3 surrogate −(1/B) Σ M ρ Â m (whose gradient is Eq. 4)."""
    # Two formulas for one gradient (algebra, not rounding), so float64.
    rng = np.random.default_rng(0)
    theta = jnp.asarray(rng.normal(size=(4, 6, 5)))  # logits of a tiny policy
    tokens = rng.integers(0, 5, (4, 6))
    logp_of = lambda th: jnp.take_along_axis(jax.nn.log_softmax(th), tokens[..., None], -1)[..., 0]
    mu = logp_of(theta + 0.1 * rng.normal(size=theta.shape))
    old = logp_of(theta + 0.05 * rng.normal(size=theta.shape))
    adv = jnp.array([1.0, -0.5, 2.0, -1.5])
    mask = jnp.asarray(rng.uniform(size=(4, 6)) > 0.2, jnp.float64)
    batch = LossBatch(old, mu, mask, advantages_B=adv)
    cfg = LossConfig(tis_cap=40.0)

    def eq4_surrogate(th):
        lp = logp_of(th)
        r = jnp.exp(jax.lax.stop_gradient(lp) - old)
        a = adv[:, None]
        keep = ~(((a > 0) & (r > 1.27)) | ((a < 0) & (r < 0.8)))
        return -jnp.sum(keep * jnp.exp(lp - mu) * a * mask) / 4

    grad7 = lambda c: jax.grad(lambda t: losses.minirl(logp_of(t), batch, c)[0])
    g7, g7_engine, g4 = jax.jit(lambda th: (grad7(cfg)(th),
                                            grad7(cfg.replace(cap_target="engine"))(th),
                                            jax.grad(eq4_surrogate)(th)))(theta)
    assert float(jnp.max(jnp.abs(g4))) > 1e-3  # the comparison is not vacuous
    # log π: log-softmax over V = 5 (the sum 5, max/exp/log/differences 4: 9, absolute
    # ≤ 9u·(|z| + lse) ≤ 9u·5.1, which exp(log π − log μ) makes relative: 46); the ratio and
    # products w·Â·m/B (4); the log-softmax VJP (softmax 9, product and difference 2):
    # n = 61. Each logit's gradient comes from its own (b, t): nothing sums across tokens.
    assert_close(g7, g4, n=61, dtype="float64", scale="max")
    # Capping only the engine factor is the same weight when no cap binds.
    assert_close(g7_engine, g4, n=61, dtype="float64", scale="max")


def _tabular(theta):
    """Autoregressive policy over V=2, length 2: logits θ[prefix] for prefixes (), (0,), (1,).
    Returns log-probs [4 sequences, 2 tokens] of all sequences in order 00, 01, 10, 11."""
    seqs = np.array(list(itertools.product([0, 1], repeat=2)))
    logp0 = jax.nn.log_softmax(theta[0])[seqs[:, 0]]
    logp1 = jax.nn.log_softmax(theta[1 + seqs[:, 0]], axis=-1)[np.arange(4), seqs[:, 1]]
    return jnp.stack([logp0, logp1], axis=1)


def test_token_surrogate_is_first_order_approximation_of_sequence_objective():
    theta_mu = jnp.array([[0.3, -0.2], [1.0, 0.1], [-0.5, 0.4]])
    logp_mu = _tabular(theta_mu)
    reward = jnp.array([1.0, 0.0, 0.0, 1.0])
    mu_seq = jnp.exp(logp_mu.sum(1))
    direction = jnp.array([[1.0, -1.0], [-0.5, 0.7], [0.8, -0.2]])
    # Token surrogate through MiniRL over the 4 enumerated sequences: Â = 4·μ(y)·R(y) makes
    # (1/B) Σ_y the exact expectation over μ. No cap, no clip.
    batch = LossBatch(logp_mu, logp_mu, jnp.ones((4, 2)), advantages_B=mu_seq * reward * 4)
    cfg = LossConfig(clip=False, tis_cap=1e9)

    @functools.partial(jax.jit, static_argnums=1)
    def gap(scale, cfg=cfg):
        theta = theta_mu + scale * direction
        # Exact Eq. 1: J_seq(θ) = E_μ[π/μ R] = Σ_y π_θ(y) R(y).
        g_seq = jax.grad(lambda th: jnp.sum(jnp.exp(_tabular(th).sum(1)) * reward))(theta)
        g_tok = -jax.grad(lambda th: losses.minirl(_tabular(th), batch, cfg)[0])(theta)
        delta = jnp.max(jnp.abs(jnp.expm1(_tabular(theta) - logp_mu)))  # max_t |δ_t|
        return jnp.linalg.norm(g_tok - g_seq) / jnp.linalg.norm(g_seq), delta

    scales = (0.0, 0.02, 0.05, 0.2, 0.5)
    out = [tuple(map(float, gap(s))) for s in scales]
    gaps, deltas = zip(*out)
    # The IS weight is what makes it first order in the cross terms only: the token
    # gradient errs by Σ_t (Π_s ρ_s − ρ_t) ∇log π_t; without the weight by
    # Σ_t (Π_s ρ_s − 1) ∇log π_t, which adds every token's own δ_t (2.5× larger here).
    no_is = [float(gap(s, cfg.replace(use_is=False))[0]) for s in scales]
    assert all(b > 2 * a for a, b in zip(gaps[1:], no_is[1:])), (gaps, no_is)
    # Exact at π_θ = μ_old, up to float32 rounding counted as in
    # test_one_token_responses_need_the_is_weight_to_be_exact (n = 16, cond ≤ 4: the
    # norm-wise cond of the sum over sequences is 2.4 here); gaps[1] is 2e-2.
    assert gaps[0] <= bound(16, cond=4.0), gaps[0]
    assert all(a < b for a, b in itertools.pairwise(deltas))
    assert all(a < b for a, b in itertools.pairwise(gaps))  # and degrades as the δ_t grow
    # First order: for small δ the gap is linear in max|δ| (the neglected terms of
    # Π(1 + δ_t) − 1 − Σδ_t are products of δ's, and ∇ lowers their order by one).
    ratios = [g / d for g, d in zip(gaps[1:3], deltas[1:3])]
    assert 0.8 < ratios[0] / ratios[1] < 1.25, ratios


def test_one_token_responses_need_the_is_weight_to_be_exact():
    """With an engine mismatch (μ_old ≠ π_old = π_θ, the first update of a step) and
    responses whose reward and loss mask depend on their first token only, the token
    surrogate with the IS weight is the sequence objective exactly (Π_t ρ_t is ρ_0), at any
    mismatch; without the weight it is E_μ[R ∇log π] ≠ ∇E_π[R], off by O(δ)."""
    theta = jnp.array([[0.3, -0.2], [1.0, 0.1], [-0.5, 0.4]])
    theta_mu = theta + jnp.array([[0.4, -0.3], [0.2, 0.5], [-0.1, 0.3]])  # the sampler
    logp_mu, logp_old = _tabular(theta_mu), _tabular(theta)
    seqs = np.array(list(itertools.product([0, 1], repeat=2)))
    reward = jnp.asarray(seqs[:, 0] == 1, jnp.float32)  # depends on the first token only
    mu_seq = jnp.exp(logp_mu.sum(1))
    mask = jnp.array([[1.0, 0.0]] * 4)  # the loss sees the first token only
    batch = LossBatch(logp_old, logp_mu, mask, advantages_B=mu_seq * reward * 4)
    g_seq = jax.grad(lambda th: jnp.sum(jnp.exp(_tabular(th).sum(1)) * reward))(theta)

    def gap(cfg):
        g_tok = -jax.grad(lambda th: losses.minirl(_tabular(th), batch, cfg)[0])(theta)
        return float(jnp.linalg.norm(g_tok - g_seq) / jnp.linalg.norm(g_seq))

    with_is = gap(LossConfig(clip=False, tis_cap=1e9))
    without = gap(LossConfig(clip=False, use_is=False))
    # With the weight: exact up to float32 rounding (log-softmax 3, the sequence product
    # and exp 3, the weight 3, Â = 4μR 3, the sum over 4 sequences 4: n = 16, on both
    # gradients; the norm of the difference relative to ‖g‖, cond ≤ 4 from the sum).
    # Without it: the mismatch itself, orders of magnitude above.
    assert with_is <= bound(16, cond=4.0), with_is
    assert without > 1e3 * bound(16, cond=4.0), without


def test_icepop_masks_on_the_engine_ratio_on_a_stale_batch():
    # π_old/μ = 1.2 (inside [0.5, 2]); π_θ has moved to 3·π_old (stale): π_θ/μ = 3.6.
    logp, batch = _batch([[0.6]], [[0.2]], [[1 / 6]], [1.0], [[1]])
    cfg = losses.LOSS_PRESETS["minirl_icepop"]
    assert cfg.is_correction == "icepop" and cfg.cap_target == "engine"
    (_, metrics), g = _vg("minirl", cfg.replace(clip=False), logp, batch)
    # Kept: weight = engine factor 1.2 × staleness 3 = 3.6 (masking on π_θ/μ would drop it).
    assert_close(g, [[-3.6]], n=N)
    assert float(metrics["is/frac_truncated"][0]) == 0.0
    (_, _), g_full = _vg("minirl", cfg.replace(clip=False, cap_target="full"), logp, batch)
    np.testing.assert_array_equal(g_full, 0.0)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_clamps_the_sequence_log_ratio(name):
    # log s = 12 with Â < 0: clamped at 10 the loss is e^10 and the gradient 0 (tunix,
    # verl); unclamped it would be e^12 with gradient e^12 per token.
    logp, batch = _batch([[np.exp(12.0) * 1e-6]], [[1e-6]], [[1e-6]], [-1.0], [[1]])
    v, g = _value_and_grad(name, LossConfig(name=name, use_is=False), logp, batch)
    assert_close(v, np.exp(10.0), n=N)
    np.testing.assert_array_equal(g, 0.0)


def test_sequence_is_clamps_the_sum_not_the_tokens():
    # Token log-ratios 25 and −10: the sequence weight is exp(15) (verl clamps the sum);
    # clipping each token at ±20 first would give exp(10).
    x = jnp.array([[25.0, -10.0]])
    w, altered = losses.is_weight(x, jnp.ones((1, 2)),
                                  LossConfig(is_correction="seq_product", tis_cap=1e9))
    assert_close(w, np.full((1, 2), np.exp(15.0)), n=4)  # a sum of two, one exp
    np.testing.assert_array_equal(altered, 0.0)


def test_seq_mean_token_mean_divides_by_nonempty_responses():
    # Response 1 is empty: the loss is response 0's token mean, not half of it.
    logp, batch = _batch([[0.5, 0.4], [0.1, 0.9]], [[0.5, 0.4], [0.1, 0.9]],
                         [[0.5, 0.4], [0.1, 0.9]], [1.0, -1.0], [[1, 1], [0, 0]])
    v, _ = _value_and_grad("minirl", LossConfig(aggregation="seq_mean_token_mean"), logp,
                           batch)
    assert_close(v, -(L(0.5) + L(0.4)) / 2, n=N)


def test_non_finite_old_logp_on_a_real_token_makes_the_loss_nan():
    # NaN π_old on a counted token: NaN comparisons are False, so the clip mask would keep
    # the token; the loss is NaN instead and the trainer skips the update.
    for name in losses.LOSSES:
        for field in ("old_logp_BxT", "rollout_logp_BxT"):
            bad = BATCH._replace(**{field: getattr(BATCH, field).at[0, 0].set(jnp.nan)})
            (v, _), _ = _vg(name, LossConfig(name=name), LOGP, bad)
            assert np.isnan(v), (name, field)
        bad = BATCH._replace(advantages_B=BATCH.advantages_B.at[1].set(jnp.inf))
        assert np.isnan(_vg(name, LossConfig(name=name), LOGP, bad)[0][0]), name


def test_minibatch_metrics_reduce_to_the_full_batch(x64):
    # Algebra of the (num, den) pairs, so float64: two halves reduce to the whole batch.
    rng = np.random.default_rng(1)
    logp = jnp.asarray(-rng.uniform(0.1, 3.0, (8, 5)))
    batch = LossBatch(old_logp_BxT=logp + 0.3 * rng.normal(size=(8, 5)),
                      rollout_logp_BxT=logp + 0.3 * rng.normal(size=(8, 5)),
                      mask_BxT=jnp.asarray(rng.uniform(size=(8, 5)) > 0.3),
                      advantages_B=jnp.array([1.0, -1, 0.5, -0.5, 2, -2, 0, 1]))
    loss = jax.jit(losses.minirl, static_argnums=2)
    cfg = LossConfig()
    full = dg.reduce_metrics([loss(logp, batch, cfg)[1]])
    halves = [loss(logp[s], jax.tree.map(lambda v: v[s], batch), cfg)[1]
              for s in (slice(0, 4), slice(4, 8))]
    parts = dg.reduce_metrics(halves)
    assert set(full) == set(parts)
    # Sums of ≤ 40 terms of both signs, each ≤ 400 in size (a squared clipped log-ratio).
    for key in full:  # "loss" too: response_sum over equal halves is the mean of the halves
        assert_close(parts[key], full[key], n=48, dtype="float64", scale=400.0, err_msg=key)


def test_masked_tokens_contribute_nothing():
    # Padding slot (1, 1) holding −inf / NaN / absurd values changes neither value nor gradient.
    logp2 = LOGP.at[1, 1].set(-jnp.inf)
    batch2 = BATCH._replace(rollout_logp_BxT=BATCH.rollout_logp_BxT.at[1, 1].set(jnp.nan),
                  old_logp_BxT=BATCH.old_logp_BxT.at[1, 1].set(1e9))
    for name in losses.LOSSES:
        cfg = LossConfig(name=name)
        (v1, m1), g1 = _vg(name, cfg, LOGP, BATCH)
        (v2, m2), g2 = _vg(name, cfg, logp2, batch2)
        # The padding slot is masked out before any arithmetic: bit for bit the same.
        np.testing.assert_array_equal(v2, v1, err_msg=name)
        np.testing.assert_array_equal(g2, g1, err_msg=name)
        assert float(g2[1, 1]) == 0.0
        r1, r2 = dg.reduce_metrics([m1]), dg.reduce_metrics([m2])
        for key in r1:
            np.testing.assert_array_equal(r2[key], r1[key], err_msg=f"{name} {key}")


@pytest.mark.parametrize("name", list(losses.LOSSES))
def test_degenerate_batches_are_finite(name):
    cases = {
        "equal rewards": BATCH._replace(advantages_B=jnp.zeros(2)),
        "empty response": BATCH._replace(mask_BxT=BATCH.mask_BxT.at[1].set(0.0)),
        "fully masked": BATCH._replace(mask_BxT=jnp.zeros((2, 2))),
        "huge gaps": BATCH._replace(rollout_logp_BxT=BATCH.rollout_logp_BxT - 1e4,
                          old_logp_BxT=BATCH.old_logp_BxT + 1e4),
    }
    # The IS corrections differ only in the weight; exercising them on one loss suffices.
    for corr in ("tis", "icepop", "seq_product") if name == "minirl" else ("tis",):
        cfg = LossConfig(name=name, is_correction=corr)
        for label, batch in cases.items():
            (v, metrics), g = _vg(name, cfg, LOGP, batch)
            assert np.isfinite(v) and np.isfinite(g).all(), (corr, label)
            assert all(np.isfinite(n) and np.isfinite(d) for n, d in metrics.values()), label
            if label == "equal rewards":
                assert float(v) == 0.0 and not np.any(g), label
            if label == "fully masked":
                assert float(v) == 0.0 and not np.any(g), label
            reduced = dg.reduce_metrics([metrics])
            means = [k for k in reduced if label != "fully masked" or k == "loss"]
            assert all(np.isfinite(reduced[k]) for k in means), (label, reduced)


def test_jits_with_numpy_inputs():
    np_batch = jax.tree.map(np.asarray, BATCH)
    for name in losses.LOSSES:
        (v, _), g = _vg(name, LossConfig(name=name), np.asarray(LOGP), np_batch)
        (v_ref, _), g_ref = _vg(name, LossConfig(name=name), LOGP, BATCH)
        np.testing.assert_array_equal(v, v_ref, err_msg=name)  # the same values, traced once
        np.testing.assert_array_equal(g, g_ref, err_msg=name)
    (v, _), _ = _vg("minirl", LossConfig(), np.asarray(LOGP),
                    np_batch._replace(mask_BxT=np_batch.mask_BxT.astype(bool)))
    np.testing.assert_array_equal(v, _vg("minirl", LossConfig(), LOGP, BATCH)[0][0])


def test_bad_batches_name_the_key():
    with pytest.raises(ValueError, match="advantages_B"):
        losses.minirl(LOGP, BATCH._replace(advantages_B=None), LossConfig())
    with pytest.raises(ValueError, match="mask_BxT"):
        losses.minirl(LOGP, BATCH._replace(mask_BxT=jnp.ones((2, 3))), LossConfig())
    with pytest.raises(ValueError, match="advantages_B"):
        losses.minirl(LOGP, BATCH._replace(advantages_B=jnp.ones(3)), LossConfig())


def test_names_and_presets():
    assert tuple(losses.LOSSES) == LOSS_NAMES
    assert all(cfg.name in losses.LOSSES for cfg in losses.LOSS_PRESETS.values())
    assert losses.LOSS_PRESETS["minirl"] == LossConfig()
    assert all(k == k.lower() for k in list(losses.LOSSES) + list(losses.LOSS_PRESETS))


def test_config_errors_name_fields():
    for kw, field in [({"name": "ppo"}, "name"), ({"is_correction": "x"}, "is_correction"),
                      ({"aggregation": "sum"}, "aggregation"), ({"tis_cap": 0.5}, "tis_cap"),
                      ({"eps_low": 1.0}, "eps_low"), ({"cap_target": "x"}, "cap_target"),
                      ({"is_low": 2.0}, "is_low"), ({"advantage": "z"}, "advantage"),
                      ({"max_log_ratio": 0.0}, "max_log_ratio"),
                      ({"max_log_ratio": 100.0}, "max_log_ratio"),
                      ({"norm_length": -1}, "norm_length"), ({"clip": "yes"}, "clip"),
                      ({"advantage_std_ddof": 2}, "advantage_std_ddof"),
                      ({"advantage_std_ddof": True}, "advantage_std_ddof"),
                      ({"name": "grpo", "clip_ratio_c": 1.1}, "clip_ratio_c"),
                      ({"clip_ratio_c": 3.0}, "clip_ratio_c")]:
        with pytest.raises(ConfigError, match=f"^{field}:"):
            LossConfig(**kw)

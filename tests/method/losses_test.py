"""Losses on tiny batches with hand-derived values, gradients and monitors (the core
losses jitted and op by op)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loss_helpers import BATCH, BATCH2, LOGP, LOGP2, L, N, batch_of, value_and_grad, vg
from tolerance import assert_close

from stablerl_jax.config import LossConfig
from stablerl_jax.method import diagnostics as dg
from stablerl_jax.method import losses
from stablerl_jax.rl import accumulate


class HandDerivedTest(chex.TestCase):
    """The core losses' hand-derived values and gradients, each run jitted and op by op
    (chex.variants): the same bounds hold whether or not the loss is traced."""

    def value_and_grad(self, name, cfg, logp=LOGP, batch=BATCH):
        fn = self.variant(lambda lp, b: jax.value_and_grad(
            lambda x: losses.LOSSES[name](x, b, cfg), has_aux=True)(lp))
        (v, _), g = fn(logp, batch)
        return v, g

    @chex.variants(with_jit=True, without_jit=True)
    def test_minirl_by_hand(self):
        v, g = self.value_and_grad("minirl", LossConfig())
        # Weights sg[min(ρ, 5)] = [2, 0.8]; response 1 masked; 1/B = 1/2.
        assert_close(v, -(2 * L(0.5) + 0.8 * L(0.4)) / 2, n=N)
        assert_close(g, [[-1.0, -0.4], [0.0, 0.0]], n=N)

    @chex.variants(with_jit=True, without_jit=True)
    def test_minirl_ablations_by_hand(self):
        # + length normalization: response 0's sum divided by |y_0| = 2.
        v, g = self.value_and_grad("minirl", LossConfig(aggregation="seq_mean_token_mean"))
        assert_close(v, -(2 * L(0.5) + 0.8 * L(0.4)) / 2 / 2, n=N)
        assert_close(g, [[-0.5, -0.2], [0.0, 0.0]], n=N)
        # w/o train–inference IS: weight 1.
        v, g = self.value_and_grad("minirl", LossConfig(use_is=False))
        assert_close(v, -(L(0.5) + L(0.4)) / 2, n=N)
        assert_close(g, [[-0.5, -0.5], [0.0, 0.0]], n=N)
        # no clipping: response 1's token counts with ρ = 0.1/0.2 = 0.5 and Â = −1.
        v, g = self.value_and_grad("minirl", LossConfig(clip=False))
        assert_close(g, [[-1.0, -0.4], [0.25, 0.0]], n=N)
        # Terms of both signs: cond = Σ|terms| / |Σ terms|.
        terms = [2 * L(0.5), 0.8 * L(0.4), -0.5 * L(0.1)]
        assert_close(v, -sum(terms) / 2, n=N, cond=sum(map(abs, terms)) / abs(sum(terms)))

    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_and_dapo_by_hand(self):
        # Response 0: r = [1.5 → clip 1.27 (no grad), 1.0]; response 1: r = 0.5, Â = −1:
        # min(−0.5, −0.8) = −0.8, the clipped branch (no grad).
        v, g = self.value_and_grad("grpo", LossConfig(name="grpo", use_is=False), LOGP2, BATCH2)
        terms = [(1.27 + 1.0) / 2, -0.8]  # of both signs
        cond = sum(map(abs, terms)) / abs(sum(terms))
        assert_close(v, -sum(terms) / 2, n=N, cond=cond)
        # d(r Â)/d log π = r Â: token (0, 1) has r = 1, weight 1/(2·2).
        assert_close(g, [[0.0, -0.25], [0.0, 0.0]], n=N)
        # DAPO: same term, token mean over 3 tokens.
        v, g = self.value_and_grad("dapo", LossConfig(name="dapo", use_is=False), LOGP2, BATCH2)
        assert_close(v, -(1.27 + 1.0 - 0.8) / 3, n=N, cond=(1.27 + 1.0 + 0.8) / 1.47)
        assert_close(g, [[0.0, -1 / 3], [0.0, 0.0]], n=N)
        # DAPO's clip-higher ε_high = 0.6 lets r = 1.5 through with its gradient r Â / 3.
        v, g = self.value_and_grad("dapo", LossConfig(name="dapo", use_is=False, eps_high=0.6),
                                   LOGP2, BATCH2)
        assert_close(v, -(1.5 + 1.0 - 0.8) / 3, n=N, cond=(1.5 + 1.0 + 0.8) / 1.7)
        assert_close(g, [[-0.5, -1 / 3], [0.0, 0.0]], n=N)

    @chex.variants(with_jit=True, without_jit=True)
    def test_cispo_by_hand(self):
        v, g = self.value_and_grad("cispo", LossConfig(name="cispo", use_is=False), LOGP2, BATCH2)
        terms = [1.27 * L(0.75), L(0.5), -0.8 * L(0.1)]
        assert_close(v, -sum(terms) / 3, n=N, cond=sum(map(abs, terms)) / abs(sum(terms)))
        # Every token keeps a gradient, scaled by its clipped ratio.
        assert_close(g, [[-1.27 / 3, -1 / 3], [0.8 / 3, 0.0]], n=N)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gspo_by_hand(self):
        for name in ("gspo", "gspo_token"):
            # r = [1.0002, 1]: s = 1.0002^(1/2) inside [1 − 3e-4, 1 + 4e-4]; ds/dlog π_t = s/2.
            logp, batch = batch_of([[0.50010, 0.5]], [[0.5, 0.5]], [[0.5, 0.5]], [1.0], [[1, 1]])
            v, g = self.value_and_grad(name, LossConfig(name=name, use_is=False), logp, batch)
            s = np.sqrt(0.5001 / 0.5)
            # log r = 2e-4 is the difference of two float32 logs ≈ −0.69: its absolute error
            # (2 roundings of 0.69) goes straight into s = exp(mean log r) as relative error.
            assert_close(v, -s, n=N)
            assert_close(g, [[-s / 2, -s / 2]], n=N)
            # Outside the tiny range the clipped branch has no gradient.
            logp, batch = batch_of([[0.51, 0.5]], [[0.5, 0.5]], [[0.5, 0.5]], [1.0], [[1, 1]])
            v, g = self.value_and_grad(name, LossConfig(name=name, use_is=False), logp, batch)
            assert_close(v, -(1 + 4e-4), n=N)
            np.testing.assert_array_equal(g, 0.0)  # the clipped branch is a constant


def test_aggregations_by_hand():
    base = LossConfig(clip=False, use_is=False)  # term = Â log π on 3 real tokens
    terms = [L(0.5), L(0.4), -L(0.1)]
    cond = sum(map(abs, terms)) / abs(sum(terms))  # terms of both signs
    for agg, want in [("response_sum", sum(terms) / 2),
                      ("seq_mean_token_mean", ((terms[0] + terms[1]) / 2 + terms[2]) / 2),
                      ("token_mean", sum(terms) / 3),
                      ("seq_mean_token_sum_norm", sum(terms) / (2 * 2))]:
        v, _ = value_and_grad("minirl", base.replace(aggregation=agg))
        assert_close(v, -want, n=N, cond=cond, err_msg=agg)
    v, _ = value_and_grad("minirl", base.replace(aggregation="seq_mean_token_sum_norm",
                                                  norm_length=10))
    assert_close(v, -sum(terms) / (2 * 10), n=N, cond=cond)


def test_minirl_cap_and_engine_target():
    logp, batch = batch_of([[0.5]], [[0.5]], [[0.05]], [1.0], [[1]])  # ρ = 10 > C = 5
    _, g = value_and_grad("minirl", LossConfig(), logp, batch)
    assert_close(g, [[-5.0]], n=N)
    # Cap on π_old/μ = 10 only, times the uncapped staleness ratio r = 0.6/0.5.
    logp, batch = batch_of([[0.6]], [[0.5]], [[0.05]], [1.0], [[1]])
    _, g = value_and_grad("minirl", LossConfig(cap_target="engine"), logp, batch)
    assert_close(g, [[-5.0 * 1.2]], n=N)
    # The full-ratio cap binds on ρ = 12 instead.
    _, g = value_and_grad("minirl", LossConfig(), logp, batch)
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


def test_dual_clip_by_hand():
    # One response, Â = −1, μ = π_old, r = [4, 2]. Without dual-clip both tokens take the
    # unclipped branch min(rÂ, clip(r)Â) = rÂ: J = (−4 − 2)/2, d(−J)/d log π = −rÂ/2.
    # With c = 3 token 0 (r > c) contributes the constant cÂ = −3 and no gradient.
    logp, batch = batch_of([[0.8, 0.4]], [[0.2, 0.2]], [[0.2, 0.2]], [-1.0], [[1, 1]])
    base = LossConfig(name="grpo", use_is=False)
    v, g = value_and_grad("grpo", base, logp, batch)
    assert_close(v, 3.0, n=N)
    assert_close(g, [[2.0, 1.0]], n=N)
    dual = base.replace(clip_ratio_c=3.0)
    v, g = value_and_grad("grpo", dual, logp, batch)
    assert_close(v, 2.5, n=N)
    assert_close(g, [[0.0, 1.0]], n=N)
    (_, metrics), _ = vg("grpo", dual, logp, batch)
    assert float(metrics["clip/frac_dual"][0] / metrics["clip/frac_dual"][1]) == 0.5
    # A positive advantage is never dual-clipped: the value is the ordinary PPO-clip one.
    logp, batch = batch_of([[0.8, 0.4]], [[0.2, 0.2]], [[0.2, 0.2]], [1.0], [[1, 1]])
    assert_close(value_and_grad("grpo", dual, logp, batch)[0],
                 value_and_grad("grpo", base, logp, batch)[0], n=N)


def test_grpo_with_engine_tis_by_hand():
    # On BATCH: engine factor π_old/μ = [2, 1 | 1]; r = [1, 0.8 | 0.5].
    # ε_low = 0.25 keeps r = 0.8 strictly inside the clip range [0.75, 1.2]: at r = 1 − ε
    # exactly (float32 exp(log 0.8) lands on 0.8 on some backends) clip's derivative is a
    # tie. Response 0: 2·1 + 1·0.8, mean over 2 tokens; response 1: min(−0.5, −0.75).
    v, g = value_and_grad("grpo", LossConfig(name="grpo", eps_low=0.25), LOGP, BATCH)
    assert_close(v, -((2.0 + 0.8) / 2 - 0.75) / 2, n=N, cond=(1.4 + 0.75) / 0.65)
    assert_close(g, [[-2.0 / 4, -0.8 / 4], [0.0, 0.0]], n=N)


def test_gspo_token_uses_per_token_advantages():
    # s ≈ 1 (inside the range); Â_t = [2, −1]: gradient s·Â_t/|y| per token; GSPO proper
    # would give both tokens s·mean(Â)/|y|.
    logp, batch = batch_of([[0.50010, 0.5]], [[0.5, 0.5]], [[0.5, 0.5]], [0.0], [[1, 1]])
    batch = batch._replace(advantages_BxT=jnp.array([[2.0, -1.0]]))
    s = np.sqrt(0.5001 / 0.5)
    _, g = value_and_grad("gspo_token", LossConfig(name="gspo_token", use_is=False), logp,
                           batch)
    assert_close(g, [[-s * 2 / 2, s / 2]], n=N)
    _, g = value_and_grad("gspo", LossConfig(name="gspo", use_is=False), logp, batch)
    # mean(Â) = 0.5 from terms 2 and −1 (cond 3).
    assert_close(g, [[-s * 0.5 / 2, -s * 0.5 / 2]], n=N, cond=3.0)


@pytest.mark.parametrize("name", ["minirl", "grpo", "cispo"])
def test_per_token_advantages_equal_broadcast_per_response(name):
    per_token = BATCH._replace(advantages_B=None, advantages_BxT=jnp.broadcast_to(
        BATCH.advantages_B[:, None], (2, 2)))
    v1, g1 = value_and_grad(name, LossConfig(name=name))
    v2, g2 = value_and_grad(name, LossConfig(name=name), LOGP, per_token)
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


def test_icepop_masks_on_the_engine_ratio_on_a_stale_batch():
    # π_old/μ = 1.2 (inside [0.5, 2]); π_θ has moved to 3·π_old (stale): π_θ/μ = 3.6.
    logp, batch = batch_of([[0.6]], [[0.2]], [[1 / 6]], [1.0], [[1]])
    cfg = losses.LOSS_PRESETS["minirl_icepop"]
    assert cfg.is_correction == "icepop" and cfg.cap_target == "engine"
    (_, metrics), g = vg("minirl", cfg.replace(clip=False), logp, batch)
    # Kept: weight = engine factor 1.2 × staleness 3 = 3.6 (masking on π_θ/μ would drop it).
    assert_close(g, [[-3.6]], n=N)
    assert float(metrics["is/frac_truncated"][0]) == 0.0
    (_, _), g_full = vg("minirl", cfg.replace(clip=False, cap_target="full"), logp, batch)
    np.testing.assert_array_equal(g_full, 0.0)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_clamps_the_sequence_log_ratio(name):
    # log s = 12 with Â < 0: clamped at 10 the loss is e^10 and the gradient 0 (tunix,
    # verl); unclamped it would be e^12 with gradient e^12 per token.
    logp, batch = batch_of([[np.exp(12.0) * 1e-6]], [[1e-6]], [[1e-6]], [-1.0], [[1]])
    v, g = value_and_grad(name, LossConfig(name=name, use_is=False), logp, batch)
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
    logp, batch = batch_of([[0.5, 0.4], [0.1, 0.9]], [[0.5, 0.4], [0.1, 0.9]],
                         [[0.5, 0.4], [0.1, 0.9]], [1.0, -1.0], [[1, 1], [0, 0]])
    v, _ = value_and_grad("minirl", LossConfig(aggregation="seq_mean_token_mean"), logp,
                           batch)
    assert_close(v, -(L(0.5) + L(0.4)) / 2, n=N)


# Eight responses of two tokens at π_θ = π_old = μ = p_b, Â = 1, response 3 empty (a row
# rl.overlong=mask zeroed); without clip or IS every scored token's term is log p_b.
P_ROWS, EMPTY = np.arange(1, 9) / 10, 3
ROW_MEANS = ("response_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def _one_empty_row():
    p = np.repeat(P_ROWS[:, None], 2, axis=1)
    mask = np.ones((8, 2))
    mask[EMPTY] = 0.0
    return batch_of(p, p, p, np.ones(8), mask)


def _by_hand(aggregation, rows):
    """(loss, d loss / d log π on a scored token) with `rows` in the row mean: each row's
    2 tokens summed (response_sum), averaged (seq_mean_token_mean), or summed over T = 2
    (seq_mean_token_sum_norm)."""
    per_token = {"response_sum": 1.0, "seq_mean_token_mean": 0.5,
                 "seq_mean_token_sum_norm": 0.5}[aggregation] / rows
    scored = 2 * (np.sum(L(P_ROWS)) - L(P_ROWS[EMPTY]))  # Σ over the 14 scored tokens
    return -scored * per_token, -per_token


def _grad_by_hand(per_token):
    return np.where(np.arange(8)[:, None] == EMPTY, 0.0, per_token) * np.ones((8, 2))


def test_row_denominator_by_hand():
    """'scored' divides the row mean by the 7 rows with a token, 'all' by all 8 (verl's
    global_batch_size, tunix's B): the same numerator, so they differ by 8/7 exactly."""
    logp, batch = _one_empty_row()
    for aggregation in ROW_MEANS:
        got = {}
        for rd, rows in (("scored", 7), ("all", 8)):
            cfg = LossConfig(clip=False, use_is=False, aggregation=aggregation,
                             row_denominator=rd)
            got[rd] = value_and_grad("minirl", cfg, logp, batch)
            want, per_token = _by_hand(aggregation, rows)
            assert_close(got[rd][0], want, n=N, err_msg=f"{aggregation} {rd}")
            assert_close(got[rd][1], _grad_by_hand(per_token), n=N, err_msg=aggregation)
        assert_close(got["scored"][0], got["all"][0] * 8 / 7, n=2 * N, err_msg=aggregation)
    # A token mean has no row denominator (the config refuses 'all' with it).
    m, term = batch.mask_BxT, jnp.ones((8, 2))
    np.testing.assert_array_equal(losses.aggregate(term, m, "token_mean"),
                                  losses.aggregate(term, m, "token_mean",
                                                   row_denominator="all"))


@pytest.mark.parametrize("name", list(losses.LOSSES))
def test_every_loss_takes_the_row_denominator(name):
    """The option is the aggregation's, whatever the term: 'scored' = 'all' · 8/7 in value
    and gradient for every loss (a row mean for the token-mean losses)."""
    k = jax.random.split(jax.random.key(0), 3)
    logp, batch = _one_empty_row()
    batch = batch._replace(old_logp_BxT=logp + 0.3 * jax.random.normal(k[0], (8, 2)),
                           rollout_logp_BxT=logp + 0.3 * jax.random.normal(k[1], (8, 2)),
                           advantages_B=jax.random.normal(k[2], (8,)))
    agg = losses.LOSS_TABLE[name].aggregation
    agg = None if agg != "token_mean" else "seq_mean_token_sum_norm"
    (v_s, g_s), (v_a, g_a) = (
        value_and_grad(name, LossConfig(name=name, aggregation=agg, row_denominator=rd),
                       logp, batch) for rd in ("scored", "all"))
    # One numerator and one chain of operations, only the division by the rows differs:
    # relative to each value (not to the size of its terms, which may cancel), the
    # division and the × 8/7 (2), and the backward's products after it (≤ N).
    assert_close(v_s, v_a * 8 / 7, n=2)
    assert_close(g_s, g_a * 8 / 7, n=N)


def test_row_denominator_under_micro_batches_and_packing():
    """Both paths that split a mini-batch pass its `Totals` (rl/step_fns.py): micro-batches
    (accumulate.value_and_grad, strided slices of 2 rows) and packed micro-batches (the
    whole batch with the other rows' masks zeroed, `LossBatch.rows` its own). Under each
    option their losses and gradients add up to the one batch's hand values."""
    logp, batch = _one_empty_row()
    totals = losses.mask_totals(batch.mask_BxT)
    for aggregation in ("response_sum", "seq_mean_token_mean"):
        for rd, rows in (("scored", 7), ("all", 8)):
            cfg = LossConfig(clip=False, use_is=False, aggregation=aggregation,
                             row_denominator=rd)
            want, per_token = _by_hand(aggregation, rows)

            def sliced(table, part):
                index, lb = part
                return losses.minirl(table[index], lb._replace(totals=totals), cfg)

            (v, _), g = accumulate.value_and_grad(sliced, logp, (jnp.arange(8), batch), 4)
            assert_close(v, want, n=N + 4, err_msg=f"micro {aggregation} {rd}")
            assert_close(g, _grad_by_hand(per_token), n=N, err_msg=aggregation)

            v, g = 0.0, 0.0
            for mine in np.split(np.arange(8), 4):
                view = batch._replace(mask_BxT=batch.mask_BxT * np.isin(np.arange(8),
                                                                       mine)[:, None],
                                      totals=totals, rows=jnp.float32(len(mine)))
                vi, gi = value_and_grad("minirl", cfg, logp, view)
                v, g = v + vi, g + gi
            assert_close(v, want, n=N + 4, err_msg=f"packed {aggregation} {rd}")
            assert_close(g, _grad_by_hand(per_token), n=N, err_msg=aggregation)

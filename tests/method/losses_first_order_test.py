"""The first-order claim: the token surrogate's gradient against Eq. 4 and against the
exact sequence-level objective of an enumerable policy."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from tolerance import assert_close, bound

from stablerl_jax.config import LossConfig
from stablerl_jax.method import losses
from stablerl_jax.method.losses import LossBatch


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

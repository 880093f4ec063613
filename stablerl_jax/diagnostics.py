"""Stability diagnostics: the monitors of PAPER.md §5 and the quantities behind Eq. 5.

Letters: B responses, T tokens, V vocab, L layers, K top-k.

Token-averaged diagnostics return (numerator, denominator) pairs, so they add up exactly
over mini-batches and devices (`losses.reduce_metrics`). Inputs are log-probs of the
*sampled* tokens (y ~ μ), so every expectation below is over μ's samples:

    k1 KL(μ‖π)   E_μ[log μ − log π]
    k3 KL(μ‖π)   E_μ[ρ − 1 − log ρ],  ρ = π/μ        (unbiased, always ≥ 0)
    χ²(π‖μ)      E_μ[ρ²] − 1
    PPL ratio    PPL_π / PPL_μ = exp(E_μ[log μ − log π])
    ESS          (Σ ρ)² / (n Σ ρ²) ∈ (0, 1]           (normalized effective sample size)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _m(mask_BxT):
    return mask_BxT.astype(jnp.float32)


def entropy_from_logits(logits_BxTxV):
    """Full-vocabulary entropy H = −Σ_v p_v log p_v, float32 [B, T]."""
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def kl_k1(logp_mu_BxT, logp_pi_BxT, mask_BxT):
    m = _m(mask_BxT)
    return jnp.sum((logp_mu_BxT - logp_pi_BxT) * m), jnp.sum(m)


def kl_k3(logp_mu_BxT, logp_pi_BxT, mask_BxT, max_log_ratio: float = 20.0):
    m = _m(mask_BxT)
    x = jnp.clip(logp_pi_BxT - logp_mu_BxT, -max_log_ratio, max_log_ratio) * m
    return jnp.sum((jnp.expm1(x) - x) * m), jnp.sum(m)


def ppl_ratio(logp_mu_BxT, logp_pi_BxT, mask_BxT):
    """Scalar exp(k1): how much more perplexed π is than μ on μ's samples."""
    num, den = kl_k1(logp_mu_BxT, logp_pi_BxT, mask_BxT)
    return jnp.exp(num / jnp.maximum(den, 1.0))


def chi2(logp_mu_BxT, logp_pi_BxT, mask_BxT, max_log_ratio: float = 20.0):
    m = _m(mask_BxT)
    x = jnp.clip(logp_pi_BxT - logp_mu_BxT, -max_log_ratio, max_log_ratio) * m
    return jnp.sum(jnp.expm1(2 * x) * m), jnp.sum(m)


def is_ess(weights_BxT, mask_BxT):
    """Normalized ESS of token IS weights (scalar; 1 = all weights equal)."""
    m = _m(mask_BxT)
    w = weights_BxT * m
    n = jnp.maximum(jnp.sum(m), 1.0)
    return jnp.sum(w) ** 2 / jnp.maximum(n * jnp.sum(w * w), 1e-30)


def is_weight_stats(log_ratio_BxT, mask_BxT, cap: float, max_log_ratio: float = 20.0):
    """Min / mean / max of ρ over real tokens and the fraction above the cap C."""
    m = _m(mask_BxT)
    w = jnp.exp(jnp.clip(log_ratio_BxT, -max_log_ratio, max_log_ratio))
    real = m > 0
    n = jnp.sum(m)
    return {
        "is/weight_min": jnp.min(jnp.where(real, w, jnp.inf)),
        "is/weight_max": jnp.max(jnp.where(real, w, -jnp.inf)),
        "is/weight_mean": (jnp.sum(w * m), n),
        "is/frac_truncated": (jnp.sum((w > cap) * m), n),
    }


def clip_fractions(logp_BxT, old_logp_BxT, advantages_BxT, mask_BxT, eps_low, eps_high):
    """Fractions of tokens the decoupled-PPO mask drops, by side (PAPER.md §4)."""
    m = _m(mask_BxT)
    r = jnp.exp(logp_BxT - old_logp_BxT)
    hi = (advantages_BxT > 0) & (r > 1 + eps_high)
    lo = (advantages_BxT < 0) & (r < 1 - eps_low)
    n = jnp.sum(m)
    return {"clip/frac_high": (jnp.sum(hi * m), n), "clip/frac_low": (jnp.sum(lo * m), n)}


def eq5_factors(logp_BxT, old_logp_BxT, rollout_logp_BxT, mask_BxT):
    """Eq. 5: log(π_θ/μ_old) = log(π_old/μ_old) [engine] + log(π_θ/π_old) [staleness].

    Returns (num, den) pairs of the mean and mean-square of each log factor; the spread is
    sqrt(sqmean − mean²) after reduction.
    """
    m = _m(mask_BxT)
    n = jnp.sum(m)
    engine = (old_logp_BxT - rollout_logp_BxT) * m
    stale = (logp_BxT - old_logp_BxT) * m
    return {
        "eq5/engine_log_mean": (jnp.sum(engine), n),
        "eq5/engine_log_sqmean": (jnp.sum(engine**2), n),
        "eq5/staleness_log_mean": (jnp.sum(stale), n),
        "eq5/staleness_log_sqmean": (jnp.sum(stale**2), n),
    }


def first_order_residual(log_rho_BxT, mask_BxT, max_log: float = 20.0):
    """Per response: Π_t ρ_t − (1 + Σ_t (ρ_t − 1)), the error of the first-order
    approximation of PAPER.md §2. With x_t = log ρ_t it is expm1(Σ x) − Σ expm1(x),
    which keeps full precision when every δ_t = ρ_t − 1 is tiny; Σ x is clipped to
    ±max_log so a long response cannot overflow. Returns [B]."""
    m = _m(mask_BxT)
    x = jnp.clip(log_rho_BxT, -max_log, max_log) * m
    return jnp.expm1(jnp.clip(jnp.sum(x, axis=1), -max_log, max_log)) - jnp.sum(
        jnp.expm1(x) * m, axis=1)


def routing_mismatch(routes_a_LxBxTxK, routes_b_LxBxTxK, mask_BxT):
    """Per-layer routing mismatch between two route tensors.

    rate_L = mean over tokens of 1 − |topk_a ∩ topk_b| / K; any_flip = fraction of tokens
    with at least one layer that differs. Tokens where either tensor holds -1 (no route
    recorded) or mask is 0 are excluded.
    """
    a, b = routes_a_LxBxTxK, routes_b_LxBxTxK
    k = a.shape[-1]
    same = jnp.sum(jnp.any(a[..., :, None] == b[..., None, :], axis=-1), axis=-1)  # [L,B,T]
    valid_LxBxT = (jnp.all(a >= 0, -1) & jnp.all(b >= 0, -1)) & mask_BxT.astype(bool)[None]
    valid_BxT = jnp.all(valid_LxBxT, axis=0)
    v = valid_BxT.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(v), 1.0)
    rate_L = jnp.sum((1.0 - same / k) * v[None], axis=(1, 2)) / n
    flipped = jnp.any(same < k, axis=0)
    return {"mismatch_rate": rate_L, "any_flip": jnp.sum(flipped * v) / n}

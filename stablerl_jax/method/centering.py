"""Score centering and the drift term it removes (docs/method.md §14). Letters: B responses,
T scored positions, V vocabulary, K the top-k head of q.

Every loss of `losses.LOSSES` has a gradient (Eq. 4, Eq. 7)
    ∇_θ L = Σ_t c_t ∇_θ log π_θ(y_t | s_t),   c_t = ∂L / ∂ log π_θ(y_t)
(MiniRL: advantage × IS weight × clip mask / normalizer; the chain rule's for the clipped and
sequence-level losses). In the scaled logits ζ_t = z_t / τ the score is e_{y_t} − π_t; tokens
come from the sampler's q_t = μ(·|s_t), so E_q[∇_ζ log π] = q_t − π_t, zero only where q = π:
the drift. Centering subtracts it, ∇_ζ L_c = Σ_t c_t (e_{y_t} − q_t), as the surrogate
    L_c = L − Σ_t sg[c_t] · Σ_v sg[q_tv − π_tv] · (ζ_tv − sg[ζ_tv])
(L's value, the centred gradient), written with sg[q − π], not E_q[log π], and q − π as
π · expm1(log q − log π) (`prob_diff`): exactly 0 where q and π are the same bits (`bitwise`
sampler, on-policy), not a rounding of Σ_v q_v = 1 or of two exp calls compiled differently.

q is the whole-vocabulary distribution (center='exact') or its top-k head with a tail shaped
like π (center='topk', `head_tail`); only the head travels from the score step to the update
(B·T·2K numbers instead of B·T·V).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stablerl_jax.method import diagnostics as dg

sg = jax.lax.stop_gradient


def prob_diff(logp_a, logp_b):
    """p_a − p_b = p_b·expm1(log p_a − log p_b): exactly 0 on equal bits, accurate when close."""
    same = logp_a == logp_b
    delta = jnp.where(same, 0.0, logp_a - logp_b)
    return jnp.where(same, 0.0, jnp.exp(logp_b) * jnp.expm1(delta))


def coefficients(loss_fn, logp_BxT, batch, cfg):
    """c_t = ∂L/∂ log π_θ(y_t) of `loss_fn(logp, batch, cfg)`, stop-gradient [B, T]."""
    return sg(jax.grad(lambda lp: loss_fn(lp, batch, cfg)[0])(sg(logp_BxT)))


def head_tail(q_head_BxTxK, q_idx_BxTxK, pi_BxTxV):
    """q [B, T, V] from its top-k head: q_v on the K ids, (1 − Σ_K q) · π_v / (1 − Σ_K π) on
    the others (a tail shaped like π; π stop-gradient)."""
    onehot = jax.nn.one_hot(q_idx_BxTxK, pi_BxTxV.shape[-1], dtype=pi_BxTxV.dtype)
    head_BxTxV = jnp.einsum("btk,btkv->btv", q_head_BxTxK.astype(pi_BxTxV.dtype), onehot)
    in_head_BxTxV = jnp.sum(onehot, axis=2) > 0
    pi_tail = jnp.where(in_head_BxTxV, 0.0, pi_BxTxV)
    q_rest = jnp.maximum(1.0 - jnp.sum(head_BxTxV, -1, keepdims=True), 0.0)
    pi_rest = jnp.sum(pi_tail, -1, keepdims=True)
    scale = jnp.where(pi_rest > 0, q_rest / jnp.where(pi_rest > 0, pi_rest, 1.0), 0.0)
    return head_BxTxV + scale * pi_tail


def drift(logq_BxTxK, q_idx_BxTxK, pi_logp_BxTxV):
    """q − π [B, T, V]: `prob_diff` of the whole log q (q_idx None), else `head_tail` of it."""
    if q_idx_BxTxK is None:
        return prob_diff(logq_BxTxK, pi_logp_BxTxV)
    pi_BxTxV = jnp.exp(pi_logp_BxTxV)
    return head_tail(jnp.exp(logq_BxTxK), q_idx_BxTxK, pi_BxTxV) - pi_BxTxV


def drift_correction(coeff_BxT, logits_BxTxV, drift_BxTxV, mask_BxT):
    """Σ_t c_t Σ_v sg[d_tv] (ζ_tv − sg ζ_tv), d = q − π: value 0, gradient Σ_t c_t d_t · ∂ζ_t."""
    d = jnp.where(jnp.asarray(mask_BxT)[..., None] > 0, sg(drift_BxTxV), 0.0)
    zeta = logits_BxTxV.astype(d.dtype)
    return jnp.sum(coeff_BxT[..., None].astype(d.dtype) * d * (zeta - sg(zeta)))


def centered(loss_fn, logp_BxT, batch, cfg, logits_BxTxV, pi_logp_BxTxV, logq_BxTxK,
             q_idx_BxTxK=None):
    """(L_c, metrics) of `loss_fn`. logits_BxTxV: the update's ζ = z/τ (differentiable);
    pi_logp_BxTxV: its log-softmax as the engines compute it; logq_BxTxK / q_idx_BxTxK: the
    sampler's log q (`drift`). Adds center/drift_l1, token mean of the ‖q − π_θ‖₁ removed."""
    loss, metrics = loss_fn(logp_BxT, batch, cfg)
    drift_BxTxV = drift(sg(logq_BxTxK), q_idx_BxTxK, sg(pi_logp_BxTxV))
    coeff_BxT = coefficients(loss_fn, logp_BxT, batch, cfg)
    loss = loss - drift_correction(coeff_BxT, logits_BxTxV, drift_BxTxV, batch.mask_BxT)
    metrics["center/drift_l1"] = dg.masked_mean_pair(
        jnp.sum(jnp.abs(drift_BxTxV), -1), batch.mask_BxT)
    return loss, metrics


def l1(logp_a_BxTxV, logp_b_BxTxV):
    """‖p_a − p_b‖₁ over the vocabulary at every position [B, T] (`prob_diff`)."""
    return jnp.sum(jnp.abs(prob_diff(logp_a_BxTxV, logp_b_BxTxV)), -1)


def drift_pairs(logq_BxTxV, pi_logp_BxTxV, mask_BxT, group_reward_B) -> dict:
    """Drift pairs over scored tokens (log-probs in): drift/l1, token mean of ‖q_t − π_t‖₁;
    drift/reward_weighted, of R̄_g · ‖q_t − π_t‖₁ with R̄_g the group's mean reward (the size
    of a group-centred gradient's drift term E_q[R] · E_q[∇ log π])."""
    l1_BxT = l1(logq_BxTxV, pi_logp_BxTxV)
    return {"drift/l1": dg.masked_mean_pair(l1_BxT, mask_BxT),
            "drift/reward_weighted": dg.masked_mean_pair(group_reward_B[:, None] * l1_BxT,
                                                         mask_BxT)}


def drift_parts(logq_BxTxV, mid_BxTxV, old_BxTxV, mask_BxT, prefix="attr/drift_") -> dict:
    """Token-mean ‖·‖₁ pairs of the drift q − π_old split as the log-ratio is (attribution.py):
    precision q − π(θ_old, routes_μ), routing π(θ_old, routes_μ) − π_old (staleness, π_old −
    π_θ, is the update's: `staleness_pair`). Log-probs in."""
    mean = lambda a, b: dg.masked_mean_pair(l1(a, b), mask_BxT)
    return {f"{prefix}precision_l1": mean(logq_BxTxV, mid_BxTxV),
            f"{prefix}routing_l1": mean(mid_BxTxV, old_BxTxV)}


def staleness_pair(old_BxTxV, pi_BxTxV, mask_BxT, prefix="attr/drift_") -> dict:
    """The drift's staleness part as a pair, token mean of ‖π_old − π_θ‖₁ (log-probs in)."""
    return {f"{prefix}staleness_l1": dg.masked_mean_pair(l1(old_BxTxV, pi_BxTxV), mask_BxT)}

"""Token log-probs, entropy and IS quantities from hidden states, via the fused op.

Letters: B batch, T tokens, D model, V vocab.

Targets are already aligned: targets_BxT[b, t] is the token that hidden_BxTxD[b, t]
predicts (the caller shifts). Temperature τ divides the logits; it is applied to the
hidden states (z/τ = (h/τ) W) before the op, so the gradient flows through the same
custom VJP. The op is row-wise over tokens, so a row's log-probs do not depend on what
else is in the batch (bitwise on CPU: nothing reduces across rows).

impl: "naive" (full float32 logits, the reference), "chunked" (lax.scan over vocab
chunks, the default), "pallas" (Pallas kernels). `interpret` (pallas only): None runs
the Pallas interpreter on a CPU backend and compiled kernels elsewhere.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.fused_logprob import BlockSizes, fused_logprob


def token_logprobs(hidden_BxTxD, unembed_DxV, targets_BxT, *, impl: str = "chunked",
                   block: BlockSizes | None = None, temperature: float = 1.0,
                   interpret: bool | None = None):
    """(logp_BxT, entropy_BxT), float32, under p = softmax(hidden · unembed / temperature):
    logp = log p(target), entropy = −Σ_v p_v log p_v over the full vocabulary."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if hidden_BxTxD.ndim != 3 or targets_BxT.shape != hidden_BxTxD.shape[:2]:
        raise ValueError(f"token_logprobs: need hidden [B, T, D] and targets [B, T]; got "
                         f"{hidden_BxTxD.shape=}, {targets_BxT.shape=}")
    b, t, d = hidden_BxTxD.shape
    h = hidden_BxTxD.reshape(b * t, d)
    if temperature != 1.0:
        # Scale in float32 (or wider), then back to the compute dtype the op streams in.
        acc = jnp.promote_types(h.dtype, jnp.float32)
        h = (h.astype(acc) / temperature).astype(hidden_BxTxD.dtype)
    logp, ent = fused_logprob(h, unembed_DxV.astype(hidden_BxTxD.dtype),
                              targets_BxT.reshape(-1), block=block, impl=impl,
                              interpret=interpret)
    return logp.reshape(b, t), ent.reshape(b, t)


def is_quantities(hidden_BxTxD, unembed_DxV, targets_BxT, old_logp_BxT, rollout_logp_BxT,
                  mask_BxT, *, cap: float = 5.0, max_log_ratio: float = 20.0,
                  impl: str = "chunked", block: BlockSizes | None = None,
                  temperature: float = 1.0, interpret: bool | None = None) -> dict:
    """Log-probs plus the importance-sampling quantities the losses need, in one trace
    (call it under the caller's jit and it is one computation):

        log_ratio_mu  = (log π − log μ) · mask        (μ: the rollout engine's policy)
        log_ratio_old = (log π − log π_old) · mask
        tis_weight    = sg[min(exp(clip(log_ratio_mu, ±max_log_ratio)), cap)] · mask

    The clip keeps exp finite for tokens the engines disagree on wildly; the log-ratios
    themselves are not clipped, so their gradients are exact.
    """
    if not cap > 0 or not max_log_ratio > 0:
        raise ValueError(f"{cap=} and {max_log_ratio=} must be > 0")
    logp, entropy = token_logprobs(hidden_BxTxD, unembed_DxV, targets_BxT, impl=impl,
                                   block=block, temperature=temperature, interpret=interpret)
    m = mask_BxT.astype(jnp.float32)
    # where, not a product: a non-finite stored log-prob off the mask must not leak NaN.
    on = mask_BxT.astype(bool)
    log_mu = jnp.where(on, logp - rollout_logp_BxT, 0.0)
    log_old = jnp.where(on, logp - old_logp_BxT, 0.0)
    weight = jnp.minimum(jnp.exp(jnp.clip(log_mu, -max_log_ratio, max_log_ratio)), cap)
    return {
        "logp_BxT": logp,
        "entropy_BxT": entropy,
        "log_ratio_mu_BxT": log_mu,
        "log_ratio_old_BxT": log_old,
        "tis_weight_BxT": jax.lax.stop_gradient(weight) * m,
        "mask_BxT": m,
    }

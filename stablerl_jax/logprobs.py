"""Token log-probs, entropy and IS quantities from hidden states, via the fused op.

Letters: B batch, T tokens, D model, V vocab.

Targets are already aligned: targets_BxT[b, t] is the token that hidden_BxTxD[b, t]
predicts. Temperature τ scales logits by 1/τ; it is applied to the hidden states
(z/τ = (h/τ) W), so gradients flow through the same op. Every row is computed
independently of the others (the op is row-wise over tokens), so a row's log-probs do not
depend on what else is in the batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.fused_logprob import BlockSizes, fused_logprob


def token_logprobs(hidden_BxTxD, unembed_DxV, targets_BxT, *, impl: str = "chunked",
                   block: BlockSizes | None = None, temperature: float = 1.0):
    """(logp_BxT, entropy_BxT) in float32 under softmax(hidden · unembed / temperature)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    b, t, d = hidden_BxTxD.shape
    h = hidden_BxTxD.reshape(b * t, d)
    if temperature != 1.0:
        h = (h.astype(jnp.float32) / temperature).astype(hidden_BxTxD.dtype)
    logp, ent = fused_logprob(h, unembed_DxV.astype(hidden_BxTxD.dtype),
                              targets_BxT.reshape(-1), block=block, impl=impl)
    return logp.reshape(b, t), ent.reshape(b, t)


def is_quantities(hidden_BxTxD, unembed_DxV, targets_BxT, old_logp_BxT, rollout_logp_BxT,
                  mask_BxT, *, cap: float = 5.0, max_log_ratio: float = 20.0,
                  impl: str = "chunked", block: BlockSizes | None = None,
                  temperature: float = 1.0) -> dict:
    """Log-probs plus the IS quantities the losses need, in one computation.

    log_ratio_mu = log π − log μ_old and log_ratio_old = log π − log π_old (0 off-mask,
    clipped to ±max_log_ratio); tis_weight = sg[min(exp(log_ratio_mu), cap)].
    """
    logp, entropy = token_logprobs(hidden_BxTxD, unembed_DxV, targets_BxT, impl=impl,
                                   block=block, temperature=temperature)
    m = mask_BxT.astype(jnp.float32)
    clip = lambda x: jnp.clip(x, -max_log_ratio, max_log_ratio) * m
    log_mu = clip(logp - rollout_logp_BxT)
    return {
        "logp_BxT": logp,
        "entropy_BxT": entropy,
        "log_ratio_mu_BxT": log_mu,
        "log_ratio_old_BxT": clip(logp - old_logp_BxT),
        "tis_weight_BxT": jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_mu), cap)) * m,
        "mask_BxT": m,
    }

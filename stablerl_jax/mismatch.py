"""Training–inference mismatch of a rollout: how far μ (sampler) is from π (trainer).

Letters: B rows, S slots, T = S − 1 training positions, L layers, K top-k.

The training path re-scores the sampled sequences with a full-sequence forward ("train"
numerics, live routing) at the sampling temperature, and is compared token by token with
logp_mu on completion tokens (y ~ μ):

    k1 = E_μ[log μ − log π],  k3 = E_μ[π/μ − 1 − log(π/μ)],  |Δ| = |log μ − log π|

and routing: per-layer mismatch rate 1 − |topk_μ ∩ topk_π|/K and the fraction of tokens
with at least one flipped layer, over every position the sampler processed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stablerl_jax import diagnostics as dg
from stablerl_jax.config import ModelConfig
from stablerl_jax.rl import steps


def measure_mismatch(params, rollout, cfg: ModelConfig, *, temperature: float = 1.0,
                     impl: str = "chunked") -> dict:
    """Mismatch statistics (floats, and a per-layer array) of one rollout batch."""
    batch = steps.train_batch(rollout, jnp.zeros(rollout.lengths_B.shape))
    logp_pi, _, aux = jax.jit(steps.policy_logprobs, static_argnames=("cfg", "temperature",
                                                                       "impl"))(
        params, batch, cfg=cfg, temperature=temperature, impl=impl)
    mask = batch["mask_BxT"]
    logp_mu = batch["rollout_logp_BxT"]
    n = jnp.maximum(jnp.sum(mask), 1.0)
    gap = jnp.abs(logp_mu - logp_pi) * mask
    k1_num, k1_den = dg.kl_k1(logp_mu, logp_pi, mask)
    k3_num, k3_den = dg.kl_k3(logp_mu, logp_pi, mask)
    routing = dg.routing_mismatch(aux["routes"], batch["routes_mu_LxBxTxK"], batch["attn_BxT"])
    return {
        "kl_k1": float(k1_num / jnp.maximum(k1_den, 1.0)),
        "kl_k3": float(k3_num / jnp.maximum(k3_den, 1.0)),
        "abs_logp_gap_mean": float(jnp.sum(gap) / n),
        "abs_logp_gap_max": float(jnp.max(gap)),
        "routing_mismatch_per_layer": jnp.asarray(routing["mismatch_rate"]),
        "routing_mismatch": float(jnp.mean(routing["mismatch_rate"])),
        "routing_any_flip": float(routing["any_flip"]),
    }

"""Training–inference mismatch of a rollout: how far μ (sampler) is from π (trainer).
Letters: B rows, S rollout slots, T = S − 1 scored positions, L layers.

`logprobs.policy_logprobs` re-scores the samples (training numerics, "train" by default;
live routing, no replay; the sampling temperature); `diagnostics.train_infer_mismatch`, the
score step's monitor, compares that with the sampler's `logp_mu` on completion tokens y ~ μ
(π = π_old of docs/method.md §2, Eq. 5's training–inference factor):
    k1   = E_μ[log μ − log π]                  (can be negative on a finite batch)
    k3   = E_μ[ρ − 1 − log ρ],  ρ = π/μ         (every term ≥ 0)
    |Δ|  = |log μ − log π|, mean and max over completion tokens
and, over tokens both engines processed, the per-layer routing mismatch 1 − |topk_μ ∩
topk_π|/K and the fraction of tokens with a flipped layer. Under top-k / top-p truncation
logp_mu is of the truncated distribution, π the full softmax: the numbers then include the
truncation gap (see rollout.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax.config import ModelConfig
from stablerl_jax.method import diagnostics as dg
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import numerics as nx


@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "train_numerics", "impl"))
def mismatch_pairs(params, rollout, cfg: ModelConfig, *, temperature: float = 1.0,
                   train_numerics: nx.Numerics = nx.TRAIN, impl: str = "chunked") -> dict:
    """(num, den) pairs of `measure_mismatch`, for exact sums (`diagnostics.reduce_metrics`)."""
    attn_BxS = rollout.prompt_mask_BxS | rollout.completion_mask_BxS
    logp_pi_BxT, _, aux = policy_logprobs(params, rollout.tokens_BxS, attn_BxS, cfg,
                                          numerics=train_numerics, temperature=temperature,
                                          impl=impl)
    pairs = dg.train_infer_mismatch(
        rollout.logp_mu_BxS[:, 1:], logp_pi_BxT, rollout.completion_mask_BxS[:, 1:],
        rollout.routes_mu_BxSxLxK[:, :-1], aux["routes"], attn_BxS[:, :-1], per_layer=True)
    pairs["completion_tokens"] = (jnp.sum(rollout.completion_mask_BxS[:, 1:]), jnp.ones(()))
    pairs["routed_tokens"] = (pairs["routing/any_flip"][1], jnp.ones(()))
    return pairs


def measure_mismatch(params, rollout, cfg: ModelConfig, *,
                     train_numerics: nx.Numerics = nx.TRAIN, temperature: float = 1.0,
                     impl: str = "chunked") -> dict:
    """One rollout batch's mismatch as floats (rates 0 when nothing counts; routing_mismatch
    over every (token, layer), routing_mismatch_per_layer a numpy [L]). rollout: a
    `rollout.Rollout` from the sampling engine; train_numerics: the reference π's;
    temperature: the rollout's SamplingConfig.temperature (logp_mu includes it)."""
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0 (the sampling temperature), got "
                         f"{temperature}")
    r = dg.reduce_metrics([mismatch_pairs(params, rollout, cfg, temperature=float(temperature),
                                          train_numerics=train_numerics, impl=impl)])
    zero_if_nan = lambda x: np.nan_to_num(np.asarray(x, np.float64), nan=0.0)
    return {
        "kl_k1": float(zero_if_nan(r["kl/train_infer_k1"])),
        "kl_k3": float(zero_if_nan(r["kl/train_infer_k3"])),
        "abs_logp_gap_mean": float(zero_if_nan(r["mismatch/abs_logp_gap"])),
        "abs_logp_gap_max": float(zero_if_nan(r["mismatch/abs_logp_gap_max"])),
        "routing_mismatch": float(zero_if_nan(r["routing/mismatch_rate"])),
        "routing_any_flip": float(zero_if_nan(r["routing/any_flip"])),
        "routing_mismatch_per_layer": zero_if_nan(r["routing/mismatch_rate_per_layer"]),
        "completion_tokens": r["completion_tokens"],
        "routed_tokens": r["routed_tokens"],
    }

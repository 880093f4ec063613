"""Training–inference mismatch of a rollout: how far μ (sampler) is from π (trainer).

Letters: B rows, S rollout slots, T = S − 1 scored positions, L layers.

The training path re-scores the sampled sequences with `logprobs.policy_logprobs` (its own
numerics, "train" by default, live routing: no replay) at the sampling temperature, and
is compared with the sampler's `logp_mu` on the completion tokens y ~ μ (π = π_old of
docs/method.md §2, the training–inference factor of Eq. 5), by
`diagnostics.train_infer_mismatch`, the same monitor the trainer's score step logs:

    k1   = E_μ[log μ − log π]                  (can be negative on a finite batch)
    k3   = E_μ[ρ − 1 − log ρ],  ρ = π/μ         (every term ≥ 0)
    |Δ|  = |log μ − log π|, mean and max over completion tokens

and routing, over the tokens both engines processed: the per-layer mismatch rate
1 − |topk_μ ∩ topk_π|/K and the fraction of tokens with at least one flipped layer.

With top-k / top-p truncation on, logp_mu is of the truncated distribution while π is the
full softmax, so these numbers then also contain the truncation gap (see rollout.py).
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
    """The (num, den) pairs of `measure_mismatch`, for exact accumulation over batches
    (`diagnostics.reduce_metrics`)."""
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
    """Mismatch of one rollout batch as plain numbers (see the module docstring).

    Args:
      rollout: a `rollout.Rollout` from the sampling engine.
      train_numerics: numerics of the training path (the reference π).
      temperature: must equal the SamplingConfig.temperature the rollout was drawn at,
        since logp_mu includes it.

    Returns floats kl_k1, kl_k3, abs_logp_gap_mean, abs_logp_gap_max, routing_mismatch
    (over every (token, layer)), routing_any_flip, completion_tokens, routed_tokens, and
    routing_mismatch_per_layer as a float numpy array [L]. Rates are 0 when nothing counts.
    """
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

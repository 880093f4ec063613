"""Training–inference mismatch of a rollout: how far μ (sampler) is from π (trainer).

Letters: B rows, S rollout slots, T = S − 1 scored positions, V vocab, L layers, K top-k.

The training path re-scores the sampled sequences with one full-sequence forward (its own
numerics, "train" by default, live routing: no replay) at the sampling temperature, and
is compared with the sampler's `logp_mu` on the completion tokens y ~ μ (π = π_old of
PAPER.md §1, the training–inference factor of Eq. 5):

    k1   = E_μ[log μ − log π]                  (can be negative on a finite batch)
    k3   = E_μ[ρ − 1 − log ρ],  ρ = π/μ         (every term ≥ 0)
    |Δ|  = |log μ − log π|, mean and max over completion tokens

and routing, over every slot where the sampler recorded routes (routes_mu ≥ 0): the
per-layer mismatch rate 1 − |topk_μ ∩ topk_π|/K and the fraction of those tokens with at
least one flipped layer (estimators from `stablerl_jax.diagnostics`).

Frames: hidden at slot s predicts tokens[s + 1], so π's log-prob of tokens[s + 1] comes
from hidden[s] and is compared with logp_mu[s + 1]; routes at slot s are compared with
routes_mu[s] directly (both computed while processing tokens[s]).

With top-k / top-p truncation on, logp_mu is of the truncated distribution while π is the
full softmax, so these numbers then also contain the truncation gap (see rollout.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax import diagnostics as dg
from stablerl_jax.config import ModelConfig
from stablerl_jax.logprobs import token_logprobs
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf


def training_view(params, rollout, cfg: ModelConfig, *, temperature: float = 1.0,
                  train_numerics: nx.Numerics = nx.TRAIN, impl: str = "chunked"):
    """The training path on a rollout: (logp_pi_BxT of tokens[:, 1:], routes_pi_LxBxSxK).

    One full-sequence forward over tokens_BxS with attention mask prompt | completion,
    routing live. Routes at slots outside that mask are -1.
    """
    real_BxS = rollout.prompt_mask_BxS | rollout.completion_mask_BxS
    weights = nx.prepare_params(params, train_numerics)
    hidden, aux = tf.forward(weights, rollout.tokens_BxS, cfg, attention_mask_BxT=real_BxS,
                             numerics=train_numerics)
    logp_pi_BxT, _ = token_logprobs(hidden[:, :-1], tf.unembed_matrix(weights, cfg),
                                    rollout.tokens_BxS[:, 1:], impl=impl,
                                    temperature=temperature)
    routes_pi = jnp.where(real_BxS[None, :, :, None], aux["routes"], -1)
    return logp_pi_BxT, routes_pi


@functools.partial(jax.jit, static_argnames=("cfg", "temperature", "train_numerics", "impl"))
def mismatch_stats(params, rollout, cfg: ModelConfig, *, temperature: float = 1.0,
                   train_numerics: nx.Numerics = nx.TRAIN, impl: str = "chunked") -> dict:
    """Jitted core of `measure_mismatch`: the same statistics as arrays, plus the
    (numerator, denominator) pairs under `pairs` for exact accumulation over batches."""
    logp_pi, routes_pi = training_view(params, rollout, cfg, temperature=temperature,
                                       train_numerics=train_numerics, impl=impl)
    mask = rollout.completion_mask_BxS[:, 1:].astype(jnp.float32)
    logp_mu = rollout.logp_mu_BxS[:, 1:]
    n = jnp.sum(mask)
    gap = jnp.where(mask > 0, jnp.abs(logp_mu - logp_pi), 0.0)
    k1 = dg.kl_k1(logp_mu, logp_pi, mask)
    k3 = dg.kl_k3(logp_mu, logp_pi, mask)
    recorded_BxS = jnp.all(rollout.routes_mu_LxBxSxK >= 0, axis=(0, 3))
    routing = dg.routing_mismatch(rollout.routes_mu_LxBxSxK, routes_pi, recorded_BxS)
    return {
        "kl_k1": k1[0] / jnp.maximum(k1[1], 1.0),
        "kl_k3": k3[0] / jnp.maximum(k3[1], 1.0),
        "abs_logp_gap_mean": jnp.sum(gap) / jnp.maximum(n, 1.0),
        "abs_logp_gap_max": jnp.max(gap),
        "routing_mismatch_per_layer": routing["mismatch_rate"],
        "routing_mismatch": jnp.mean(routing["mismatch_rate"]),
        "routing_any_flip": routing["any_flip"],
        "completion_tokens": n,
        "routed_tokens": routing["any_flip_pair"][1],
        "pairs": {"kl_k1": k1, "kl_k3": k3, "abs_logp_gap": (jnp.sum(gap), n),
                  "routing_mismatch": routing["mismatch_pair"],
                  "routing_any_flip": routing["any_flip_pair"]},
    }


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
    (mean over layers), routing_any_flip, completion_tokens, routed_tokens, and
    routing_mismatch_per_layer as a float numpy array [L]. Rates are 0 when nothing counts.
    """
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0 (the sampling temperature), got "
                         f"{temperature}")
    out = mismatch_stats(params, rollout, cfg, temperature=float(temperature),
                         train_numerics=train_numerics, impl=impl)
    out.pop("pairs")
    per_layer = np.asarray(out.pop("routing_mismatch_per_layer"), np.float64)
    result = {k: float(v) for k, v in out.items()}
    result["routing_mismatch_per_layer"] = per_layer
    return result

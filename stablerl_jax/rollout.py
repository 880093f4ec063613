"""The sampling path (the inference engine μ): prefill + KV-cache decode, own numerics.

Letters: B rows, P prompt slots, N = max_new_tokens, S = P + N slots, V vocab, L layers,
K top-k.

It differs from the training path on purpose, in two ways: its `Numerics` (e.g. FP8
weights, bf16 activations) and its algorithm (one prefill, then one token at a time
against a KV cache, versus the trainer's single full-sequence pass).

Alignment (the trainer relies on it):
- tokens_BxS: left-padded prompt in slots [0, P), completion in [P, S), pad after EOS.
- logp_mu_BxS[b, s]: log μ of tokens[b, s] (s ≥ P), under exactly the distribution it was
  drawn from: logits / temperature, then top-k / top-p truncation if on. 0 elsewhere.
- routes_mu_LxBxSxK[:, b, s]: the experts the engine used when it *processed* tokens[b, s]
  (prompt slots in the prefill, each fed-back token in its decode step). -1 where it
  processed nothing: padding, slots after EOS, the EOS token itself and the last sampled
  token (neither is fed back). Rows are all -1 or all recorded, so it is a valid replay
  tensor for the training forward over the same slots.
- completion_mask_BxS: 1 on sampled tokens up to and including EOS.

Truncation and IS weights: with top-k / top-p on, logp_mu is the log-prob under the
*truncated* distribution, while the trainer scores the full softmax. Tokens outside the
truncated support are never sampled, so E_μ[π/μ] = π(support) < 1 and the token ratio
π/μ is biased low on every token (π/μ = π(support) · π_full/μ_full on average). Leave
truncation off for RL unless that bias is what is being studied.

Randomness: row b draws from its own key (given as [B] keys, or split from one key), and
its draws depend only on that key and the step, so a row's sample does not depend on the
other rows in the batch.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax.config import ModelConfig, check, check_positive_int
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature > 0; top_k = 0 and top_p = 1.0 mean no truncation."""

    max_new_tokens: int = 48
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_id: int = 2
    pad_id: int = 0

    def __post_init__(self):
        check_positive_int(self, "max_new_tokens")
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
              f"must be an int >= 0 (0 = off), got {self.top_k!r}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1] (1 = off), got {self.top_p}")


class Rollout(NamedTuple):
    tokens_BxS: jax.Array
    prompt_mask_BxS: jax.Array
    completion_mask_BxS: jax.Array
    lengths_B: jax.Array
    logp_mu_BxS: jax.Array
    routes_mu_LxBxSxK: jax.Array


def sampling_logprobs(logits_BxV, sampling: SamplingConfig):
    """log of the distribution actually sampled: temperature, then top-k / top-p."""
    z = logits_BxV.astype(jnp.float32) / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(z, sampling.top_k)[0][:, -1:]
        z = jnp.where(z >= kth, z, -jnp.inf)
    if sampling.top_p < 1.0:
        srt = jnp.sort(z, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        cutoff = jnp.min(jnp.where(before < sampling.top_p, srt, jnp.inf), axis=-1,
                         keepdims=True)
        z = jnp.where(z >= cutoff, z, -jnp.inf)
    return jax.nn.log_softmax(z, axis=-1)


def _validate(prompts, mask, key, cfg, sampling):
    if prompts.ndim != 2 or mask.shape != prompts.shape:
        raise ValueError(f"prompts: tokens {prompts.shape} and mask {mask.shape} must both "
                         "be [B, P]")
    need = prompts.shape[1] + sampling.max_new_tokens
    if need > cfg.max_seq_len:
        raise ValueError(f"prompt length {prompts.shape[1]} + max_new_tokens "
                         f"{sampling.max_new_tokens} = {need} exceeds the cache "
                         f"(ModelConfig.max_seq_len={cfg.max_seq_len}); shorten the prompt, "
                         "lower max_new_tokens or raise max_seq_len")
    if not isinstance(mask, jax.core.Tracer) and not np.asarray(mask).any(axis=1).all():
        raise ValueError("prompts: every row needs at least one real (mask=1) token")
    if not isinstance(mask, jax.core.Tracer) and not np.asarray(mask)[:, -1].all():
        raise ValueError("prompts: must be left-padded (last slot of every row real)")
    if jnp.ndim(key) not in (0, 1) or (jnp.ndim(key) == 1 and key.shape[0] != prompts.shape[0]):
        raise ValueError(f"key: one key or one per row ([B]={prompts.shape[0]}), got shape "
                         f"{jnp.shape(key)}")


def sample(params, prompt_tokens_BxP, prompt_mask_BxP, key, cfg: ModelConfig,
           sampling: SamplingConfig, numerics: nx.Numerics) -> Rollout:
    """Sample completions with the inference engine. Jitted; see the module docstring."""
    _validate(prompt_tokens_BxP, prompt_mask_BxP, key, cfg, sampling)
    return _sample(params, prompt_tokens_BxP, prompt_mask_BxP.astype(bool), key, cfg,
                   sampling, numerics)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "numerics"))
def _sample(params, prompts, pmask, key, cfg, sampling, numerics):
    b, p = prompts.shape
    n, s = sampling.max_new_tokens, p + sampling.max_new_tokens
    row_keys = jax.random.split(key, b) if jnp.ndim(key) == 0 else key
    params = nx.prepare_params(params, numerics)
    dtype = nx.compute_dtype(numerics, cfg.compute_dtype)
    cache = tf.init_cache(cfg, b, s, dtype)
    hidden, aux = tf.forward(params, prompts, cfg, attention_mask_BxT=pmask, numerics=numerics,
                             cache=cache)
    routes = jnp.full((cfg.num_layers, b, s, cfg.top_k), -1, jnp.int32)
    routes = routes.at[:, :, :p].set(jnp.where(pmask[None, :, :, None], aux["routes"], -1))
    state = {
        "i": jnp.zeros((), jnp.int32),
        "cache": aux["cache"],
        "logits": tf.logits(params, hidden[:, -1:], cfg)[:, 0],
        "tokens": jnp.full((b, s), sampling.pad_id, jnp.int32).at[:, :p].set(prompts),
        "logp": jnp.zeros((b, s), jnp.float32),
        "completion": jnp.zeros((b, s), bool),
        "routes": routes,
        "done": jnp.zeros((b,), bool),
    }

    def draw(row_key, i, logp_V):
        return jax.random.categorical(jax.random.fold_in(row_key, i), logp_V)

    def body(st):
        i = st["i"]
        logp_all = sampling_logprobs(st["logits"], sampling)
        tok = jax.vmap(draw, in_axes=(0, None, 0))(row_keys, i, logp_all)
        live = ~st["done"]
        tok = jnp.where(live, tok, sampling.pad_id).astype(jnp.int32)
        lp = jnp.take_along_axis(logp_all, tok[:, None], axis=1)[:, 0]
        slot = p + i
        st = dict(st, i=i + 1,
                  tokens=st["tokens"].at[:, slot].set(tok),
                  logp=st["logp"].at[:, slot].set(jnp.where(live, lp, 0.0)),
                  completion=st["completion"].at[:, slot].set(live))
        done = st["done"] | (tok == sampling.eos_id)
        # Feed the token back unless it is EOS, padding or the last one (never needed).
        fed = live & (tok != sampling.eos_id)
        h, a = tf.forward(params, tok[:, None], cfg, attention_mask_BxT=fed[:, None],
                          numerics=numerics, cache=st["cache"])
        step_routes = jnp.where(fed[None, :, None], a["routes"][:, :, 0], -1)
        last = i + 1 == n
        step_routes = jnp.where(last, -1, step_routes)
        return dict(st, cache=a["cache"], logits=tf.logits(params, h, cfg)[:, 0], done=done,
                    routes=st["routes"].at[:, :, slot].set(step_routes))

    st = jax.lax.while_loop(lambda st: (st["i"] < n) & ~jnp.all(st["done"]), body, state)
    completion = st["completion"]
    return Rollout(tokens_BxS=st["tokens"],
                   prompt_mask_BxS=jnp.zeros((b, s), bool).at[:, :p].set(pmask),
                   completion_mask_BxS=completion,
                   lengths_B=jnp.sum(completion, axis=1, dtype=jnp.int32),
                   logp_mu_BxS=st["logp"],
                   routes_mu_LxBxSxK=st["routes"])

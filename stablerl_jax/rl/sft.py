"""Supervised cold start: cross-entropy on the task's worked solutions.

Letters: B sequences, T positions.

    loss = − Σ_{b,t} m_bt · log π(y_{b,t+1} | y_{b,≤t}) / Σ m_bt

with m = 1 on solution tokens (the prompt is context only). The same model, forward and
fused log-prob op as RL are used, so the cold-start policy is exactly the policy RL
starts from. Its parameters are saved to `<workdir>/sft` and reused when present.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import optax
from tqdm import tqdm

from stablerl_jax.checkpoint import load_params, save_params
from stablerl_jax.logprobs import token_logprobs
from stablerl_jax.model import transformer as tf


def sft_loss(params, batch: dict, cfg, impl: str = "chunked"):
    """Mean token cross-entropy over solution tokens; also returns token accuracy."""
    hidden, aux = tf.forward(params, batch["tokens_BxT"][:, :-1], cfg,
                             attention_mask_BxT=batch["attn_BxT"][:, :-1])
    logp, _ = token_logprobs(hidden, tf.unembed_matrix(params, cfg), batch["tokens_BxT"][:, 1:],
                             impl=impl)
    m = batch["loss_mask_BxT"][:, 1:].astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    return -jnp.sum(logp * m) / n + aux["router_loss"]


def make_optimizer(sft_cfg) -> optax.GradientTransformation:
    warmup = max(int(sft_cfg.warmup_frac * sft_cfg.steps), 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, sft_cfg.learning_rate, warmup,
                                                  max(sft_cfg.steps, warmup + 1),
                                                  end_value=sft_cfg.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def train_sft(cfg, data, *, progress: bool = True):
    """SFT from a fresh init for cfg.sft.steps; returns (params, list of losses)."""
    params = tf.init_params(jax.random.key(cfg.sft.seed), cfg.model)
    opt = make_optimizer(cfg.sft)
    opt_state = opt.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(sft_loss)(params, batch, cfg.model)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    batches = data.sft_batches(cfg.sft.batch_size, cfg.sft.seed)
    bar = tqdm(range(cfg.sft.steps), disable=not progress, desc="sft")
    for _ in bar:
        params, opt_state, loss = step(params, opt_state, next(batches))
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return params, losses


def cold_start(cfg, data, workdir: str, *, progress: bool = True):
    """Load `<workdir>/sft` if it exists, else run SFT and save it there."""
    path = os.path.join(os.path.abspath(workdir), "sft")
    if os.path.isdir(path):
        like = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), cfg.model))
        return load_params(path, like), None
    params, losses = train_sft(cfg, data, progress=progress)
    save_params(path, params)
    return params, losses

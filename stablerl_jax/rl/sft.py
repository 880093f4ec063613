"""Supervised cold start: cross-entropy on the task's worked solutions (`steps.sft_loss`).

It runs through the same Engine as RL (sharded over the mesh, state donated, non-finite
updates skipped), with the optimizer of `cfg.sft.optim`, and the same model, forward and
fused log-prob op, so the cold-start policy is exactly the policy RL starts from. Its
parameters are saved to `<workdir>/sft` and reused when present.
"""
from __future__ import annotations

import os

import jax
from tqdm import tqdm

from stablerl_jax.checkpoint import load_params, save_params
from stablerl_jax.diagnostics import reduce_metrics
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl.engine import Engine


def sft_engine(cfg, data, devices=None) -> Engine:
    return Engine.create(cfg, eos_id=data.tokenizer.eos_id, pad_id=data.tokenizer.pad_id,
                         optim=cfg.sft.optim, total_steps=cfg.sft.steps, devices=devices)


def train_sft(cfg, data, *, progress: bool = True, devices=None):
    """SFT from a fresh init for cfg.sft.steps; returns (params, list of losses)."""
    engine = sft_engine(cfg, data, devices)
    state = engine.init_state(tf.init_params(jax.random.key(cfg.sft.seed), cfg.model))
    losses = []
    batches = data.sft_batches(cfg.sft.batch_size, cfg.sft.seed)
    bar = tqdm(range(cfg.sft.steps), disable=not progress, desc="sft")
    for _ in bar:
        state, metrics = engine.sft_update(state, next(batches))
        losses.append(reduce_metrics([metrics])["sft/loss"])
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return state.params, losses


def cold_start(cfg, data, workdir: str, *, progress: bool = True, devices=None):
    """Load `<workdir>/sft` if it exists, else run SFT and save it there."""
    path = os.path.join(os.path.abspath(workdir), "sft")
    if os.path.isdir(path):
        like = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), cfg.model))
        return load_params(path, like), None
    params, losses = train_sft(cfg, data, progress=progress, devices=devices)
    save_params(path, params)
    return params, losses

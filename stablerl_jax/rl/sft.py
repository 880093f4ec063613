"""Supervised cold start: cross-entropy on the task's worked solutions (`steps.sft_loss`).

It runs through the same Engine as RL (sharded over the mesh, state donated, non-finite
updates skipped), with the optimizer of `cfg.sft.optim`, and the same model, forward and
fused log-prob op, so the cold-start policy is exactly the policy RL starts from. Its
parameters are saved to `<workdir>/sft` and reused when present.
"""
from __future__ import annotations

import json
import logging
import os

import jax
from tqdm import tqdm

from stablerl_jax import distributed
from stablerl_jax.checkpoint import is_complete, load_params, save_params, set_aside
from stablerl_jax.config import flat_dict
from stablerl_jax.diagnostics import reduce_metrics
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl.engine import Engine
from stablerl_jax.rl.steps import count_skips, skipped


def sft_engine(cfg, data, devices=None) -> Engine:
    return Engine.create(cfg, eos_id=data.tokenizer.eos_id, pad_id=data.tokenizer.pad_id,
                         optim=cfg.sft.optim, total_steps=cfg.sft.steps, devices=devices)


def train_sft(cfg, data, *, progress: bool = True, devices=None):
    """SFT from a fresh init for cfg.sft.steps; returns (params, list of losses)."""
    engine = sft_engine(cfg, data, devices)
    state = engine.init_state(tf.init_params(jax.random.key(cfg.sft.seed), cfg.model))
    losses = []
    batches = data.sft_batches(cfg.sft.batch_size, cfg.sft.seed)
    bar = tqdm(range(cfg.sft.steps), disable=not (progress and distributed.is_main()),
               desc="sft")
    skips = 0
    for _ in bar:
        state, metrics = engine.sft_update(state, next(batches))
        metrics = jax.tree.map(distributed.host, metrics)
        skips = count_skips(skips, [skipped(metrics)], cfg.sft.max_consecutive_skips, "sft")
        losses.append(reduce_metrics([metrics])["sft/loss"])
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return state.params, losses


# The settings that determine the cold-start parameters (compared when they are reused),
# less those that change how a step computes or how long a run may misbehave, not what
# it learns (remat, expert paths, micro-batching, the skip limit).
_SFT_SECTIONS = ("model.", "task.", "sft.")
_SFT_RUN_FIELDS = ("model.remat", "model.dispatch", "model.moe_tile", "model.gmm_impl",
                   "model.expert_parallel", "model.attention_impl", "model.attention_chunk",
                   "model.unroll_layers", "model.kv_cache_layout", "model.decode_block",
                   "sft.microbatches",
                   "sft.max_consecutive_skips")


def sft_settings(cfg) -> dict:
    """The flat settings a cold start is stored with and compared on (`<workdir>/sft.json`)."""
    return {k: v for k, v in flat_dict(cfg).items()
            if k.startswith(_SFT_SECTIONS) and k not in _SFT_RUN_FIELDS}


def cold_start(cfg, data, workdir: str, *, progress: bool = True, devices=None):
    """Load `<workdir>/sft` if it is complete, else run SFT and save it there.

    The config it was trained with is kept beside it (`<workdir>/sft.json`); reusing it
    with other model / task / SFT settings is refused. A directory without its commit
    marker (a save that was killed) is moved aside and trained again. In a multi-process
    run every process calls this (the workdir is on a filesystem they share)."""
    path = os.path.join(os.path.abspath(workdir), "sft")
    config_path = path + ".json"
    wanted = sft_settings(cfg)
    if distributed.is_main() and os.path.isdir(path) and not is_complete(path):
        logging.warning("%s was not completely written; moved to %s and training again",
                        path, set_aside(path, ".incomplete"))
    distributed.barrier("sft directory")
    if os.path.isdir(path):
        if os.path.exists(config_path):
            with open(config_path) as f:
                try:
                    saved = json.load(f)
                except ValueError as e:
                    raise ValueError(
                        f"{config_path}: not valid JSON ({e}); delete it and {path} to "
                        "train the cold start again, or use another workdir") from None
            changed = sorted(k for k in set(saved) | set(wanted)
                             if k not in _SFT_RUN_FIELDS and saved.get(k) != wanted.get(k))
            if changed:
                raise ValueError(
                    f"{path} was trained with other settings ({', '.join(changed[:8])}); "
                    f"delete {path} and {config_path} to train it again, or use another "
                    "workdir")
        # Each process reads the whole of every array (the Engine shards them afterwards).
        here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here),
                            jax.eval_shape(lambda: tf.init_params(jax.random.key(0), cfg.model)))
        return load_params(path, like), None
    params, losses = train_sft(cfg, data, progress=progress, devices=devices)
    # The settings first: a kill between the two leaves an incomplete sft/ (set aside and
    # trained again), never a complete one without its settings.
    if distributed.is_main():
        tmp = config_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(wanted, f, indent=1)
        os.replace(tmp, config_path)
    save_params(path, params)
    distributed.barrier("sft saved")
    return params, losses

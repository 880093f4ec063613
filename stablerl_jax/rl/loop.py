"""The global-step loop (ARCHITECTURE "One global step"), with eval, checkpoints and logs.

Letters: B prompts per step, G responses per prompt, N mini-batches, M = B·G/N responses
per mini-batch.

    for step:  prompts ─sample(θ_old, inference numerics)─▶ rollout (tokens, logp_mu, routes_mu)
               rewards, group advantages
               score(θ_old) ─▶ logp_old, entropy, routes_old
               N seeded mini-batches: update(θ) each
               every eval_every steps: avg@k on the held-out split with the sampling path

Everything random is derived from (seed, step), so a run resumed from its last complete
checkpoint reproduces the uninterrupted run bit for bit on CPU.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from stablerl_jax import advantages as adv_lib
from stablerl_jax import diagnostics
from stablerl_jax import losses as losses_lib
from stablerl_jax.checkpoint import Checkpointer
from stablerl_jax.metrics_io import (MetricsWriter, append_jsonl, plot_metrics, read_metrics,
                                     truncate_jsonl)
from stablerl_jax.rl import steps
from stablerl_jax.rl.engine import Engine
from stablerl_jax.rl.task import TaskData


def _take(batch: dict, idx: np.ndarray) -> dict:
    """Rows `idx` of every batch tensor (axis 1 of [L, B, ...] route tensors)."""
    return {k: jnp.take(v, idx, axis=1 if k.startswith("routes") else 0) for k, v in batch.items()}


def minibatch_order(seed: int, step: int, responses: int) -> np.ndarray:
    """The seeded permutation that splits a step's responses into mini-batches."""
    return np.random.default_rng([seed, step, 1]).permutation(responses)


def rollout_metrics(batch: dict, scored: dict, rewards_B: np.ndarray, lengths_B) -> dict:
    """Monitors of PAPER.md §5 on the sampled batch: reward, entropy of π_old over the full
    vocabulary on μ-sampled prefixes, training–inference KL E_μ[log μ_old − log π_old]
    (k1, and k3), and routing mismatch between the engines (0 under R3 by construction)."""
    mask = batch["mask_BxT"]
    log_mu, log_old = batch["rollout_logp_BxT"], scored["old_logp_BxT"]
    ratio = lambda nd: float(nd[0] / jnp.maximum(nd[1], 1.0))
    mismatch = diagnostics.routing_mismatch(scored["routes_old_LxBxTxK"],
                                            batch["routes_mu_LxBxTxK"], batch["attn_BxT"])
    return {
        "reward": float(np.mean(rewards_B)),
        "response_length": float(np.mean(np.asarray(lengths_B))),
        "entropy": ratio((jnp.sum(scored["entropy_BxT"] * mask), jnp.sum(mask))),
        "kl/train_infer_k1": ratio(diagnostics.kl_k1(log_mu, log_old, mask)),
        "kl/train_infer_k3": ratio(diagnostics.kl_k3(log_mu, log_old, mask)),
        "routing/mismatch_rate": float(jnp.mean(mismatch["mismatch_rate"])),
        "routing/any_flip": float(mismatch["any_flip"]),
    }


def global_step(engine: Engine, state: steps.TrainState, data: TaskData, step: int):
    """One global step; returns (state, metrics dict of floats, mini-batch composition).

    The composition is {"prompts": train-split indices of the step's prompts,
    "minibatches": response indices per mini-batch}; response r answers prompt r // G.
    """
    cfg = engine.cfg
    rl = cfg.rl
    prompt_idx = data.train_indices(step, rl.prompts_per_step, rl.seed)
    prompts = [data.train[i] for i in prompt_idx]
    tokens, mask, answers = data.prompt_batch(prompts, rl.group_size)
    key = jax.random.fold_in(jax.random.key(rl.seed), step)
    ro = engine.sample(state.params, tokens, mask, key)
    rewards_B = data.reward(ro, answers)
    advantages_B = adv_lib.ADVANTAGES[cfg.loss.advantage](jnp.asarray(rewards_B), rl.group_size)
    batch = steps.train_batch(ro, advantages_B)
    scored = engine.score(state.params, batch)
    metrics = rollout_metrics(batch, scored, rewards_B, ro.lengths_B)
    batch.update(scored)
    responses = rl.prompts_per_step * rl.group_size
    minibatches = minibatch_order(rl.seed, step, responses).reshape(rl.num_minibatches, -1)
    totals = []
    for idx in minibatches:
        state, m = engine.update(state, _take(batch, idx))
        totals.append(m)
    metrics.update(losses_lib.reduce_metrics(totals))
    composition = {"prompts": [int(i) for i in prompt_idx], "minibatches": minibatches.tolist()}
    return state, metrics, composition


def evaluate(engine: Engine, params, data: TaskData, step: int) -> dict:
    """avg@k accuracy on the held-out split with the sampling path (inference numerics)."""
    rl = engine.cfg.rl
    key = jax.random.fold_in(jax.random.key(rl.seed + 1), step)
    res = data.evaluate(lambda t, m, k: engine.sample(params, t, m, k), key,
                        rl.eval_problems, rl.eval_k)
    return {"eval/accuracy": res["avg@k"], "eval/pass_at_k": res["pass@k"]}


def run(cfg, workdir: str, *, init_params=None, data: TaskData | None = None,
        progress: bool = True) -> dict:
    """Train (or resume) an RL run in `workdir`; returns the summary dict it also writes."""
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"workdir {workdir!r} is a file; pass a directory path")
    os.makedirs(workdir, exist_ok=True)
    data = data or TaskData.create(cfg.task, os.path.join(workdir, "data"))
    engine = Engine.create(cfg)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.rl.keep_checkpoints,
                        async_=cfg.rl.async_checkpoints)
    writer = MetricsWriter(workdir)
    minibatch_log = os.path.join(workdir, "minibatches.jsonl")
    if init_params is None:
        from stablerl_jax.model import transformer as tf
        init_params = tf.init_params(jax.random.key(cfg.rl.seed), cfg.model)
    state = engine.init_state(init_params)
    start = 0
    latest = ckpt.latest_step()
    if latest is not None:
        # Checkpoints are numbered by completed global steps, like metrics rows.
        restored, _ = ckpt.restore(latest, state._asdict())
        state = steps.TrainState(**restored)
        start = latest
        writer.truncate_after(latest)
        truncate_jsonl(minibatch_log, latest)
    else:
        writer.truncate_after(-1)  # rows of a run killed before its first checkpoint
        truncate_jsonl(minibatch_log, -1)
        writer.write(0, evaluate(engine, state.params, data, 0))
    bar = tqdm(range(start, cfg.rl.steps), initial=start, total=cfg.rl.steps,
               disable=not progress, desc=cfg.name)
    for step in bar:
        state, metrics, composition = global_step(engine, state, data, step)
        append_jsonl(minibatch_log, {"step": step + 1, **composition})
        if (step + 1) % cfg.rl.eval_every == 0 or step + 1 == cfg.rl.steps:
            metrics.update(evaluate(engine, state.params, data, step + 1))
        writer.write(step + 1, metrics)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}",
                        kl=f"{metrics['kl/train_infer_k1']:.1e}",
                        acc=f"{metrics.get('eval/accuracy', float('nan')):.3f}")
        if (step + 1) % cfg.rl.checkpoint_every == 0 or step + 1 == cfg.rl.steps:
            ckpt.save(step + 1, state._asdict(), {"step": step + 1})
    ckpt.wait()
    ckpt.close()
    writer.close()
    records = read_metrics(workdir)
    plot_metrics(records, os.path.join(workdir, "plots"))
    summary = summarize(records, int(state.skipped))
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def summarize(records: list[dict], skipped: int) -> dict:
    evals = [r for r in records if r.get("eval/accuracy") is not None]
    rewards = [r["reward"] for r in records if r.get("reward") is not None]
    w = max(1, len(rewards) // 5)
    return {
        "start_accuracy": evals[0]["eval/accuracy"] if evals else None,
        "end_accuracy": evals[-1]["eval/accuracy"] if evals else None,
        "start_reward": float(np.mean(rewards[:w])) if rewards else None,
        "end_reward": float(np.mean(rewards[-w:])) if rewards else None,
        "steps": records[-1]["step"] if records else 0,
        "skipped_updates": skipped,
    }

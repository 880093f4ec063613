"""The training engine's jitted steps: score (π_old) and update (π_θ).

Letters: B responses in the (mini-)batch, S rollout slots, T = S − 1 training positions,
D model, V vocab, L layers, K top-k.

Frames. The sampler returns tokens_BxS; the training engine runs the model on
inputs = tokens[:, :-1] and scores targets = tokens[:, 1:] (hidden at slot s predicts the
token at s+1). Every per-token tensor of a `TrainBatch` lives in that T-frame:
`rollout_logp_BxT` = logp_mu[:, 1:], `mask_BxT` = completion mask of the targets,
`routes_mu_LxBxTxK` = routes the sampler used when it processed inputs[:, t].

Replay per mode (PAPER.md §3):
- none: route live in every pass.
- r2:   score records routes_old (training engine, θ_old); every update replays them.
- r3:   score and every update replay routes_mu (inference engine).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from stablerl_jax import losses as losses_lib
from stablerl_jax.config import ModelConfig
from stablerl_jax.logprobs import token_logprobs
from stablerl_jax.model import transformer as tf

REPLAY_MODES = ("none", "r2", "r3")


class TrainState(NamedTuple):
    params: dict
    opt_state: optax.OptState
    step: jax.Array      # optimizer steps taken (int32)
    skipped: jax.Array   # updates skipped for a non-finite loss or gradient (int32)


def train_batch(rollout, advantages_B: jax.Array) -> dict:
    """Move a rollout into the training T-frame (see module docstring)."""
    real_BxS = rollout.prompt_mask_BxS | rollout.completion_mask_BxS
    return {
        "inputs_BxT": rollout.tokens_BxS[:, :-1],
        "targets_BxT": rollout.tokens_BxS[:, 1:],
        "attn_BxT": real_BxS[:, :-1],
        "mask_BxT": rollout.completion_mask_BxS[:, 1:].astype(jnp.float32),
        "rollout_logp_BxT": rollout.logp_mu_BxS[:, 1:],
        "routes_mu_LxBxTxK": rollout.routes_mu_LxBxSxK[:, :, :-1],
        "advantages_B": advantages_B.astype(jnp.float32),
    }


def policy_logprobs(params: dict, batch: dict, cfg: ModelConfig, *, replay_LxBxTxK=None,
                    temperature: float = 1.0, impl: str = "chunked"):
    """Training-path log π(targets), full-vocabulary entropy, and the forward's aux."""
    hidden, aux = tf.forward(params, batch["inputs_BxT"], cfg,
                             attention_mask_BxT=batch["attn_BxT"],
                             replay_LxBxTxK=replay_LxBxTxK)
    logp, entropy = token_logprobs(hidden, tf.unembed_matrix(params, cfg), batch["targets_BxT"],
                                   impl=impl, temperature=temperature)
    return logp, entropy, aux


def replay_for(mode: str, batch: dict):
    if mode == "r2":
        return batch["routes_old_LxBxTxK"]
    if mode == "r3":
        return batch["routes_mu_LxBxTxK"]
    return None


def score(params: dict, batch: dict, *, cfg: ModelConfig, replay: str, temperature: float,
          impl: str) -> dict:
    """π_old pass at θ_old: old log-probs, entropy, and the training engine's routes.

    Under R3 this pass replays routes_mu, so π_old is the replayed policy; under R2 (and
    none) it routes live and its routes are the R2 record.
    """
    rep = batch["routes_mu_LxBxTxK"] if replay == "r3" else None
    logp, entropy, aux = policy_logprobs(params, batch, cfg, replay_LxBxTxK=rep,
                                         temperature=temperature, impl=impl)
    # Slots the sampler never processed (padding) keep -1 so a replay routes them live.
    real = batch["attn_BxT"][None, :, :, None]
    routes_old = jnp.where(real, aux["routes"], -1)
    return {"old_logp_BxT": logp, "entropy_BxT": entropy, "routes_old_LxBxTxK": routes_old}


def update(state: TrainState, batch: dict, *, cfg: ModelConfig, loss_cfg, replay: str,
           optimizer: optax.GradientTransformation, temperature: float, impl: str):
    """One optimizer step on one mini-batch. Returns (new_state, metrics as (num, den)).

    A non-finite loss or gradient leaves params and optimizer state untouched and counts
    the update as skipped: a NaN never reaches the parameters.
    """
    loss_fn = losses_lib.LOSSES[loss_cfg.name]

    def objective(params):
        logp, entropy, aux = policy_logprobs(params, batch, cfg,
                                             replay_LxBxTxK=replay_for(replay, batch),
                                             temperature=temperature, impl=impl)
        loss_batch = {k: batch[k] for k in ("old_logp_BxT", "rollout_logp_BxT",
                                            "advantages_B", "mask_BxT")}
        loss, metrics = loss_fn(logp, loss_batch, loss_cfg)
        mask = batch["mask_BxT"]
        metrics = dict(metrics)
        metrics["update/entropy"] = (jnp.sum(entropy * mask), jnp.sum(mask))
        metrics["router_loss"] = (aux["router_loss"], jnp.ones(()))
        return loss + aux["router_loss"], metrics

    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    new_state = TrainState(params=keep(params, state.params),
                           opt_state=keep(opt_state, state.opt_state),
                           step=state.step + 1,
                           skipped=state.skipped + (~ok).astype(jnp.int32))
    # A skipped update contributes nothing to the averages (its values may be NaN).
    metrics = {k: (jnp.where(ok, n, 0.0), jnp.where(ok, d, 0.0)) for k, (n, d) in metrics.items()}
    one = jnp.ones(())
    metrics["grad_norm"] = (jnp.where(ok, grad_norm, 0.0), ok.astype(jnp.float32))
    metrics["skipped_updates"] = ((~ok).astype(jnp.float32), one)
    return new_state, metrics

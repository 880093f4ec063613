"""The training engine's steps as pure functions: score (π_old), update (π_θ), SFT update.

Letters: B responses in the (mini-)batch, S rollout slots, T = S − 1 scored positions,
L layers, K top-k, G group size.

Every tensor of a batch is batch-major (axis 0 is B), so one sharding of axis 0 covers
every leaf (rl/engine.py). Per-token tensors are in the training T-frame of
`logprobs.policy_logprobs`: position t scores tokens[:, t + 1].

Replay per mode (PAPER.md §3), chosen once in `score`:
- none: route live in every pass.
- r2:   score routes live and records the training engine's routes (θ_old); every update
        replays them.
- r3:   score and every update replay the sampler's routes (routes_mu).
- r3 with rl.replay_weights (beyond the paper): score and every update also replay the
        sampler's recorded combine weights (route_weights_mu), held fixed.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from stablerl_jax import advantages as adv_lib
from stablerl_jax import diagnostics as dg
from stablerl_jax import losses as losses_lib
from stablerl_jax.config import ExperimentConfig
from stablerl_jax.data.batching import SFTBatch
from stablerl_jax.logprobs import policy_logprobs
from stablerl_jax.rollout import Rollout


class TrainBatch(NamedTuple):
    """One (mini-)batch of responses as the update reads it; every leaf is [B, ...]."""

    tokens_BxS: jax.Array         # int32, prompt then completion (the rollout's tokens)
    attn_BxS: jax.Array           # bool, real tokens (prompt or completion)
    mask_BxT: jax.Array           # float32, 1 on the completion tokens scored
    rollout_logp_BxT: jax.Array   # log μ_old of those tokens (sampling engine)
    old_logp_BxT: jax.Array       # log π_old (training engine at θ_old)
    advantages_B: jax.Array       # Â per response
    replay_BxTxLxK: jax.Array | None  # routes every update replays; None: route live
    replay_weights_BxTxLxK: jax.Array | None = None  # their recorded weights (weight replay)


class TrainState(NamedTuple):
    params: dict
    opt_state: optax.OptState
    step: jax.Array      # optimizer steps taken (int32)
    skipped: jax.Array   # updates skipped for a non-finite loss, gradient or result (int32)


def score(params: dict, rollout: Rollout, rewards_B: jax.Array, *,
          cfg: ExperimentConfig) -> tuple[TrainBatch, dict]:
    """The π_old pass at θ_old: a rollout and its rewards in, the update's batch out.

    Computes the group advantages, log π_old (replaying routes_mu under R3) and the
    monitors of the rollout as (num, den) pairs: the training–inference mismatch
    (`diagnostics.train_infer_mismatch`) and the full-vocabulary entropy of π_old on the
    sampled prefixes. The returned batch carries the one replay tensor the updates use.
    """
    rl = cfg.rl
    routes_mu_BxTxLxK = rollout.routes_mu_BxSxLxK[:, :-1]
    replay_w = None
    if rl.replay_weights:
        if rollout.route_weights_mu_BxSxLxK is None:
            raise ValueError("rl.replay_weights: the rollout has no route_weights_mu_BxSxLxK;"
                             " record the sampler's weights or set rl.replay_weights=false")
        replay_w = rollout.route_weights_mu_BxSxLxK[:, :-1]
    attn_BxS = rollout.prompt_mask_BxS | rollout.completion_mask_BxS
    mask_BxT = rollout.completion_mask_BxS[:, 1:].astype(jnp.float32)
    rollout_logp_BxT = rollout.logp_mu_BxS[:, 1:]
    logp_BxT, entropy_BxT, aux = policy_logprobs(
        params, rollout.tokens_BxS, attn_BxS, cfg.model,
        replay_BxTxLxK=routes_mu_BxTxLxK if rl.replay == "r3" else None,
        replay_weights_BxTxLxK=replay_w, temperature=cfg.sampling.temperature, impl=rl.logprob_impl)
    # Slots the sampler never processed (padding) keep -1, so a replay routes them live.
    routed_BxT = attn_BxS[:, :-1]
    routes_old_BxTxLxK = jnp.where(routed_BxT[:, :, None, None], aux["routes"], -1)
    replay = {"none": None, "r2": routes_old_BxTxLxK, "r3": routes_mu_BxTxLxK}[rl.replay]
    advantages_B = adv_lib.ADVANTAGES[cfg.loss.advantage](rewards_B, rl.group_size)
    batch = TrainBatch(rollout.tokens_BxS, attn_BxS, mask_BxT, rollout_logp_BxT, logp_BxT,
                       advantages_B.astype(jnp.float32), replay, replay_w)
    metrics = dg.train_infer_mismatch(rollout_logp_BxT, logp_BxT, mask_BxT, routes_mu_BxTxLxK,
                                      routes_old_BxTxLxK, routed_BxT)
    metrics["entropy"] = dg.masked_mean_pair(entropy_BxT, mask_BxT)
    return batch, metrics


def rl_loss(params: dict, batch: TrainBatch, cfg: ExperimentConfig):
    """The surrogate loss of `cfg.loss` on one mini-batch, plus the router loss:
    (loss, metrics as pairs)."""
    logp_BxT, entropy_BxT, aux = policy_logprobs(
        params, batch.tokens_BxS, batch.attn_BxS, cfg.model,
        replay_BxTxLxK=batch.replay_BxTxLxK,
        replay_weights_BxTxLxK=batch.replay_weights_BxTxLxK,
        temperature=cfg.sampling.temperature,
        impl=cfg.rl.logprob_impl)
    loss_batch = losses_lib.LossBatch(batch.old_logp_BxT, batch.rollout_logp_BxT,
                                      batch.mask_BxT, advantages_B=batch.advantages_B)
    loss, metrics = losses_lib.LOSSES[cfg.loss.name](logp_BxT, loss_batch, cfg.loss)
    metrics["update/entropy"] = dg.masked_mean_pair(entropy_BxT, batch.mask_BxT)
    metrics["router_loss"] = (aux["router_loss"], jnp.ones(()))
    return loss + aux["router_loss"], metrics


def sft_loss(params: dict, batch: SFTBatch, cfg: ExperimentConfig):
    """Mean token cross-entropy over the solution tokens, plus the router loss:

        loss = − Σ_{b,t} m_bt · log π(y_{b,t+1} | y_{b,≤t}) / Σ m_bt
    """
    logp_BxT, _, aux = policy_logprobs(params, batch.tokens_BxS, batch.attn_BxS, cfg.model,
                                       impl=cfg.rl.logprob_impl)
    m = batch.mask_BxT.astype(jnp.float32)
    nll = -jnp.sum(logp_BxT * m) / jnp.maximum(jnp.sum(m), 1.0)
    return nll + aux["router_loss"], {"sft/loss": (nll, jnp.ones(()))}


def apply_gradients(state: TrainState, loss_fn, batch, optimizer: optax.GradientTransformation):
    """One optimizer step on `loss_fn(params, batch) -> (loss, metrics)`; returns
    (new_state, metrics as (num, den) pairs).

    The update is applied only when the loss, the gradient and the new parameters and
    optimizer state are all finite; otherwise params and optimizer state stay as they
    were and the update counts as skipped: a NaN never reaches the parameters.
    """
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    all_finite = lambda tree: jnp.all(jnp.stack(
        [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
         if jnp.issubdtype(x.dtype, jnp.inexact)]))
    ok = (jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(params)
          & all_finite(opt_state))
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    new_state = TrainState(params=keep(params, state.params),
                           opt_state=keep(opt_state, state.opt_state),
                           step=state.step + 1,
                           skipped=state.skipped + (~ok).astype(jnp.int32))
    # A skipped update contributes nothing to the averages (its values may be NaN).
    metrics = {k: (jnp.where(ok, n, 0.0), jnp.where(ok, d, 0.0)) for k, (n, d) in metrics.items()}
    metrics["grad_norm"] = (jnp.where(ok, grad_norm, 0.0), ok.astype(jnp.float32))
    metrics["skipped_updates"] = ((~ok).astype(jnp.float32), jnp.ones(()))
    return new_state, metrics


def skipped(metrics) -> bool:
    """Whether the update that returned `metrics` was skipped."""
    return float(metrics["skipped_updates"][0]) > 0


def count_skips(consecutive: int, skipped_flags, limit: int, section: str) -> int:
    """Updates skipped in a row, after updates with these skipped flags; raises
    FloatingPointError once `limit` is reached."""
    for flag in skipped_flags:
        consecutive = consecutive + 1 if flag else 0
        if consecutive >= limit:
            raise FloatingPointError(
                f"{consecutive} updates in a row had a non-finite loss, gradient or result "
                "and were skipped (the parameters are those of the last good update, and "
                "checkpoints of completed steps are intact): the run diverged. Lower "
                f"{section}.optim.learning_rate, check the data and rewards, or raise "
                f"{section}.max_consecutive_skips.")
    return consecutive

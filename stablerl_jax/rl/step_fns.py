"""The training engine's steps as pure functions: score (π_old), update (π_θ), SFT update.

Letters: B responses, S slots, T = S − 1 scored positions, L layers, K top-k, G group size.

Batch tensors are batch-major (axis 0: B; one sharding covers every leaf, rl/engine.py);
per-token ones use the T-frame of `logprobs.policy_logprobs`: position t scores tokens[:, t + 1].

Micro-batching (rl/accumulate.py): `apply_gradients(..., microbatches=n)` sums n slices' loss,
metrics and gradient (`lax.scan`, normalized by `losses.Totals`) before one optimizer step;
`score(..., n_slices=n)` runs its forward in n slices (`lax.map`); n = 1 runs unsliced.

On-policy shortcut (`rl.score_in_update`, one mini-batch only): the only update runs at θ_old, so
π_old is its own forward. `score(..., forward=False)` skips the forward (`old_logp_BxT` None);
`rl_loss` takes log π_old as the stop-gradient of its log π_θ (ratio 1 with the gradient of
log π_θ, as a separate pass up to float rounding) and computes the rollout's monitors from that
forward. Under R2 the update routes live, which at θ_old gives the routes R2 would record.

Replay per mode (docs/method.md §3), chosen once in `score`:
- none: route live in every pass.
- r2: score routes live and records the training engine's routes (θ_old); updates replay them.
- r3: score and updates replay the sampler's routes (routes_mu); with rl.replay_weights (beyond
  the paper) also its recorded combine weights (route_weights_mu), held fixed.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from stablerl_jax import packing, slices
from stablerl_jax.config import ExperimentConfig
from stablerl_jax.data.batching import SFTBatch
from stablerl_jax.method import advantages as adv_lib
from stablerl_jax.method import attribution, centering
from stablerl_jax.method import diagnostics as dg
from stablerl_jax.method import losses as losses_lib
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import numerics as nx
from stablerl_jax.rl import accumulate
from stablerl_jax.sampling.rollout import Rollout


class TrainBatch(NamedTuple):
    """One (mini-)batch of responses as the update reads it; every leaf is [B, ...]."""

    tokens_BxS: jax.Array         # int32, prompt then completion (the rollout's tokens)
    attn_BxS: jax.Array           # bool, real tokens (prompt or completion)
    mask_BxT: jax.Array           # float32, 1 on the completion tokens scored
    rollout_logp_BxT: jax.Array   # log μ_old of those tokens (sampling engine)
    old_logp_BxT: jax.Array | None  # log π_old (training engine at θ_old); None: on-policy,
                                    # π_old is the update's own forward (module docstring)
    advantages_B: jax.Array       # Â per response
    replay_BxTxLxK: jax.Array | None  # routes every update replays; None: route live
    replay_weights_BxTxLxK: jax.Array | None = None  # their recorded weights (weight replay)
    routes_mu_BxTxLxK: jax.Array | None = None  # the sampler's routes, for the monitors an
                                                # on-policy update computes (else None)
    attr_logp_BxT: jax.Array | None = None  # rl.attribution: the score step's extra
                                            # forward (stablerl_jax/method/attribution.py)
    sampler_logq_BxTxK: jax.Array | None = None  # loss.center: the sampler's log q over
                                                 # the vocabulary (K = V), or its top-k head
    sampler_q_idx_BxTxK: jax.Array | None = None  # the head's ids (None: K = V)
    old_vocab_logp_BxTxV: jax.Array | None = None  # rl.drift_monitor with attribution:
                                                   # log π_old over the vocabulary


class TrainState(NamedTuple):
    params: dict
    opt_state: optax.OptState
    step: jax.Array      # optimizer steps taken (int32)
    skipped: jax.Array   # updates skipped for a non-finite loss, gradient or result (int32)


def rollout_monitors(rollout_logp_BxT, logp_BxT, entropy_BxT, mask_BxT, routes_mu_BxTxLxK,
                     routes_BxTxLxK, routed_BxT, tis_cap: float,
                     num_experts: int) -> tuple[dict, jax.Array]:
    """(the rollout's monitor pairs, π_old's routes with -1 where nothing was routed): the
    training–inference mismatch (`diagnostics.train_infer_mismatch`), π_old's full-vocabulary
    entropy on the sampled prefixes, and the sampler's and π_old's expert load on the tokens the
    sampler processed (`diagnostics.expert_load_pairs`)."""
    # Slots the sampler never processed (padding) keep -1, so a replay routes them live.
    routes_old_BxTxLxK = jnp.where(routed_BxT[:, :, None, None], routes_BxTxLxK, -1)
    metrics = dg.train_infer_mismatch(rollout_logp_BxT, logp_BxT, mask_BxT, routes_mu_BxTxLxK,
                                      routes_old_BxTxLxK, routed_BxT, tis_cap=tis_cap)
    metrics["entropy"] = dg.masked_mean_pair(entropy_BxT, mask_BxT)
    # Both loads over the tokens the sampler processed (a response's last token, never fed
    # back, is an input of the trainer's forward alone when the window goes past it).
    processed_BxT = routed_BxT & (routes_mu_BxTxLxK[:, :, 0, 0] >= 0)
    for side, routes in (("sampler", routes_mu_BxTxLxK), ("trainer", routes_old_BxTxLxK)):
        metrics.update(dg.expert_load_pairs(routes, processed_BxT, num_experts, side))
    return metrics, routes_old_BxTxLxK


def score(params: dict, rollout: Rollout, rewards_B: jax.Array, *,
          cfg: ExperimentConfig, n_slices: int = 1, mesh=None,
          forward: bool = True, age_BxS: jax.Array | None = None
          ) -> tuple[TrainBatch, dict]:
    """The π_old pass at θ_old: rollout and rewards in, the update's batch out (group advantages,
    log π_old replaying routes_mu under R3, the updates' one replay tensor), with the rollout's
    monitors (`rollout_monitors`). rl.overlong=mask zeroes truncated rows' mask after the
    advantages use every row (overlong.py). The forward runs in `n_slices` strided row slices
    (rows are independent: same result) on `mesh` (the expert FFN's devices). `forward=False`
    (rl.score_in_update): no forward, log π_old is the on-policy update's, no monitors.

    With rl.old_policy=behavior (rl/inflight.py) `params` is (θ_k, θ_k−1, …, θ_k−S) and `age_BxS`
    each token's age (k − its version; elsewhere the row's oldest): position t takes log π_old,
    entropy and routes from params[age of tokens[t + 1]], one forward per version present (a
    `lax.cond` skips the others). loss.center and rl.drift_monitor
    (stablerl_jax/method/centering.py): one more forward, at the sampler's numerics replaying
    routes_μ, gives the sampler's log q over the vocabulary, carried (or its top-k head) to the
    updates and compared with π_old's by the drift monitor."""
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
    if rl.overlong == "mask":  # a truncated response gets no gradient (overlong.py)
        if rollout.truncated_B is None:
            raise ValueError("rl.overlong=mask: the rollout has no truncated_B; fill it "
                             "with rollout.truncated_rows")
        mask_BxT = mask_BxT * (~rollout.truncated_B)[:, None].astype(jnp.float32)
    rollout_logp_BxT = rollout.logp_mu_BxS[:, 1:]

    advantages_B = adv_lib.compute(cfg.loss.advantage, rewards_B, rl.group_size,
                                   cfg.loss.advantage_std_ddof)
    advantages_B = advantages_B.astype(jnp.float32)

    drift = rl.drift_monitor

    def forward_(params, rows, numerics=nx.TRAIN, vocab=drift):
        tokens_BxS, attn_BxS, replay_BxTxLxK, replay_w_BxTxLxK = rows
        logp, entropy, aux = policy_logprobs(
            params, tokens_BxS, attn_BxS, cfg.model, replay_BxTxLxK=replay_BxTxLxK,
            replay_weights_BxTxLxK=replay_w_BxTxLxK, temperature=cfg.sampling.temperature,
            impl=rl.logprob_impl, mesh=mesh, numerics=numerics, vocab=vocab)
        return (logp, entropy, aux["routes"]) + ((aux["logp_BxTxV"],) if vocab else ())

    replay_in = routes_mu_BxTxLxK if rl.replay == "r3" else None
    if rl.pack_tokens:  # the forward on packed micro-batches (stablerl_jax/packing.py)
        lay = packing.layout(attn_BxS, rl.pack_tokens, batch_shards(cfg), rl.pack_rows)

    def old_policy(p, replay=replay_in, weights=replay_w, **kw):
        if rl.pack_tokens:
            return packing.packed_logprobs(lambda pk: packed_forward(p, pk, cfg, mesh), lay,
                                           rollout.tokens_BxS, replay, weights)
        return slices.map_slices(
            lambda rows: forward_(p, rows, **kw),
            (rollout.tokens_BxS, attn_BxS, replay, weights), n_slices, "score slices")

    versioned = lambda fn: by_version(fn, params, None if age_BxS is None else age_BxS[:, 1:])
    q = {}
    if drift or cfg.loss.center != "none":  # the sampler's q (method/centering.py)
        q_logp_BxTxV = versioned(lambda p: old_policy(
            p, routes_mu_BxTxLxK, replay_w, numerics=sampler_numerics(cfg), vocab=True)[3])
        q = sampler_q_fields(q_logp_BxTxV, cfg.loss)
    attr_logp_BxT = mid_logp_BxTxV = None
    if rl.attribution:  # the term the score pass lacks (stablerl_jax/method/attribution.py)
        other = None if rl.replay == "r3" else routes_mu_BxTxLxK
        attr = versioned(lambda p: old_policy(p, other, None))
        attr_logp_BxT = attr[0]
        mid_logp_BxTxV = attr[3] if drift and rl.replay != "r3" else None
    if not forward:
        # Under R2 the one update routes live at θ_old: the routes R2 would replay.
        replay = routes_mu_BxTxLxK if rl.replay == "r3" else None
        return TrainBatch(rollout.tokens_BxS, attn_BxS, mask_BxT, rollout_logp_BxT, None,
                          advantages_B, replay, replay_w, routes_mu_BxTxLxK,
                          attr_logp_BxT, **q), {}
    logp_BxT, entropy_BxT, routes_BxTxLxK, *old_vocab = versioned(old_policy)
    metrics, routes_old_BxTxLxK = rollout_monitors(
        rollout_logp_BxT, logp_BxT, entropy_BxT, mask_BxT, routes_mu_BxTxLxK, routes_BxTxLxK,
        attn_BxS[:, :-1], cfg.loss.tis_cap, cfg.model.num_experts)
    if drift:
        metrics.update(drift_monitors(q_logp_BxTxV, old_vocab[0], mid_logp_BxTxV, mask_BxT,
                                      rewards_B, rl))
        if rl.attribution:
            q["old_vocab_logp_BxTxV"] = old_vocab[0]
    replay = {"none": None, "r2": routes_old_BxTxLxK, "r3": routes_mu_BxTxLxK}[rl.replay]
    batch = TrainBatch(rollout.tokens_BxS, attn_BxS, mask_BxT, rollout_logp_BxT, logp_BxT,
                       advantages_B, replay, replay_w, attr_logp_BxT=attr_logp_BxT, **q)
    return batch, metrics


def sampler_numerics(cfg: ExperimentConfig) -> nx.Numerics:
    """The sampler's numerics, its router noise seeded as the Engine seeds it."""
    return nx.of_sampling(cfg.sampling, cfg.rl.seed if cfg.sampling.router_noise_std > 0
                          else 0)


def sampler_q_fields(q_logp_BxTxV, loss) -> dict:
    """The TrainBatch fields loss.center reads: log q over the vocabulary ('exact') or its top
    loss.center_k log-probs and their ids ('topk'); {} without centering."""
    if loss.center == "none":
        return {}
    if loss.center == "exact":
        return {"sampler_logq_BxTxK": q_logp_BxTxV}
    head, idx = jax.lax.top_k(q_logp_BxTxV, loss.center_k)
    return {"sampler_logq_BxTxK": head, "sampler_q_idx_BxTxK": idx}


def drift_monitors(q_logp_BxTxV, old_logp_BxTxV, mid_logp_BxTxV, mask_BxT, rewards_B,
                   rl) -> dict:
    """rl.drift_monitor's pairs (centering.drift_pairs) and, with rl.attribution, the drift's
    precision and routing parts; `mid_logp_BxTxV` None: π(θ_old, routes_μ) is π_old (r3)."""
    group_B = jnp.repeat(jnp.mean(rewards_B.reshape(-1, rl.group_size), axis=1),
                         rl.group_size)
    out = centering.drift_pairs(q_logp_BxTxV, old_logp_BxTxV, mask_BxT,
                                group_B.astype(jnp.float32))
    if rl.attribution:
        mid = old_logp_BxTxV if mid_logp_BxTxV is None else mid_logp_BxTxV
        out.update(centering.drift_parts(q_logp_BxTxV, mid, old_logp_BxTxV, mask_BxT))
    return out


def by_version(fn, params, age_BxT=None):
    """fn(params) (a pytree of [B, T, ...]), or with `age_BxT` and versions (θ_k, θ_k−1, …) each
    token's entries from fn(params[its age]), one call per version present (`lax.cond`)."""
    if age_BxT is None:
        return fn(params)
    out = fn(params[0])
    for a, p in enumerate(params[1:], start=1):
        mine_BxT = age_BxT == a

        def merge(out, p=p, mine_BxT=mine_BxT):
            put = lambda new, old: jnp.where(
                mine_BxT.reshape(mine_BxT.shape + (1,) * (old.ndim - 2)), new, old)
            return jax.tree.map(put, fn(p), out)

        out = jax.lax.cond(jnp.any(mine_BxT), merge, lambda out: out, out)
    return out


def batch_shards(cfg: ExperimentConfig) -> int:
    """The batch shards of the mesh (data × fsdp × expert): packing's D."""
    return cfg.mesh[0] * cfg.mesh[1] * cfg.mesh[2]


def packed_forward(params, pk: packing.Packed, cfg: ExperimentConfig, mesh=None):
    """`policy_logprobs` of one packed micro-batch: (logp, entropy, aux) in its T-frame."""
    return policy_logprobs(params, pk.tokens, pk.attn, cfg.model, replay_BxTxLxK=pk.replay,
                           replay_weights_BxTxLxK=pk.replay_weights,
                           segment_ids_BxS=pk.segments, positions_BxS=pk.positions,
                           temperature=cfg.sampling.temperature, impl=cfg.rl.logprob_impl,
                           mesh=mesh)


def _micro_batch(params, batch, micro, cfg, mesh):
    """Micro-batch `i` of a packed update (`micro` = (i, packing.Layout)): its forward's (logp,
    entropy, aux) in the padded [B, T] frame, the batch with other rows' mask and attention
    zeroed (losses and monitors count its rows against mini-batch totals), its row count."""
    i, lay = micro
    pk = packing.pack(i, lay.table, lay.plan, lay.per_shard, batch.tokens_BxS,
                      batch.replay_BxTxLxK, batch.replay_weights_BxTxLxK)
    logp, entropy, aux = packed_forward(params, pk, cfg, mesh)
    back = lambda x, fill: packing.unpack(i, x, lay.plan, lay.per_shard, lay.slots, fill)
    logp_BxT, mine_B = back(logp, 0.0)
    entropy_BxT, _ = back(entropy, 0.0)
    aux = dict(aux, routes=back(aux["routes"], -1)[0])
    view = batch._replace(mask_BxT=batch.mask_BxT * mine_B[:, None].astype(batch.mask_BxT.dtype),
                          attn_BxS=batch.attn_BxS & mine_B[:, None])
    return (logp_BxT, entropy_BxT, aux), view, jnp.sum(mine_B.astype(jnp.float32))


class BatchTotals(NamedTuple):
    """A mini-batch's sizes for one micro-batch's loss: the loss's (`losses.Totals`) and the real
    input tokens of its forward (`routed`), weighting the router loss (a token mean)."""

    loss: losses_lib.Totals
    routed: jax.Array


def batch_totals(batch) -> BatchTotals:
    """The `BatchTotals` of a whole TrainBatch or SFTBatch (before it is split)."""
    return BatchTotals(losses_lib.mask_totals(batch.mask_BxT),
                       jnp.sum(batch.attn_BxS[:, :-1].astype(jnp.float32)))


def _router_loss(aux, batch, totals: BatchTotals | None, rows=None):
    """The router loss and its metric pair; with totals, this forward's share: its token mean
    (router z-loss) weighted by its share of routed tokens. The load-balancing loss, a product of
    two batch means, is then the share-weighted mean of the slices' values (as in every
    micro-batched MoE trainer), not the mini-batch's own."""
    if totals is None:
        return aux["router_loss"], (aux["router_loss"], jnp.ones(()))
    dt = jnp.result_type(aux["router_loss"])
    routed = jnp.sum(batch.attn_BxS[:, :-1].astype(dt))
    value = aux["router_loss"] * (routed / jnp.maximum(totals.routed.astype(dt), 1.0))
    rows = batch.attn_BxS.shape[0] if rows is None else rows
    return value, (value, losses_lib.row_share(rows, totals.loss))


def rl_loss(params: dict, batch: TrainBatch, totals: BatchTotals | None = None, *,
            cfg: ExperimentConfig, mesh=None, micro=None):
    """(loss, metric pairs): `cfg.loss`'s surrogate on a mini-batch (`totals`: a micro-batch's
    share) plus the router loss; `micro` = (i, packing.Layout): packed micro-batch i."""
    rows = None
    vocab = batch.sampler_logq_BxTxK is not None or batch.old_vocab_logp_BxTxV is not None
    if micro is None:
        logp_BxT, entropy_BxT, aux = policy_logprobs(
            params, batch.tokens_BxS, batch.attn_BxS, cfg.model,
            replay_BxTxLxK=batch.replay_BxTxLxK,
            replay_weights_BxTxLxK=batch.replay_weights_BxTxLxK,
            temperature=cfg.sampling.temperature, impl=cfg.rl.logprob_impl, mesh=mesh,
            vocab=vocab)
    else:
        (logp_BxT, entropy_BxT, aux), batch, rows = _micro_batch(params, batch, micro, cfg,
                                                                 mesh)
    old_logp_BxT = batch.old_logp_BxT
    monitors = {}
    if old_logp_BxT is None:  # on-policy: this forward is π_old (module docstring)
        old_logp_BxT = jax.lax.stop_gradient(logp_BxT)
        monitors, _ = rollout_monitors(batch.rollout_logp_BxT, old_logp_BxT,
                                       jax.lax.stop_gradient(entropy_BxT), batch.mask_BxT,
                                       batch.routes_mu_BxTxLxK, aux["routes"],
                                       batch.attn_BxS[:, :-1], cfg.loss.tis_cap,
                                       cfg.model.num_experts)
    loss_batch = losses_lib.LossBatch(old_logp_BxT, batch.rollout_logp_BxT,
                                      batch.mask_BxT, advantages_B=batch.advantages_B,
                                      totals=None if totals is None else totals.loss,
                                      rows=rows)
    loss_fn = losses_lib.LOSSES[cfg.loss.name]
    if batch.sampler_logq_BxTxK is not None:  # loss.center (stablerl_jax/method/centering.py)
        loss, metrics = centering.centered(loss_fn, logp_BxT, loss_batch, cfg.loss,
                                           aux["logits_BxTxV"], aux["logp_BxTxV"],
                                           batch.sampler_logq_BxTxK, batch.sampler_q_idx_BxTxK)
    else:
        loss, metrics = loss_fn(logp_BxT, loss_batch, cfg.loss)
    if batch.old_vocab_logp_BxTxV is not None:  # the drift's staleness part
        metrics.update(centering.staleness_pair(batch.old_vocab_logp_BxTxV,
                                                aux["logp_BxTxV"], batch.mask_BxT))
    metrics.update(monitors)
    if batch.attr_logp_BxT is not None:  # rl.attribution (stablerl_jax/method/attribution.py)
        mu_routes_BxT, routing_cf_BxT = attribution.score_terms(
            cfg.rl.replay, old_logp_BxT, batch.attr_logp_BxT)
        parts = attribution.token_parts(batch.rollout_logp_BxT, mu_routes_BxT, old_logp_BxT,
                                        jax.lax.stop_gradient(logp_BxT))
        metrics.update(attribution.pairs(parts, routing_cf_BxT, batch.rollout_logp_BxT,
                                         jax.lax.stop_gradient(entropy_BxT), batch.mask_BxT))
    metrics["update/entropy"] = dg.masked_mean_pair(entropy_BxT, batch.mask_BxT)
    router, metrics["router_loss"] = _router_loss(aux, batch, totals, rows)
    return loss + router, metrics


def sft_loss(params: dict, batch: SFTBatch, totals: BatchTotals | None = None, *,
             cfg: ExperimentConfig, mesh=None):
    """Mean token cross-entropy over the solution tokens, plus the router loss:

        loss = − Σ_{b,t} m_bt · log π(y_{b,t+1} | y_{b,≤t}) / Σ m_bt

    with `totals`, Σ m is the mini-batch's (this micro-batch's share)."""
    logp_BxT, _, aux = policy_logprobs(params, batch.tokens_BxS, batch.attn_BxS, cfg.model,
                                       impl=cfg.rl.logprob_impl, mesh=mesh)
    m = batch.mask_BxT.astype(jnp.float32)
    tokens = jnp.sum(m) if totals is None else totals.loss.tokens
    nll = -jnp.sum(logp_BxT * m) / jnp.maximum(tokens, 1.0)
    share = losses_lib.row_share(m.shape[0], None if totals is None else totals.loss)
    router, _ = _router_loss(aux, batch, totals)
    return nll + router, {"sft/loss": (nll, share)}


def apply_gradients(state: TrainState, loss_fn, batch, optimizer: optax.GradientTransformation,
                    microbatches: int = 1, pack: tuple[int, int, int] | None = None):
    """One optimizer step on `loss_fn(params, batch, totals) -> (loss, metrics)`: (new_state,
    metrics as (num, den) pairs). `microbatches` = n > 1 sums over n slices (rl/accumulate.py;
    totals: the batch's `BatchTotals`), n = 1 differentiates `loss_fn(params, batch, None)`;
    `pack` = (rl.pack_tokens, batch shards, rl.pack_rows) sums over packed micro-batches
    (`loss_fn(params, batch, totals, micro=(i, layout))`; stablerl_jax/packing.py). The update
    applies only if the loss, gradient, new parameters and optimizer state are all finite; else
    they stay and the update counts as skipped: a NaN never reaches the parameters."""
    if pack is not None:
        totals = batch_totals(batch)
        lay = packing.layout(batch.attn_BxS, *pack)
        (loss, metrics), grads = accumulate.packed_value_and_grad(
            lambda p, i: loss_fn(p, batch, totals, micro=(i, lay)), state.params, lay.count,
            lay.used)
    elif microbatches == 1:
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params,
                                                                           batch, None)
    else:
        totals = batch_totals(batch)
        (loss, metrics), grads = accumulate.value_and_grad(
            lambda p, part: loss_fn(p, part, totals), state.params, batch, microbatches)
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
    """Updates skipped in a row after these flags; raises FloatingPointError at `limit`."""
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

"""Token log-probs and entropy: from hidden states (`token_logprobs`) and from tokens
through the training engine's model (`policy_logprobs`). Letters: B responses, S token
slots, T = S − 1 scored positions, D model, V vocab, L layers, K top-k.

The frame shift lives only here: the model runs on inputs = tokens[:, :-1] and scores
targets = tokens[:, 1:] (slot t's hidden state predicts token t + 1); every per-token tensor
of a training batch is in that T-frame. Score, update, SFT and the mismatch measurement all
call `policy_logprobs`. Temperature τ scales the hidden states before the fused op
(z/τ = (h/τ) W), so the gradient goes through the same custom VJP. The op is row-wise: a
row's log-probs do not depend on the rest of the batch. impl: a row of the op's table
LOGPROB_IMPLS (kernels/fused_logprob_impls.py; "chunked" by default); `interpret=True` runs
a Pallas row in the checking interpreter (CPU tests).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from stablerl_jax import input_checks, sharding
from stablerl_jax.kernels import lookup
from stablerl_jax.kernels.fused_logprob_impls import LOGPROB_IMPLS, LogprobBlocks
from stablerl_jax.model import invariant, invariant_layer
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf


def token_logprobs(hidden_BxTxD, unembed_DxV, targets_BxT, *, impl: str = "chunked",
                   block: LogprobBlocks | None = None, temperature: float = 1.0,
                   interpret: bool = False, mesh=None):
    """(log p(target), −Σ_v p_v log p_v) of p = softmax(hidden · unembed / temperature), float32
    (float64 for float64 hidden); `block` overrides block sizes. On a multi-device `mesh` a
    Pallas impl runs under shard_map on each device's rows with the whole unembedding (the
    partitioner, to which it is opaque, would gather all rows); shard_map sums its gradient."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    row = lookup(LOGPROB_IMPLS, impl, "impl")
    if hidden_BxTxD.ndim != 3 or targets_BxT.shape != hidden_BxTxD.shape[:2]:
        raise ValueError(f"token_logprobs: need hidden [B, T, D] and targets [B, T]; got "
                         f"{hidden_BxTxD.shape=}, {targets_BxT.shape=}")
    b, t, d = hidden_BxTxD.shape
    h_TxD = hidden_BxTxD.reshape(b * t, d)
    # Scaled in float32 (or wider), then back to the compute dtype the op streams in.
    h_TxD = invariant.scaled(h_TxD, temperature)
    fused = row.load(block=block, interpret=interpret)
    if row.pallas and mesh is not None and mesh.size > 1:
        rows = P(tuple(a for a in sharding.RULES["batch"] if mesh.shape[a] > 1))
        fused = jax.shard_map(fused, mesh=mesh, in_specs=(rows, P(), rows),
                              out_specs=(rows, rows), check_vma=False)
    logp_T, ent_T = fused(h_TxD, unembed_DxV.astype(hidden_BxTxD.dtype),
                          targets_BxT.reshape(-1))
    return logp_T.reshape(b, t), ent_T.reshape(b, t)


def policy_logprobs(params: dict, tokens_BxS, attn_BxS, cfg, *, replay_BxTxLxK=None,
                    replay_weights_BxTxLxK=None, segment_ids_BxS=None, positions_BxS=None,
                    numerics: nx.Numerics = nx.TRAIN,
                    temperature: float = 1.0, impl: str = "chunked",
                    interpret: bool = False, mesh=None, checks: bool | None = None,
                    trace: bool = False, vocab: bool = False):
    """(logp_BxT, entropy_BxT, aux) of every next token: one forward of inputs = tokens[:, :-1]
    (mask attn[:, :-1]) replaying `replay_BxTxLxK` (-1 rows route live) and, with
    `replay_weights_BxTxLxK`, their combine weights, then the fused log-prob of targets =
    tokens[:, 1:]. `aux`: the forward's (aux["routes"] [B, T, L, K]), plus with `vocab` the
    `vocab_logprobs` "logits_BxTxV", "logp_BxTxV". `segment_ids_BxS` / `positions_BxS` (packed
    rows, stablerl_jax/packing.py) and `mesh` (expert FFN devices) go to `transformer.forward`.
    Weights convert for `numerics` ("train": identity). Shapes and dtypes are always checked,
    values (ids in [0, V), mask in {0, 1}) under `checks` (stablerl_jax/input_checks.py)."""
    input_checks.tokens(tokens_BxS, cfg.vocab_size, checks=checks)
    input_checks.mask(attn_BxS, jnp.shape(tokens_BxS), name="attn_BxS", checks=checks)
    if jnp.shape(tokens_BxS)[1] < 2:
        raise ValueError(f"tokens_BxS: shape {jnp.shape(tokens_BxS)} has no next token to "
                         "score; pass at least 2 positions")
    weights = nx.prepare_params(params, numerics)
    hidden_BxTxD, aux = tf.forward(weights, tokens_BxS[:, :-1], cfg,
                                   attention_mask_BxT=attn_BxS[:, :-1],
                                   segment_ids_BxT=(None if segment_ids_BxS is None
                                                    else segment_ids_BxS[:, :-1]),
                                   positions_BxT=(None if positions_BxS is None
                                                  else positions_BxS[:, :-1]),
                                   replay_BxTxLxK=replay_BxTxLxK,
                                   replay_weights_BxTxLxK=replay_weights_BxTxLxK,
                                   numerics=numerics, mesh=mesh, checks=checks, trace=trace)
    unembed_DxV = tf.unembed_matrix(weights, cfg)
    if vocab:
        aux = dict(aux, **vocab_logprobs(hidden_BxTxD, unembed_DxV, cfg, temperature, impl))
    if cfg.batch_invariant and invariant.vocab_kernel(impl) is None:
        # The sampler's own per-row log-softmax (model/invariant.py); an invariant row of
        # LOGPROB_IMPLS is the sampler's own as it is (invariant.vocab_kernel).
        def tiled(h_BxTxD, unembed, targets_BxT):
            b, t, _ = h_BxTxD.shape
            logp_N, entropy_N = invariant.token_logprobs(
                h_BxTxD.reshape(b * t, -1), unembed, targets_BxT.reshape(-1), temperature,
                cfg.row_tile)
            return logp_N.reshape(b, t), entropy_N.reshape(b, t)

        # Its gradient is the fused op's (the same function up to rounding).
        per_row = lambda rows, unembed: invariant.with_reference_gradient(
            tiled, lambda _, *args: token_logprobs(*args, impl=impl, temperature=temperature,
                                                    interpret=interpret))(
            rows[0], unembed, rows[1])

        logp_BxT, entropy_BxT = invariant_layer.on_mesh(per_row, mesh)(
            (hidden_BxTxD, tokens_BxS[:, 1:]), unembed_DxV.astype(hidden_BxTxD.dtype))
        return logp_BxT, entropy_BxT, aux
    logp_BxT, entropy_BxT = token_logprobs(hidden_BxTxD, unembed_DxV, tokens_BxS[:, 1:],
                                           impl=impl, temperature=temperature,
                                           interpret=interpret, mesh=mesh)
    return logp_BxT, entropy_BxT, aux


def vocab_logprobs(hidden_BxTxD, unembed_DxV, cfg, temperature: float = 1.0,
                   impl: str = "chunked") -> dict:
    """"logits_BxTxV": ζ = (h/τ) · unembed, float32 or wider, differentiable; "logp_BxTxV":
    log softmax(ζ), stop-gradient, as the sampler computes it (`invariant.logprobs_V` per row
    under batch-invariant numerics: the same bits in both engines; else a plain log-softmax)."""
    b, t, d = hidden_BxTxD.shape
    h_NxD = hidden_BxTxD.reshape(b * t, d)
    w_DxV = unembed_DxV.astype(hidden_BxTxD.dtype)
    acc = nx.accum_dtype(hidden_BxTxD.dtype)
    zeta_NxV = jnp.dot(invariant.scaled(h_NxD, temperature), w_DxV, precision=nx.PRECISION,
                       preferred_element_type=acc)
    if cfg.batch_invariant:
        logp_NxV = invariant.logprobs_V(h_NxD, w_DxV, temperature, cfg.row_tile, impl)
    else:
        logp_NxV = jax.nn.log_softmax(zeta_NxV, axis=-1)
    return {"logits_BxTxV": zeta_NxV.reshape(b, t, -1),
            "logp_BxTxV": jax.lax.stop_gradient(logp_NxV).reshape(b, t, -1)}

"""Mixture-of-Experts: routing with optional replay, and the SwiGLU expert FFN.

Letters: T tokens, D model, E experts, K top-k, F expert FFN width, A token–expert assignments
(T·K), R rows of the sorted-and-padded buffer (a multiple of the tile size).

Routing (`route`) follows Qwen3-MoE: softmax over all E experts in float32 (float64 for float64
logits), top-k, weights renormalized over the k chosen (`norm_topk_prob`). Routing Replay
substitutes recorded expert *indices* for the top-k; weights still come from the live softmax, so
replayed experts get router gradient even outside the current top-k. Weight replay (beyond the
paper) also replays the combine weights.

Dispatch, one function two ways:
- `experts_dense`: every expert on every token, one-hot combined. The reference: obviously right,
  E/K times the FLOPs.
- `experts_grouped`: dropless; assignments sorted by expert, groups padded to whole tiles, a
  grouped matmul (`gmm`) per expert: the GMM_IMPLS row by name (`gmm_of`, ModelConfig.gmm_impl;
  kernels/gmm_impls.py), by default the pure-JAX reference `loop`. A capacity limit would make
  the trainer's function differ from the sampler's, the very mismatch studied here.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax.kernels import gmm as grouped_matmul
from stablerl_jax.kernels import lookup
from stablerl_jax.kernels.gmm_impls import GMM_IMPLS, padded_rows
from stablerl_jax.model.numerics import PRECISION, accum_dtype

GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array, int, jax.lax.Precision], jax.Array]
"""gmm(lhs_RxD, rhs_ExDxF, group_sizes_E, tile, precision) -> RxF, rows sorted by group,
each group a multiple of `tile` rows (kernels/gmm_impls.py names the implementations)."""


def validate_replay(replay_TxK: jax.Array, num_tokens_shape: tuple, k: int,
                    num_experts: int) -> None:
    """Raise ValueError for a replay tensor that cannot be a recorded route (shape and dtype;
    values when concrete). Under jit `route` gives invalid rows (ids out of range, -1 mixed with
    experts, a repeat) NaN weights, which the trainer skips as non-finite."""
    want = tuple(num_tokens_shape) + (k,)
    if tuple(replay_TxK.shape) != want:
        raise ValueError(f"replay: shape {tuple(replay_TxK.shape)} must be {want} "
                         "(tokens..., top_k); pass the routes recorded for this batch")
    if not jnp.issubdtype(replay_TxK.dtype, jnp.integer):
        raise ValueError(f"replay: dtype {replay_TxK.dtype} must be an integer type "
                         "(int32 expert indices, -1 for 'route normally')")
    if isinstance(replay_TxK, jax.core.Tracer):
        return
    r = np.asarray(replay_TxK).reshape(-1, k)
    if r.size and (r.min() < -1 or r.max() >= num_experts):
        raise ValueError(f"replay: values must be in [-1, {num_experts - 1}] "
                         f"(num_experts={num_experts}), got min={r.min()} max={r.max()}")
    recorded = r >= 0
    mixed = recorded.any(-1) & ~recorded.all(-1)
    if mixed.any():
        raise ValueError("replay: a token's K entries must be all -1 (route normally) or all "
                         f"recorded experts; {int(mixed.sum())} token(s) mix both")
    srt = np.sort(r, axis=-1)
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if dup.any():
        raise ValueError(f"replay: {int(dup.any(-1).sum())} token(s) repeat an expert; "
                         "recorded routes hold K distinct experts")


def route(router_logits_TxE: jax.Array, k: int, replay_TxK: jax.Array | None = None,
          replay_weights_TxK: jax.Array | None = None, *, normalize: bool = True):
    """K experts per token and their mixing weights.

    probs = softmax(logits) over all E (float32);
    idx   = top_k(probs) if replay is None, else replay (rows of -1: top_k for that token);
    w     = probs[idx] / Σ_k probs[idx]   (normalize=True, Qwen3 `norm_topk_prob`)
          = probs[idx]                    (normalize=False)
    w     = sg(replay_weights) on recorded rows when `replay_weights_TxK` is given.

    Weight replay (the paper's replay is index-only) leaves the router gradient on recorded
    tokens only through auxiliary losses. Leading dims are arbitrary (T or B×T). Returns (idx
    int32 [...,K], weights [...,K], probs [...,E]), float32 (float64 for float64 logits).
    """
    num_experts = router_logits_TxE.shape[-1]
    if not 0 < k <= num_experts:
        raise ValueError(f"route: k={k} must be in [1, num_experts={num_experts}]")
    if replay_weights_TxK is not None:
        validate_replay_weights(replay_weights_TxK, replay_TxK, k)
    probs_TxE = jax.nn.softmax(
        router_logits_TxE.astype(accum_dtype(router_logits_TxE.dtype)), axis=-1)
    _, idx_TxK = jax.lax.top_k(probs_TxE, k)
    bad_T = use_T = None
    if replay_TxK is not None:
        validate_replay(replay_TxK, router_logits_TxE.shape[:-1], k, num_experts)
        replay_TxK = replay_TxK.astype(jnp.int32)
        recorded_TxK = replay_TxK >= 0
        use_T = jnp.all(recorded_TxK, axis=-1, keepdims=True)
        idx_TxK = jnp.where(use_T, replay_TxK, idx_TxK)
        sorted_TxK = jnp.sort(replay_TxK, axis=-1)
        bad_T = (jnp.any((replay_TxK < -1) | (replay_TxK >= num_experts), axis=-1,
                         keepdims=True)
                 | (jnp.any(recorded_TxK, axis=-1, keepdims=True) & ~use_T)
                 | jnp.any((sorted_TxK[..., 1:] == sorted_TxK[..., :-1])
                           & (sorted_TxK[..., 1:] >= 0), axis=-1, keepdims=True))
    w_TxK = jnp.take_along_axis(probs_TxE, idx_TxK, axis=-1)
    if normalize:
        w_TxK = w_TxK / jnp.sum(w_TxK, axis=-1, keepdims=True)
    if replay_weights_TxK is not None:
        recorded_w = jax.lax.stop_gradient(replay_weights_TxK.astype(w_TxK.dtype))
        w_TxK = jnp.where(use_T, recorded_w, w_TxK)
    if bad_T is not None:
        w_TxK = jnp.where(bad_T, jnp.nan, w_TxK)
    return idx_TxK.astype(jnp.int32), w_TxK, probs_TxE


def validate_replay_weights(weights_TxK: jax.Array, replay_TxK: jax.Array | None,
                            k: int) -> None:
    """Raise ValueError unless `weights_TxK` fits the replay: replay given, its shape, float."""
    if replay_TxK is None:
        raise ValueError("replay_weights: recorded weights need the recorded routes; pass "
                         "replay (the indices) too, or drop replay_weights")
    if tuple(weights_TxK.shape) != tuple(replay_TxK.shape) or weights_TxK.shape[-1] != k:
        raise ValueError(f"replay_weights: shape {tuple(weights_TxK.shape)} must equal the "
                         f"replay's {tuple(replay_TxK.shape)} (tokens..., top_k={k})")
    if not jnp.issubdtype(weights_TxK.dtype, jnp.floating):
        raise ValueError(f"replay_weights: dtype {weights_TxK.dtype} must be a float type "
                         "(the sampler's combine weights)")


def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


def _dot(eq, a, b):
    return jnp.einsum(eq, a, b, precision=PRECISION, preferred_element_type=accum_dtype(a.dtype))


def experts_dense(x_TxD, idx_TxK, w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD):
    """Reference: y = Σ_e c_te · FFN_e(x_t), c = one-hot(idx)·w summed over k."""
    dt = x_TxD.dtype
    num_experts = w_gate_ExDxF.shape[0]
    onehot_TxKxE = jax.nn.one_hot(idx_TxK, num_experts, dtype=w_TxK.dtype)
    combine_TxE = jnp.einsum("tke,tk->te", onehot_TxKxE, w_TxK, precision=PRECISION)
    gate_TxExF = _dot("td,edf->tef", x_TxD, w_gate_ExDxF)
    up_TxExF = _dot("td,edf->tef", x_TxD, w_up_ExDxF)
    h_TxExF = (_swiglu(gate_TxExF, up_TxExF) * combine_TxE[..., None]).astype(dt)
    return _dot("tef,efd->td", h_TxExF, w_down_ExFxD).astype(dt)


# Largest A·E for which the plan counts ranks with an [A, E] one-hot cumsum instead of
# sorting (the same rows; a sort of A ids costs more than the cumsum on small inputs).
_COUNTING_PLAN_MAX = 1 << 22


def _plan(expert_A, num_experts: int, tile: int):
    """(row_A, padded_E): each assignment's row in the expert-sorted, tile-padded buffer
    (assignment order within a group) and each group's padded size. Ids ≥ num_experts: no group,
    rows unused."""
    a = expert_A.shape[0]
    sizes_E = jnp.bincount(expert_A, length=num_experts).astype(jnp.int32)
    padded_E = (sizes_E + tile - 1) // tile * tile
    padded_start_E = jnp.cumsum(padded_E) - padded_E
    group_A = jnp.minimum(expert_A, num_experts - 1)
    if a * num_experts <= _COUNTING_PLAN_MAX:
        onehot_AxE = (expert_A[:, None] == jnp.arange(num_experts)).astype(jnp.int32)
        rank_A = jnp.sum(jnp.cumsum(onehot_AxE, axis=0) * onehot_AxE, axis=1) - 1
        return padded_start_E[group_A] + rank_A, padded_E
    order_A = jnp.argsort(expert_A, stable=True)         # sorted slot -> assignment
    start_E = jnp.cumsum(sizes_E) - sizes_E
    sorted_group_A = group_A[order_A]
    dest_A = padded_start_E[sorted_group_A] + jnp.arange(a) - start_E[sorted_group_A]
    return jnp.zeros_like(dest_A).at[order_A].set(dest_A, unique_indices=True), padded_E


def experts_grouped(x_TxD, idx_TxK, w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
                    tile: int = 64, gmm: GroupedMatmul = grouped_matmul.loop,
                    expert_offset=None):
    """Dropless grouped dispatch, equal to `experts_dense` up to float reassociation.
    expert_offset (model/expert_parallel.py): the weights are experts [offset, offset + E) and
    `idx_TxK` global ids; other experts give 0. The buffer fits T·min(K, E) assignments, a
    token's K experts being distinct (`route` gives repeats NaN weights)."""
    num_tokens, k = idx_TxK.shape
    num_experts = w_gate_ExDxF.shape[0]
    dt = x_TxD.dtype
    expert_A = idx_TxK.reshape(-1)                       # A = T·K assignments
    mine_A = None
    if expert_offset is not None:
        local_A = expert_A - expert_offset
        mine_A = (local_A >= 0) & (local_A < num_experts)
        expert_A = jnp.where(mine_A, local_A, num_experts)
    row_A, padded_E = _plan(expert_A, num_experts, tile)
    local_max = expert_A.shape[0] if mine_A is None else num_tokens * min(k, num_experts)
    rows = padded_rows(local_max, num_experts, tile)
    if mine_A is not None:  # other devices' assignments: written nowhere, read as 0
        row_A = jnp.where(mine_A, row_A, rows)
    if mine_A is None:
        x_RxD = jnp.zeros((rows, x_TxD.shape[1]), dt).at[row_A].set(
            jnp.repeat(x_TxD, k, axis=0), unique_indices=True)
    else:
        # Each buffer row's token (num_tokens: an unused row, read as 0): the buffer is
        # gathered from this shard's tokens, with no [T·K, D] copy of them (most of
        # which are other shards' assignments). Its transpose is a scatter-add, which
        # the single-device path avoids (slow on a CPU).
        token_A = jnp.arange(expert_A.shape[0], dtype=jnp.int32) // k
        token_R = jnp.full((rows,), num_tokens, jnp.int32).at[row_A].set(
            token_A, unique_indices=True, mode="drop")
        x_RxD = jnp.take(x_TxD, token_R, axis=0, mode="fill", fill_value=0)
    gate_RxF = gmm(x_RxD, w_gate_ExDxF, padded_E, tile, PRECISION)
    up_RxF = gmm(x_RxD, w_up_ExDxF, padded_E, tile, PRECISION)
    acc = accum_dtype(dt)
    h_RxF = _swiglu(gate_RxF.astype(acc), up_RxF.astype(acc)).astype(dt)
    y_RxD = gmm(h_RxF, w_down_ExFxD, padded_E, tile, PRECISION)
    m = k if mine_A is None else min(k, num_experts)
    if mine_A is None:
        y_TxMxD, w_TxM = y_RxD[row_A].reshape(num_tokens, k, -1), w_TxK
    elif m == k:  # rows past the buffer read as 0 (not every gmm zeroes unused rows)
        y_AxD = jnp.take(y_RxD, row_A, axis=0, mode="fill", fill_value=0)
        y_TxMxD = jnp.where(mine_A[:, None], y_AxD, 0).reshape(num_tokens, k, -1)
        w_TxM = w_TxK
    else:
        # Fewer experts here than K (a serving layout's shard): only a token's M = E
        # local assignments, in k order, are gathered and combined. The K-term sum
        # it replaces differs only by exact zeros, so the result is the same.
        mine_TxK = mine_A.reshape(num_tokens, k)
        slot_TxM = jnp.argsort(~mine_TxK, axis=1, stable=True)[:, :m]
        ok_TxM = jnp.take_along_axis(mine_TxK, slot_TxM, axis=1)
        row_TxM = jnp.take_along_axis(row_A.reshape(num_tokens, k), slot_TxM, axis=1)
        y_TxMxD = jnp.take(y_RxD, row_TxM.reshape(-1), axis=0, mode="fill",
                           fill_value=0).reshape(num_tokens, m, -1)
        y_TxMxD = jnp.where(ok_TxM[..., None], y_TxMxD, 0)
        w_TxM = jnp.take_along_axis(w_TxK, slot_TxM, axis=1)
    y_TxD = jnp.einsum("tmd,tm->td", y_TxMxD.astype(acc), w_TxM.astype(acc),
                       precision=PRECISION)
    return y_TxD.astype(dt) if expert_offset is None else y_TxD


def experts_local_dense(x_TxD, idx_TxK, w_TxK, w_gate_ExDxF, w_up_ExDxF, w_down_ExFxD, *,
                        expert_offset):
    """A shard of E ≤ K experts (serving-layout decode): each token through every local expert
    times its combine weight there (0 if unchosen): the grouped buffer's T·E rows without plan,
    sort, scatter or gather; summed in expert order (experts_grouped: k order), so equal when at
    most one is local, else up to reassociation."""
    num_experts = w_gate_ExDxF.shape[0]
    dt = x_TxD.dtype
    acc = accum_dtype(dt)
    local_TxK = idx_TxK - expert_offset
    # At most one k per (token, expert): a token's experts are distinct (`route`), so the
    # sum over k is that one weight or an exact 0.
    combine_TxE = jnp.sum(jnp.where(local_TxK[..., None] == jnp.arange(num_experts),
                                    w_TxK[..., None], 0), axis=1)
    gate_TxExF = _dot("td,edf->tef", x_TxD, w_gate_ExDxF).astype(dt)
    up_TxExF = _dot("td,edf->tef", x_TxD, w_up_ExDxF).astype(dt)
    h_TxExF = _swiglu(gate_TxExF.astype(acc), up_TxExF.astype(acc)).astype(dt)
    y_TxExD = jnp.einsum("tef,efd->ted", h_TxExF, w_down_ExFxD, precision=PRECISION,
                         preferred_element_type=acc).astype(dt)
    return jnp.einsum("ted,te->td", y_TxExD.astype(acc), combine_TxE.astype(acc),
                      precision=PRECISION)


def gmm_of(impl: str) -> GroupedMatmul:
    """`ModelConfig.gmm_impl`'s grouped matmul: its GMM_IMPLS row with default blocks."""
    return lookup(GMM_IMPLS, impl, "gmm_impl").load()


def router_stats(probs_TxE, idx_TxK, router_logits_TxE, mask_T):
    """Masked load fraction per expert, router z-loss and Switch load-balancing loss:
    load_E = fraction of the K·T routed slots that went to e; importance_E = mean prob;
    balance = E · Σ_e load_E · importance_E (= 1 when uniform); z = mean logsumexp(logits)²."""
    num_experts = probs_TxE.shape[-1]
    m_T = mask_T.astype(probs_TxE.dtype)
    n = jnp.maximum(m_T.sum(), 1.0)  # real tokens
    counts_E = jnp.einsum("tke,t->e", jax.nn.one_hot(idx_TxK, num_experts), m_T)
    load_E = counts_E / (n * idx_TxK.shape[-1])
    importance_E = jnp.einsum("te,t->e", probs_TxE, m_T) / n
    balance = num_experts * jnp.sum(load_E * importance_E)
    lse_T = jax.nn.logsumexp(router_logits_TxE.astype(probs_TxE.dtype), axis=-1)
    z = jnp.sum(m_T * lse_T**2) / n
    return load_E, z, balance

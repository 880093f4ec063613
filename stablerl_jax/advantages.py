"""Group baselines. Groups are G consecutive responses of one prompt.

Letters: B responses (a multiple of G), G group size.

    group_mean     Â_i = R_i − mean_g R                     (MiniRL, PAPER.md §4)
    group_norm     Â_i = (R_i − mean_g R) / (std_g R + eps)  (GRPO; 0 for a zero-variance group)
    leave_one_out  Â_i = R_i − mean_{j≠i} R_j = G/(G−1) · (R_i − mean_g R)   (RLOO)
"""
from __future__ import annotations

import jax.numpy as jnp


def _groups(rewards_B, group_size: int):
    rewards_B = jnp.asarray(rewards_B, jnp.float32)
    if rewards_B.ndim != 1 or rewards_B.shape[0] % group_size:
        raise ValueError(f"rewards: shape {rewards_B.shape} must be [B] with B a multiple of "
                         f"group_size={group_size}")
    return rewards_B.reshape(-1, group_size)


def group_mean(rewards_B, group_size: int):
    r = _groups(rewards_B, group_size)
    return (r - r.mean(axis=1, keepdims=True)).reshape(-1)


def group_norm(rewards_B, group_size: int, eps: float = 1e-6):
    """Population std (ddof=0). A group whose rewards are all equal gets Â = 0 exactly,
    not 0/eps noise."""
    r = _groups(rewards_B, group_size)
    centered = r - r.mean(axis=1, keepdims=True)
    std = r.std(axis=1, keepdims=True)
    return jnp.where(std > 0, centered / (std + eps), 0.0).reshape(-1)


def leave_one_out(rewards_B, group_size: int):
    if group_size < 2:
        raise ValueError(f"leave_one_out: group_size={group_size} must be >= 2")
    return group_mean(rewards_B, group_size) * (group_size / (group_size - 1))


ADVANTAGES = {
    "group_mean": group_mean,
    "group_norm": group_norm,
    "leave_one_out": leave_one_out,
}

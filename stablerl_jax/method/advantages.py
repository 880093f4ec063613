"""Group baselines; a group is G consecutive responses of one prompt. Letters: B responses
(B = Q·G), Q prompts (groups), G group size.

    group_mean     Â_i = R_i − mean_g R                          (MiniRL, docs/method.md §4)
    group_norm     Â_i = (R_i − mean_g R) / (std_g R + eps)       (GRPO, App. A)
    leave_one_out  Â_i = R_i − mean_{j≠i} R_j = G/(G−1) · (R_i − mean_g R)   (RLOO)

A group of equal rewards gets Â = 0 exactly under every baseline (no signal, no 0/eps
rounding noise). Rewards [B] (numpy or jax, any real dtype) in, float32 [B] out; jittable
with group_size static.
"""
from __future__ import annotations

import numbers

import jax.numpy as jnp


def _groups(rewards_B, group_size: int):
    if not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"group_size: must be a positive int, got {group_size!r}")
    rewards_B = jnp.asarray(rewards_B, jnp.float32)
    if rewards_B.ndim != 1 or rewards_B.shape[0] % group_size:
        raise ValueError(f"rewards: shape {rewards_B.shape} must be [B] with B a multiple of "
                         f"group_size={group_size}")
    return rewards_B.reshape(-1, group_size)


def _centered(r_QxG):
    """R − group mean, forced to exactly 0 in groups of equal rewards."""
    flat = jnp.max(r_QxG, axis=1, keepdims=True) == jnp.min(r_QxG, axis=1, keepdims=True)
    return jnp.where(flat, 0.0, r_QxG - r_QxG.mean(axis=1, keepdims=True)), flat


def group_mean(rewards_B, group_size: int):
    """Â_i = R_i − mean_g R (no std)."""
    centered, _ = _centered(_groups(rewards_B, group_size))
    return centered.reshape(-1)


def group_norm(rewards_B, group_size: int, eps: float = 1e-6, ddof: int = 0):
    """Â_i = (R_i − mean) / (std + eps); ddof=1: the sample std some GRPO implementations use."""
    if group_size - ddof < 1:
        raise ValueError(f"group_norm: ddof={ddof} needs group_size > ddof, got {group_size}")
    r = _groups(rewards_B, group_size)
    centered, flat = _centered(r)
    std = jnp.sqrt(jnp.sum(centered**2, axis=1, keepdims=True) / (group_size - ddof))
    return jnp.where(flat, 0.0, centered / (std + eps)).reshape(-1)


def leave_one_out(rewards_B, group_size: int):
    """Â_i = R_i − mean of the group's other G − 1 rewards (RLOO)."""
    if group_size < 2:
        raise ValueError(f"leave_one_out: group_size={group_size} must be >= 2")
    return group_mean(rewards_B, group_size) * (group_size / (group_size - 1))


ADVANTAGES = {
    "group_mean": group_mean,
    "group_norm": group_norm,
    "leave_one_out": leave_one_out,
}


def compute(name: str, rewards_B, group_size: int, std_ddof: int = 0):
    """Â under baseline `name` (an ADVANTAGES key); `std_ddof`
    (LossConfig.advantage_std_ddof) reaches only group_norm."""
    if name == "group_norm":
        return group_norm(rewards_B, group_size, ddof=std_ddof)
    return ADVANTAGES[name](rewards_B, group_size)

"""Dynamic sampling (DAPO; `rl.dynamic_sampling`, docs/method.md §9): a step's batch of Q groups
whose rewards differ, sampled in rounds.

Letters: Q groups (prompts, rl.prompts_per_step) of G responses, B = Q·G rows, S rollout slots,
L layers, K top-k, R rounds at most (rl.max_sampling_rounds).

A group of G equal rewards gets Â = 0 under every baseline (advantages.py): no learning signal,
only weight in the loss's denominators. Such groups are dropped, and rounds of Q prompts are
sampled until Q groups with a reward spread fill the batch:

- Round 0 of global step k samples the step's own prompts (data/task.py) with its key; round
  r ≥ 1 batch k·(R − 1) + r − 1 of an independent seeded stream (`round_batch`, `round_key`): a
  pure function of (seed, k, r), so a resumed run samples what the uninterrupted run did.
- The rewards are the advantages' (with rl.overlong=penalty's length penalty), gathered, so every
  process keeps the same groups.
- Kept groups fill the batch in drawn order (round, then group); any beyond Q go unused (`Fill`).
- After R rounds a short batch trains on what it has, still [B, ...] (the steps compile once):
  missing slots hold empty responses (`merge_rows`: the prompt alone, nothing scored), reward 0,
  so Â = 0 and no loss aggregation counts them (losses.py).

Metrics (`Fill.metrics`): `dynamic/kept_frac` (groups with a spread / sampled, over the rounds),
`dynamic/rounds`, `dynamic/filled_frac` (real groups / Q; < 1 when rounds ran out).
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax.sampling.rollout import Rollout

ROUNDS_STREAM = 2  # the prompt stream of rounds r >= 1 (data/batching.py's `stream`)


def round_batch(step: int, round_: int, rounds: int) -> tuple[int, int]:
    """(batch index, stream) in data/task.py's `train_indices` of round `round_` of global step
    `step` (module docstring; rounds r >= 1 draw from stream `ROUNDS_STREAM`)."""
    if round_ == 0:
        return step, 0
    return step * (rounds - 1) + round_ - 1, ROUNDS_STREAM


def round_key(seed: int, step: int, round_: int):
    """Sampler key of round `round_` of global step `step`: the step's key, folded with r ≥ 1."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return key if round_ == 0 else jax.random.fold_in(key, round_)


def spread_groups(rewards_B, group_size: int) -> np.ndarray:
    """[Q] bool: each group of `group_size` consecutive rewards holds two that differ."""
    r_QxG = np.asarray(rewards_B).reshape(-1, group_size)
    return r_QxG.max(axis=1) != r_QxG.min(axis=1)


@dataclasses.dataclass
class Fill:
    """One step's batch as its rounds fill it, on the host (the same on every process)."""

    q: int
    g: int
    prompts: list = dataclasses.field(default_factory=list)  # each filled slot's prompt
    rewards: list = dataclasses.field(default_factory=list)  # each filled slot's [G]
    sampled: list = dataclasses.field(default_factory=list)  # each round's Q prompts
    kept: int = 0  # groups with a spread, over the rounds

    @property
    def filled(self) -> int:
        return len(self.prompts)

    @property
    def full(self) -> bool:
        return self.filled == self.q

    def add(self, prompts_Q, rewards_B) -> np.ndarray:
        """Take a round's groups with a reward spread (`prompts_Q`: train-split indices,
        `rewards_B`) into free slots; returns src_B: each batch row's source row (-1: keep)."""
        rewards_B = np.asarray(rewards_B)
        keep_Q = spread_groups(rewards_B, self.g)
        self.sampled.append([int(i) for i in prompts_Q])
        self.kept += int(keep_Q.sum())
        take = np.flatnonzero(keep_Q)[:self.q - self.filled]
        src_Q = np.full(self.q, -1)
        src_Q[self.filled:self.filled + len(take)] = take
        r_QxG = rewards_B.reshape(self.q, self.g)
        self.prompts += [int(prompts_Q[i]) for i in take]
        self.rewards += [r_QxG[i] for i in take]
        rows_QxG = src_Q[:, None] * self.g + np.arange(self.g)
        return np.where(src_Q[:, None] >= 0, rows_QxG, -1).reshape(-1).astype(np.int32)

    def real_B(self) -> np.ndarray:
        """[B] bool: the rows of filled slots (the rest are padding)."""
        return np.repeat(np.arange(self.q) < self.filled, self.g)

    def rewards_B(self, dtype=np.float32) -> np.ndarray:
        """The batch's rewards, every row: each filled slot's, 0 on padding (Â = 0)."""
        out = np.zeros((self.q, self.g), dtype)
        if self.rewards:
            out[:self.filled] = np.stack(self.rewards)
        return out.reshape(-1)

    def metrics(self) -> dict:
        rounds = len(self.sampled)
        return {"dynamic/kept_frac": self.kept / (rounds * self.q),
                "dynamic/rounds": float(rounds),
                "dynamic/filled_frac": self.filled / self.q}


class ShortBatches:
    """Watches `dynamic/filled_frac`: warns once at a short batch (under prompts_per_step groups
    with a reward spread) and stops the run after `limit` empty ones in a row."""

    def __init__(self, limit: int):
        self.limit, self.empty_in_a_row, self.warned = limit, 0, False

    def check(self, step: int, metrics: dict) -> None:
        filled = metrics.get("dynamic/filled_frac")
        if filled is None:
            return
        if filled < 1 and not self.warned:
            self.warned = True
            logging.warning(
                "rl.dynamic_sampling: step %d trained on %.0f%% of a batch (the other groups' "
                "rewards were all equal in every round); `dynamic/filled_frac` and "
                "summary.json's `short_batches` count such steps; more rounds "
                "(rl.max_sampling_rounds) or data whose rewards vary fill it", step,
                100 * filled)
        self.empty_in_a_row = self.empty_in_a_row + 1 if filled == 0 else 0
        if self.empty_in_a_row >= self.limit:
            raise ValueError(
                f"rl.dynamic_sampling: {self.empty_in_a_row} steps in a row (up to step "
                f"{step}) found no group whose rewards differ in {metrics['dynamic/rounds']:.0f}"
                " rounds, so they trained on nothing; check the rewards of this data, raise "
                "rl.max_sampling_rounds, or set rl.dynamic_sampling=false (the limit is "
                "rl.max_consecutive_skips)")


def merge_rows(base: Rollout, new: Rollout, src_B, real_B, *, pad_id: int) -> Rollout:
    """Row b of `new`'s row src_B[b] where src_B[b] >= 0, else `base`'s (every leaf); rows with
    real_B[b] false become empty responses: the prompt alone, pad completion, unscored (mask off,
    log μ 0, routes −1, weights 0), length 0, not truncated. Jitted by rl/engine.py
    (`Engine.merge_rows`), with fixed shapes: compiled once."""
    take_B = src_B >= 0
    rows_B = jnp.maximum(src_B, 0)
    by_row = lambda m_B, x: m_B.reshape(m_B.shape + (1,) * (x.ndim - 1))
    out = jax.tree.map(lambda b, n: jnp.where(by_row(take_B, b), n[rows_B], b), base, new)
    drop_BxS = out.completion_mask_BxS & ~real_B[:, None]
    by_slot = lambda x: drop_BxS.reshape(drop_BxS.shape + (1,) * (x.ndim - 2))
    weights = out.route_weights_mu_BxSxLxK
    truncated = out.truncated_B
    return out._replace(
        tokens_BxS=jnp.where(drop_BxS, pad_id, out.tokens_BxS),
        completion_mask_BxS=out.completion_mask_BxS & real_B[:, None],
        lengths_B=jnp.where(real_B, out.lengths_B, 0),
        logp_mu_BxS=jnp.where(drop_BxS, 0.0, out.logp_mu_BxS),
        routes_mu_BxSxLxK=jnp.where(by_slot(out.routes_mu_BxSxLxK), -1,
                                    out.routes_mu_BxSxLxK),
        route_weights_mu_BxSxLxK=None if weights is None else jnp.where(
            by_slot(weights), 0.0, weights),
        truncated_B=None if truncated is None else truncated & real_B)

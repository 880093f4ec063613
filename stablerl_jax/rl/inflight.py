"""Partial rollouts under a staleness bound (rl.max_staleness = S ≥ 1): the sampler's queue
carried from one global step to the next.

Letters: I = B + n queued responses, B = Q·G per step (Q prompts), n sampler slots (`slots`),
S prompt + completion slots, L layers, K top-k.

The queue holds I responses in groups of G, drawn from a prompt stream: group g is prompt g mod Q
of global step g // Q (`data.train_indices`), so a run draws a static run's prompts in order,
only earlier. Response j of group g uses the static sampler's key of its row (row (g mod Q)·G + j
of fold_in(key(seed), g // Q) split into B), folded with the attempt number after a drop: its
tokens depend only on (seed, step, prompt, response index, attempt, position) and the weights
drawing them.

Global step k (parameters of version k):
1. Responses holding a token older than version k − S, finished or not, are reset (dropped,
   counted): every token of step k's batch is at most S versions old.
2. Consumed groups leave; the queue is compacted (order kept) and topped up to I.
3. `continuous.run` at version k resumes unfinished responses (re-prefilled over prompt +
   completion so far) and stops once Q groups are complete.
4. The batch is the Q earliest complete groups; the rest carries to step k + 1.

S = 0 is not this path (the loop samples with `rl/engine` sample). The host-numpy state is saved
with every checkpoint (`state_dict` / `from_state_dict`): a resume continues the same responses.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import numpy as np

from stablerl_jax.sampling import continuous

if TYPE_CHECKING:  # the Engine and its steps need no data stack
    from stablerl_jax.data.task import TaskData

EMPTY = -1  # group id of a queue place that holds no prompt yet


def slots(cfg) -> int:
    """n = sampling.max_batch (0: B). Unlike the static and S = 0 samplers n may exceed B: fewer
    decode steps per step, more (older) responses in flight across steps."""
    return cfg.sampling.max_batch or cfg.rl.prompts_per_step * cfg.rl.group_size


@dataclasses.dataclass
class Inflight:
    """The carried queue (numpy leaves of a `continuous.Queue`) with each group's stream index
    (EMPTY: none), each response's attempt, the stream's next group and the drops so far."""

    queue: continuous.Queue
    group_ids: np.ndarray   # [I / G] int32
    attempts_I: np.ndarray  # int32
    next_group: int = 0
    dropped: int = 0

    @classmethod
    def create(cls, cfg, pad_id: int) -> "Inflight":
        """Empty queue of B + n places for `cfg`, each EMPTY and finished (not sampled)."""
        rl, g = cfg.rl, cfg.rl.group_size
        b = rl.prompts_per_step * g
        num_i = b + slots(cfg)
        p = cfg.task.max_prompt_len
        q = continuous.new_queue(np.full((num_i, p), pad_id, np.int32),
                                 np.ones((num_i, p), bool), jax.random.key(0), cfg.model,
                                 cfg.sampling, pad_id)
        q = jax.tree.map(np.array, q)._replace(finished_I=np.ones((num_i,), bool))
        return cls(q, np.full((num_i // g,), EMPTY, np.int32),
                   np.zeros((num_i,), np.int32))

    # -- checkpoint ------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"queue": self.queue._asdict(), "group_ids": self.group_ids,
                "attempts_I": self.attempts_I,
                "counters": np.asarray([self.next_group, self.dropped], np.int32)}

    @classmethod
    def from_state_dict(cls, d: dict) -> "Inflight":
        host = lambda x: np.array(jax.device_get(x))
        queue = continuous.Queue(**{k: host(v) for k, v in d["queue"].items()})
        next_group, dropped = (int(x) for x in host(d["counters"]))
        return cls(queue, host(d["group_ids"]), host(d["attempts_I"]), next_group, dropped)

    # -- one global step -------------------------------------------------------------

    def prepare(self, step: int, cfg, data: TaskData, pad_id: int) -> int:
        """Steps 1 and 2 (module docstring) at global step `step`; returns the stale drops."""
        g, q = cfg.rl.group_size, self.queue
        p = cfg.task.max_prompt_len
        # 1. Staleness: a token of version v is step − v versions old at this step.
        has_old = ((q.version_IxS >= 0) & (q.version_IxS < step - cfg.rl.max_staleness)).any(1)
        stale = has_old & (np.repeat(self.group_ids, g) != EMPTY)
        self._reset(np.flatnonzero(stale), cfg, p, pad_id, retry=True)
        self.dropped += int(stale.sum())
        # 2. Compact (consumed groups were set EMPTY by `take`) and top up.
        keep = np.flatnonzero(self.group_ids != EMPTY)
        order = np.concatenate([keep, np.flatnonzero(self.group_ids == EMPTY)])
        rows = (order[:, None] * g + np.arange(g)).reshape(-1)
        self.queue = jax.tree.map(lambda x: x[rows], self.queue)
        self.group_ids, self.attempts_I = self.group_ids[order], self.attempts_I[rows]
        for place in range(len(keep), len(self.group_ids)):
            self._start_group(place, cfg, data, pad_id)
        return int(stale.sum())

    def _start_group(self, place: int, cfg, data: TaskData, pad_id: int) -> None:
        """Queue place `place` takes the stream's next prompt (G new responses)."""
        rl, g = cfg.rl, cfg.rl.group_size
        gid, self.next_group = self.next_group, self.next_group + 1
        step, i = divmod(gid, rl.prompts_per_step)
        prompt = int(data.train_indices(step, rl.prompts_per_step, rl.seed)[i])
        tokens, mask, _ = data.prompt_batch([data.train[prompt]], g)
        rows = np.arange(place * g, (place + 1) * g)
        self.group_ids[place] = gid
        self.attempts_I[rows] = 0
        self.queue.tokens_IxS[rows, :tokens.shape[1]] = tokens
        self.queue.prompt_mask_IxS[rows, :mask.shape[1]] = mask
        self._reset(rows, cfg, tokens.shape[1], pad_id, retry=False)

    def _reset(self, rows, cfg, p: int, pad_id: int, retry: bool) -> None:
        """Reset `rows` to not started (prompt kept); retries fold the attempt into the key."""
        if not len(rows):
            return
        q, g, rl = self.queue, cfg.rl.group_size, cfg.rl
        q.tokens_IxS[rows, p:] = pad_id
        q.completion_IxS[rows] = False
        q.logp_IxS[rows] = 0
        q.routes_IxSxLxK[rows] = -1
        q.route_weights_IxSxLxK[rows] = 0
        q.version_IxS[rows] = -1
        q.progress_I[rows] = 0
        q.finished_I[rows] = False
        q.stopped_I[rows] = False
        if retry:
            self.attempts_I[rows] += 1
        step_keys = {}  # a step's B row keys, split once per call
        for r in rows:
            step, i = divmod(int(self.group_ids[r // g]), rl.prompts_per_step)
            if step not in step_keys:
                step_keys[step] = jax.random.split(
                    jax.random.fold_in(jax.random.key(rl.seed), step), rl.prompts_per_step * g)
            key = step_keys[step][i * g + r % g]
            if self.attempts_I[r]:
                key = jax.random.fold_in(key, int(self.attempts_I[r]))
            q.keys_Ix2[r] = np.asarray(jax.random.key_data(key))

    def take(self, cfg) -> tuple[np.ndarray, np.ndarray]:
        """Step 4: (queue rows of the batch [B], their groups' stream indices [Q]): the Q
        earliest complete groups, which leave the queue."""
        rl, g = cfg.rl, cfg.rl.group_size
        complete = self.queue.finished_I.reshape(-1, g).all(1) & (self.group_ids != EMPTY)
        places = np.flatnonzero(complete)[:rl.prompts_per_step]
        if len(places) < rl.prompts_per_step:
            raise RuntimeError(f"the sampler returned {len(places)} complete groups, "
                               f"{rl.prompts_per_step} needed")
        gids = self.group_ids[places].copy()
        self.group_ids[places] = EMPTY
        return (places[:, None] * g + np.arange(g)).reshape(-1), gids

    def prompt_indices(self, gids, cfg, data: TaskData) -> np.ndarray:
        """The train-split index of each stream group."""
        q = cfg.rl.prompts_per_step
        return np.asarray([int(data.train_indices(int(x) // q, q, cfg.rl.seed)[int(x) % q])
                           for x in gids])


def age_stats(version_BxS, completion_BxS, step: int, max_staleness: int) -> dict:
    """`async/…`: mean and max completion-token age (step − version), share of ages 0 … S."""
    age = (step - np.asarray(version_BxS))[np.asarray(completion_BxS, bool)]
    out = {"async/staleness_mean": float(age.mean()) if age.size else 0.0,
           "async/staleness_max": float(age.max()) if age.size else 0.0}
    for a in range(max_staleness + 1):
        out[f"async/age_{a}_frac"] = float((age == a).mean()) if age.size else 0.0
    return out


def age_of_tokens(version_BxS, completion_BxS, step: int) -> np.ndarray:
    """[B, S] int32: each completion token's age (step − version); elsewhere the age of
    the row's oldest token (what π_old's pass over the prompt uses, rl/step_fns.py)."""
    comp = np.asarray(completion_BxS, bool)
    age = np.where(comp, step - np.asarray(version_BxS), 0)
    return np.where(comp, age, age.max(axis=1, keepdims=True)).astype(np.int32)

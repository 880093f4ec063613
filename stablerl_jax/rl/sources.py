"""Where a step's responses come from (hops 1–3 of rl/loop.py): one record for every source, so
the step reads sample → reward → score → updates → metrics whatever made them.

    Static        the step's prompts, sampled once (the default)
    DynamicRounds rounds until groups with a reward spread fill the batch (rl/dynamic.py)
    Partial       complete groups of the carried partial-rollout queue (rl/inflight.py)
    FromFile      an external engine's rollout file (rl.offline_rollouts, interop/rollouts.py)

Each is a `Source` owning what it carries between steps: `responses` gives a step's `Responses`,
`old_params` the parameters π_old is computed at; `before_update` is told when the updates are
about to change θ; `state_dict` / `load_state_dict` are its checkpoint part. `for_run` picks the
run's: a new source is one class here and one line there.
"""
from __future__ import annotations

import abc
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax import distributed
from stablerl_jax.data.task import TaskData
from stablerl_jax.interop.rollouts import OfflineRollouts
from stablerl_jax.method import overlong
from stablerl_jax.rl import costs, dynamic, evals, step_fns
from stablerl_jax.rl.engine import Engine
from stablerl_jax.rl.inflight import EMPTY, Inflight, age_of_tokens, age_stats
from stablerl_jax.sampling import continuous
from stablerl_jax.sampling import rollout as rollout_lib


class HostRows(NamedTuple):
    """What the loop reads on the host of a step's responses: this process's rows (every round
    under dynamic sampling); `distributed.gather` gives every process all rows."""

    rewards: np.ndarray    # the task's reward
    lengths: np.ndarray    # completion tokens
    truncated: np.ndarray  # no stop id within max_new_tokens
    penalty: np.ndarray    # DAPO's length penalty (rl.overlong=penalty), else 0


class Responses(NamedTuple):
    """A step's responses, as every source returns them."""

    rollout: rollout_lib.Rollout  # the batch the score step reads, B rows
    host: HostRows                # this process's rows of every response sampled
    rewards: np.ndarray           # this process's rows of the advantages' rewards
    provenance: dict              # {"prompts": …} or {"responses": …} (minibatches.jsonl)
    samples: list                 # decoded samples, evals.sample_rows
    age_BxS: np.ndarray | None    # each token's age in versions, where it scores at its own
                                  # version (Partial, rl.old_policy=behavior); else None
    metrics: dict                 # the source's own (`async/…`, `dynamic/…`)
    decode_steps: float | None    # the sampler's, None for a file


class Source(abc.ABC):
    """A run's rollout source: subclasses write `responses`; defaults: π_old at θ, no state."""

    @abc.abstractmethod
    def responses(self, engine: Engine, state: step_fns.TrainState, data: TaskData, step: int,
                  timer: costs.PhaseTimer, log_samples: int = 0) -> Responses:
        """The step's responses (`Responses`)."""

    def old_params(self, params):
        """The parameters π_old is computed at: the step's θ (`params`)."""
        return params

    def before_update(self, params) -> None:
        """Called once the step is scored, before its updates change θ (`params`)."""

    def state_dict(self) -> dict:
        """What it carries into the next step, saved beside the train state."""
        return {}

    def load_state_dict(self, saved: dict) -> None:
        """Takes its keys out of a restored checkpoint's dict (`state_dict`'s)."""


def host_rows(cfg, rewards, lengths, truncated) -> HostRows:
    """This process's HostRows, with DAPO's length penalty under rl.overlong=penalty."""
    rl = cfg.rl
    penalty = np.zeros_like(rewards)
    if rl.overlong == "penalty":
        penalty = overlong.length_penalty(lengths, cfg.sampling.max_new_tokens,
                                          rl.overlong_buffer, rl.overlong_penalty_factor)
    return HostRows(rewards, lengths, truncated, penalty)


def _rewarded(cfg, data: TaskData, rollout, tokens, mask, answers, timer, log_samples):
    """(HostRows, decoded samples) of this process's rows of a sampled rollout; the sharded
    lengths and host-only rewards ride the step's one HostRows gather, not a collective each."""
    with timer.phase("reward"):
        rewards, extractors = data.reward_with_source(rollout, answers)
    host = host_rows(cfg, rewards, distributed.local_rows(rollout.lengths_B),
                     distributed.local_rows(rollout.truncated_B))
    samples = evals.sample_rows(data, tokens, mask, rollout, rewards, answers, extractors,
                                log_samples, split="train")
    return host, samples


class Static(Source):
    """The step's rl.prompts_per_step prompts (seeded by step), G responses each."""

    def responses(self, engine, state, data, step, timer, log_samples=0) -> Responses:
        rl = engine.cfg.rl
        prompt_idx = data.train_indices(step, rl.prompts_per_step, rl.seed)
        mine = prompt_idx[distributed.rows_of_process(rl.prompts_per_step)]
        tokens, mask, answers = data.prompt_batch([data.train[i] for i in mine], rl.group_size)
        key = jax.random.fold_in(jax.random.key(rl.seed), step)
        with timer.phase("sample"):
            rollout, decode_steps = engine.sample_counted(state.params, tokens, mask, key)
            decode_steps = int(distributed.host(decode_steps))
        host, samples = _rewarded(engine.cfg, data, rollout, tokens, mask, answers, timer,
                                  log_samples)
        return Responses(rollout, host, host.rewards + host.penalty,
                         {"prompts": [int(i) for i in prompt_idx]}, samples, None, {},
                         decode_steps)


class DynamicRounds(Source):
    """Rounds of Q prompts until Q groups with a reward spread fill the batch, at most
    rl.max_sampling_rounds (rl/dynamic.py; a short batch is padded with empty responses). `host`
    holds every round's responses; the provenance lists the real groups' prompts (rows from
    len(prompts)·G on are padding) and "sampled" (each round's); the samples are round 0's."""

    def responses(self, engine, state, data, step, timer, log_samples=0) -> Responses:
        cfg = engine.cfg
        rl = cfg.rl
        q, g = rl.prompts_per_step, rl.group_size
        fill = dynamic.Fill(q, g)
        batch, samples, sampled, decode_steps = None, [], [], 0
        for r in range(rl.max_sampling_rounds):
            index, stream = dynamic.round_batch(step, r, rl.max_sampling_rounds)
            prompt_idx = data.train_indices(index, q, rl.seed, stream)
            mine = prompt_idx[distributed.rows_of_process(q)]
            tokens, mask, answers = data.prompt_batch([data.train[i] for i in mine], g)
            with timer.phase("sample"):
                rollout, steps_ = engine.sample_counted(state.params, tokens, mask,
                                                        dynamic.round_key(rl.seed, step, r))
                decode_steps += int(distributed.host(steps_))
            host, round_samples = _rewarded(cfg, data, rollout, tokens, mask, answers, timer,
                                            log_samples if r == 0 else 0)
            sampled.append(host)
            samples = samples or round_samples
            # Gathered: every process reads the same rewards and keeps the same groups.
            scored_B = distributed.gather(host.rewards + host.penalty)
            src_B = fill.add(prompt_idx, scored_B)
            if r == 0 and fill.full:  # every group kept, in place
                batch = rollout
            else:
                with timer.phase("sample"):
                    batch = engine.merge_rows(rollout if batch is None else batch, rollout,
                                              src_B, fill.real_B())
            if fill.full:
                break
        host = HostRows(*(np.concatenate(x) for x in zip(*sampled)))
        rewards = fill.rewards_B(scored_B.dtype)[distributed.rows_of_process(q * g)]
        return Responses(batch, host, rewards,
                         {"prompts": fill.prompts, "sampled": fill.sampled}, samples, None,
                         fill.metrics(), decode_steps)


class Partial(Source):
    """The first complete groups of the carried queue (rl/inflight.py); under
    rl.old_policy=behavior also the S parameter versions before the step's (newest first), each
    token's π_old at its own (`age_BxS`, cut to Engine.trim's window). Checkpoint keys:
    "inflight", "history". Every process keeps the whole queue on the host (identical: derived
    from the seed and sampled tokens), samples its block of rows and gathers the queue back."""

    def __init__(self, cfg, pad_id: int, params):
        self.inflight = Inflight.create(cfg, pad_id)
        self.behavior = cfg.rl.old_policy == "behavior"
        self.versions = cfg.rl.max_staleness
        self.history = ([jax.tree.map(jnp.copy, params) for _ in range(self.versions)]
                        if self.behavior else [])

    def old_params(self, params):
        return (params, *self.history) if self.behavior else params

    def before_update(self, params) -> None:
        if self.behavior:  # θ_k becomes the newest past version (copied: the updates
            # donate the state)
            self.history.insert(0, jax.tree.map(jnp.copy, params))
            del self.history[self.versions:]

    def state_dict(self) -> dict:
        return {"inflight": self.inflight.state_dict(), "history": list(self.history)}

    def load_state_dict(self, saved: dict) -> None:
        self.inflight = Inflight.from_state_dict(saved.pop("inflight"))
        self.history = list(saved.pop("history"))

    def responses(self, engine, state, data, step, timer, log_samples=0) -> Responses:
        cfg = engine.cfg
        with timer.phase("sample"):
            dropped = self.inflight.prepare(step, cfg, data, data.tokenizer.pad_id)
            mine_n = distributed.rows_of_process(len(self.inflight.attempts_I))
            queue, decode_steps = engine.sample_partial(
                state.params, jax.tree.map(lambda x: x[mine_n], self.inflight.queue), step)
            # One gather of every field (np.array: the queue's arrays are written in place).
            self.inflight.queue = jax.tree.map(np.array, distributed.gather(
                jax.tree.map(distributed.local_rows, queue)))
        rows, gids = self.inflight.take(cfg)
        q = jax.tree.map(lambda x: x[rows], self.inflight.queue)
        prompt_idx = self.inflight.prompt_indices(gids, cfg, data)
        g, p = cfg.rl.group_size, cfg.task.max_prompt_len
        carried = self.inflight.group_ids != EMPTY
        metrics = {**age_stats(q.version_IxS, q.completion_IxS, step, cfg.rl.max_staleness),
                   "async/dropped": float(dropped),
                   "async/decode_steps": float(distributed.host(decode_steps)),
                   "async/carried_tokens": float(self.inflight.queue.completion_IxS[
                       np.repeat(carried, g)].sum())}
        age_BxS = age_of_tokens(q.version_IxS, q.completion_IxS, step) if self.behavior else None
        if age_BxS is not None and cfg.rl.trim_bucket:  # the window Engine.trim cuts
            lo, hi = rollout_lib.used_window(np.any(q.prompt_mask_IxS | q.completion_IxS, 0),
                                             cfg.rl.trim_bucket)
            age_BxS = age_BxS[:, lo:hi]
        mine = distributed.rows_of_process(len(rows))
        answers = [data.train[i]["answer"] for i in prompt_idx for _ in range(g)][mine]
        rollout = jax.tree.map(np.asarray, continuous.to_rollout(q))
        host, samples = _rewarded(cfg, data, rollout, q.tokens_IxS[mine, :p],
                                  q.prompt_mask_IxS[mine, :p], answers, timer, log_samples)
        rollout, age_BxS = jax.tree.map(distributed.local_rows, (rollout, age_BxS))
        return Responses(rollout, host, host.rewards + host.penalty,
                         {"prompts": [int(i) for i in prompt_idx]}, samples, age_BxS,
                         metrics, metrics["async/decode_steps"])


class FromFile(Source):
    """Offline-file responses (recorded by vLLM or SGLang); provenance: their indices."""

    def __init__(self, offline: OfflineRollouts):
        self.offline = offline

    def responses(self, engine, state, data, step, timer, log_samples=0) -> Responses:
        cfg = engine.cfg
        with timer.phase("sample"):  # the file's responses stand for the sampler's
            b = cfg.rl.prompts_per_step * cfg.rl.group_size
            rows = np.arange(step * b, (step + 1) * b)
            rollout, rewards, answers = self.offline.batch(
                rows, max_prompt_len=cfg.task.max_prompt_len,
                max_new_tokens=cfg.sampling.max_new_tokens, pad_id=data.tokenizer.pad_id,
                num_layers=cfg.model.num_layers, top_k=cfg.model.top_k,
                num_experts=cfg.model.num_experts)
            mine = distributed.rows_of_process(b)
            if rollout.truncated_B is None:  # a file's rows: no stop id within max_new_tokens
                rollout = rollout._replace(truncated_B=rollout_lib.truncated_rows(
                    rollout.tokens_BxS, rollout.completion_mask_BxS, data.tokenizer.stop_ids,
                    cfg.sampling.max_new_tokens))
            if rewards is None:
                rewards = data.reward(rollout, list(answers)[mine])
            else:
                rewards = np.asarray(rewards)[mine]
            rollout = jax.tree.map(lambda x: np.asarray(x)[mine], rollout)
        host = host_rows(cfg, rewards, rollout.lengths_B, rollout.truncated_B)
        return Responses(rollout, host, host.rewards + host.penalty,
                         {"responses": [int(i) for i in rows]}, [], None, {}, None)


def for_run(cfg, offline: OfflineRollouts | None, pad_id: int, params) -> Source:
    """The run's source, state fresh (`params`: the first θ). The config refuses dynamic sampling
    with offline or partial rollouts, and offline with partial ones."""
    if cfg.rl.dynamic_sampling:
        return DynamicRounds()
    if offline is not None:
        return FromFile(offline)
    if cfg.rl.max_staleness:
        return Partial(cfg, pad_id, params)
    return Static()

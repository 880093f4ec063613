"""Where a global step's responses come from (hops 1–3 of rl/loop.py): one record for
every source, so the step reads sample → reward → score → updates → metrics whatever
made the responses.

    static     the step's prompts, sampled once (the default)
    dynamic    rounds of prompts until groups with a reward spread fill the batch
               (rl.dynamic_sampling, rl/dynamic.py)
    partial    the first complete groups of the carried queue of partial rollouts
               (rl.max_staleness ≥ 1, rl/inflight.py)
    from_file  an offline rollout file recorded by an external engine (rl.offline_rollouts,
               interop/rollouts.py)

Each is a `Source`: (engine, state, data, step, timer, log_samples) -> `Responses`;
`for_run` picks the run's. A new source is one function here and one line in `for_run`.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import numpy as np

from stablerl_jax import distributed
from stablerl_jax.data.task import TaskData
from stablerl_jax.interop.rollouts import OfflineRollouts
from stablerl_jax.method import overlong
from stablerl_jax.rl import costs, dynamic, evals, steps
from stablerl_jax.rl.engine import Engine
from stablerl_jax.rl.inflight import EMPTY, Inflight, age_of_tokens, age_stats
from stablerl_jax.sampling import continuous
from stablerl_jax.sampling import rollout as rollout_lib


class HostRows(NamedTuple):
    """What the loop reads on the host of a step's responses, this process's rows (all
    rounds under dynamic sampling); `distributed.gather` gives every process all rows."""

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
    age_BxS: np.ndarray | None    # each token's age in versions (partial), else None
    metrics: dict                 # the source's own (`async/…`, `dynamic/…`)
    decode_steps: float | None    # the sampler's, None for a file


Source = Callable[..., Responses]


def host_rows(cfg, rewards, lengths, truncated) -> HostRows:
    """This process's HostRows, with DAPO's length penalty under rl.overlong=penalty."""
    rl = cfg.rl
    penalty = np.zeros_like(rewards)
    if rl.overlong == "penalty":
        penalty = overlong.length_penalty(lengths, cfg.sampling.max_new_tokens,
                                          rl.overlong_buffer, rl.overlong_penalty_factor)
    return HostRows(rewards, lengths, truncated, penalty)


def _rewarded(cfg, data: TaskData, rollout, tokens, mask, answers, timer, log_samples):
    """(HostRows, decoded samples) of a sampled rollout's rows of this process. The
    sampler's lengths are a batch-sharded global array whose other rows live on the
    other hosts' devices, and the rewards exist only here: all four ride the one
    HostRows gather of the step, where reading the global arrays whole would be a
    collective each."""
    with timer.phase("reward"):
        rewards, extractors = data.reward_with_source(rollout, answers)
    host = host_rows(cfg, rewards, distributed.local_rows(rollout.lengths_B),
                     distributed.local_rows(rollout.truncated_B))
    samples = evals.sample_rows(data, tokens, mask, rollout, rewards, answers, extractors,
                                log_samples, split="train")
    return host, samples


def static(engine: Engine, state: steps.TrainState, data: TaskData, step: int,
           timer: costs.PhaseTimer, log_samples: int = 0) -> Responses:
    """The step's rl.prompts_per_step prompts (seeded by step), G responses each."""
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


def dynamic_rounds(engine: Engine, state: steps.TrainState, data: TaskData, step: int,
                   timer: costs.PhaseTimer, log_samples: int = 0) -> Responses:
    """Rounds of Q prompts until Q groups with a reward spread fill the batch, at most
    rl.max_sampling_rounds (rl/dynamic.py; a short batch is padded with empty
    responses, reward 0). `host` holds every response sampled, all rounds; the
    provenance lists the batch's real groups' prompts (rows from len(prompts)·G on are
    padding) and "sampled" each round's Q prompts; the samples are round 0's."""
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
    return Responses(batch, host, rewards, {"prompts": fill.prompts, "sampled": fill.sampled},
                     samples, None, fill.metrics(), decode_steps)


def partial(inflight: Inflight, engine: Engine, state: steps.TrainState, data: TaskData,
            step: int, timer: costs.PhaseTimer, log_samples: int = 0) -> Responses:
    """The first complete groups of the carried queue (rl/inflight.py), this process's
    rows on the host; `age_BxS` is cut to the window Engine.trim cuts (rl.trim_bucket).

    Every process keeps the whole queue on the host (the same on each: everything in it
    is derived from the seed and the sampled tokens), hands its block of rows to the
    sampler, and gathers the sampled queue back."""
    cfg = engine.cfg
    with timer.phase("sample"):
        dropped = inflight.prepare(step, cfg, data, data.tokenizer.pad_id)
        mine_n = distributed.rows_of_process(len(inflight.attempts_I))
        queue, decode_steps = engine.sample_partial(
            state.params, jax.tree.map(lambda x: x[mine_n], inflight.queue), step)
        # One gather of every field (np.array: the queue's arrays are written in place).
        inflight.queue = jax.tree.map(np.array, distributed.gather(
            jax.tree.map(distributed.local_rows, queue)))
    rows, gids = inflight.take(cfg)
    q = jax.tree.map(lambda x: x[rows], inflight.queue)
    prompt_idx = inflight.prompt_indices(gids, cfg, data)
    g, p = cfg.rl.group_size, cfg.task.max_prompt_len
    carried = inflight.group_ids != EMPTY
    metrics = {**age_stats(q.version_IxS, q.completion_IxS, step, cfg.rl.max_staleness),
               "async/dropped": float(dropped),
               "async/decode_steps": float(distributed.host(decode_steps)),
               "async/carried_tokens": float(inflight.queue.completion_IxS[
                   np.repeat(carried, g)].sum())}
    age_BxS = age_of_tokens(q.version_IxS, q.completion_IxS, step)
    if cfg.rl.trim_bucket:  # the window Engine.trim cuts from the whole rollout
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
                     {"prompts": [int(i) for i in prompt_idx]}, samples, age_BxS, metrics,
                     metrics["async/decode_steps"])


def from_file(offline: OfflineRollouts, engine: Engine, state: steps.TrainState,
              data: TaskData, step: int, timer: costs.PhaseTimer,
              log_samples: int = 0) -> Responses:
    """The step's responses read from an offline rollout file (tokens, logp_mu, routes
    and rewards recorded by vLLM or SGLang), this process's rows on the host; the
    provenance lists their indices in the file."""
    cfg = engine.cfg
    with timer.phase("sample"):  # the file's responses stand for the sampler's
        b = cfg.rl.prompts_per_step * cfg.rl.group_size
        rows = np.arange(step * b, (step + 1) * b)
        rollout, rewards, answers = offline.batch(
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


def for_run(cfg, offline: OfflineRollouts | None, inflight: Inflight | None) -> Source:
    """The run's source (the config refuses dynamic sampling with offline or partial
    rollouts)."""
    if cfg.rl.dynamic_sampling:
        return dynamic_rounds
    if offline is not None:
        return functools.partial(from_file, offline)
    if inflight is not None:
        return functools.partial(partial, inflight)
    return static

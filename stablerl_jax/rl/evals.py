"""Held-out evaluation on named eval sets, and the decoded samples a run logs.

Letters: n problems of a set, k samples per problem, n' ≥ n padded problems.

Each set of `TaskData.evals` ({name: records}) is sampled k times per problem by the inference
engine and scored with the task's reward (data/accuracy.py):

    eval/<set>/avg@k          mean_ij r_ij
    eval/<set>/stderr         std_i(mean_j r_ij) / sqrt(n), avg@k's standard error over problems
    eval/<set>/pass@k         mean_i max_j r_ij
    eval/<set>/length_mean    mean completion length (tokens)
    eval/<set>/truncated_frac share of completions with no stop id in max_new_tokens

`eval/accuracy`, `eval/pass_at_k`, `eval/length_mean`, `eval/truncated_frac`: means over the
sets, weighed equally (as papers average AIME24, AIME25, HMMT25); `eval/accuracy_stderr` =
sqrt(Σ stderr²) / sets (independent sets). Any n works: the n·k rows are padded with copies of
the first problem to n'·k, a multiple of every size the batch is split by (data-parallel devices,
`sampling.max_batch`, processes); the padding's scores are dropped.
"""
from __future__ import annotations

import math

import jax
import numpy as np

from stablerl_jax import distributed
from stablerl_jax.data.accuracy import summarize

SUMMARY_KEYS = ("avg@k", "stderr", "pass@k", "length_mean", "truncated_frac")
MEAN_NAMES = {"avg@k": "eval/accuracy", "pass@k": "eval/pass_at_k",
              "length_mean": "eval/length_mean", "truncated_frac": "eval/truncated_frac"}


def padded_problems(n: int, k: int, multiple: int, processes: int = 1) -> int:
    """The least n' >= n with n'·k a multiple of `multiple` and n' of `processes`."""
    step = math.lcm(multiple // math.gcd(multiple, k), processes)
    return -(-n // step) * step


def batch_multiple(cfg) -> int:
    """The sizes an eval batch is split by: the mesh's devices and the sampler's slice."""
    dp = cfg.mesh[0] * cfg.mesh[1] * cfg.mesh[2]
    return math.lcm(dp, cfg.sampling.max_batch or 1)


def evaluate_set(sample, data, records, key, k: int, multiple: int):
    """(summary, this process's rows): `records` each sampled k times by `sample(tokens,
    mask, key) -> Rollout` and scored with `data.reward`; summary holds the module
    docstring's numbers, the rows feed `sample_rows`."""
    n = len(records)
    if not n:
        raise ValueError("evaluate_set: the eval set is empty")
    n_pad = padded_problems(n, k, multiple, jax.process_count())
    padded = list(records) + [records[0]] * (n_pad - n)
    mine = padded[distributed.rows_of_process(n_pad)]
    tokens, mask, answers = data.prompt_batch(mine, k)
    rollout = sample(tokens, mask, key)
    rewards_mine, extractors = data.reward_with_source(rollout, answers)
    per_row = [rewards_mine, distributed.local_rows(rollout.lengths_B),
               distributed.local_rows(rollout.truncated_B)]
    r_nxk, len_nxk, trunc_nxk = (x.reshape(n_pad, k)[:n] for x in distributed.gather(
        [np.asarray(x, np.float64) for x in per_row]))  # one gather
    summary = summarize(r_nxk)
    summary.update(length_mean=float(len_nxk.mean()), truncated_frac=float(trunc_nxk.mean()))
    return summary, (tokens, mask, rollout, rewards_mine, answers, extractors)


def evaluate_sets(sample, data, sets: dict, key, num_problems: int, k: int,
                  multiple: int, log_samples: int = 0):
    """(metrics, samples) of every set's first `num_problems` problems, sampled with fold_in(key,
    set index); `samples`: this process's first `log_samples` rows per set."""
    metrics, samples = {}, []
    for i, (name, records) in enumerate(sets.items()):
        summary, rows = evaluate_set(sample, data, records[:num_problems],
                                     jax.random.fold_in(key, i), k, multiple)
        metrics.update({f"eval/{name}/{s}": summary[s] for s in SUMMARY_KEYS})
        samples += sample_rows(data, *rows, log_samples, split=f"eval/{name}")
    for s, mean_name in MEAN_NAMES.items():
        metrics[mean_name] = float(np.mean([metrics[f"eval/{name}/{s}"] for name in sets]))
    metrics["eval/accuracy_stderr"] = float(np.sqrt(sum(
        metrics[f"eval/{name}/stderr"] ** 2 for name in sets)) / len(sets))
    return metrics, samples


def sample_rows(data, tokens_BxP, mask_BxP, rollout, rewards_B, answers, extractors,
                count: int, split: str) -> list[dict]:
    """The first `count` local rows as {split, prompt, response, ended, answer, reward,
    extractor, length, truncated}, decoded with every special token (`Tokenizer.decode_raw`): the
    prompt shows the chat template, the response ends with its stop token, `ended` is its text
    (`<|im_end|>`) or "truncated" (no stop id in max_new_tokens). The reward read the response
    without special tokens; `extractor`: its final-answer rule (data/answers.py)."""
    count = min(count, len(answers))
    if not count:
        return []
    tok = data.tokenizer
    toks_BxS = distributed.local_rows(rollout.tokens_BxS)
    comp_BxS = distributed.local_rows(rollout.completion_mask_BxS).astype(bool)
    lengths = distributed.local_rows(rollout.lengths_B)
    truncated = distributed.local_rows(rollout.truncated_B)
    tokens_BxP, mask_BxP = np.asarray(tokens_BxP), np.asarray(mask_BxP, bool)
    rows = []
    for b in range(count):
        prompt, response = tokens_BxP[b][mask_BxP[b]].tolist(), toks_BxS[b][comp_BxS[b]].tolist()
        rows.append({"split": split, "prompt": tok.decode_raw(prompt),
                     "response": tok.decode_raw(response),
                     "ended": "truncated" if truncated[b] else tok.decode_raw(response[-1:]),
                     "answer": str(answers[b]), "reward": float(rewards_B[b]),
                     "extractor": str(extractors[b]), "length": int(lengths[b]),
                     "truncated": bool(truncated[b])})
    return rows

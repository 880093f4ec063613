"""avg@k accuracy on held-out problems, given any sampler; n problems, k samples each.

    r_ij   = reward_fn(completion j of problem i, answer_i) ∈ {0, 1}
    avg@k  = mean_ij r_ij                   (the paper's metric, §4.2: avg@32)
    pass@k = mean_i max_j r_ij              (of these k samples, not the unbiased n > k one)
    stderr = std_i(mean_j r_ij) / sqrt(n)   (sampling noise of avg@k across problems)
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def scores(sample_fn: Callable[[list[str]], list[str]], prompts: Sequence[str],
           answers: Sequence[str], k: int, reward_fn: Callable[[str, str], float]) -> np.ndarray:
    """r [n, k]: scores of k completions per prompt, one call (each prompt k times in a row)."""
    if k <= 0:
        raise ValueError(f"k={k} must be > 0")
    if len(prompts) != len(answers) or not len(prompts):
        raise ValueError(f"avg_at_k: need as many answers as prompts (> 0), got "
                         f"{len(prompts)} prompts and {len(answers)} answers")
    completions = list(sample_fn([p for p in prompts for _ in range(k)]))
    if len(completions) != len(prompts) * k:
        raise ValueError(f"sample_fn returned {len(completions)} completions for "
                         f"{len(prompts)} prompts × k={k}")
    return np.asarray([reward_fn(c, a) for c, a in
                       zip(completions, [a for a in answers for _ in range(k)])],
                      np.float64).reshape(len(prompts), k)


def summarize(r_nxk: np.ndarray) -> dict:
    """{'avg@k', 'pass@k', 'stderr'} of a score matrix (module docstring), as floats."""
    per_problem_n = r_nxk.mean(axis=1)
    return {"avg@k": float(r_nxk.mean()), "pass@k": float((r_nxk.max(axis=1) > 0).mean()),
            "stderr": float(per_problem_n.std() / np.sqrt(len(r_nxk)))}


def avg_at_k(sample_fn: Callable[[list[str]], list[str]], prompts: Sequence[str],
             answers: Sequence[str], k: int, reward_fn: Callable[[str, str], float]) -> dict:
    """`summarize(scores(...))`: avg@k, pass@k and its standard error."""
    return summarize(scores(sample_fn, prompts, answers, k, reward_fn))

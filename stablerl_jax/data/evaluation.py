"""avg@k accuracy on held-out problems, given any sampler."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def avg_at_k(sample_fn: Callable[[list[str]], list[str]], prompts: Sequence[str],
             answers: Sequence[str], k: int, reward_fn) -> dict:
    """Sample k completions per prompt (one call with every prompt repeated k times).

    avg@k = mean reward over all k·n samples (the paper's metric); pass@k = fraction of
    problems with at least one correct sample.
    """
    if k <= 0:
        raise ValueError(f"k={k} must be > 0")
    completions = sample_fn([p for p in prompts for _ in range(k)])
    r = np.asarray([reward_fn(c, a) for c, a in
                    zip(completions, [a for a in answers for _ in range(k)])],
                   np.float32).reshape(len(prompts), k)
    return {"avg@k": float(r.mean()), "pass@k": float((r.max(axis=1) > 0).mean())}

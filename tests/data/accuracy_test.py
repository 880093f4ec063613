"""avg@k with a scripted sampler."""
import pytest

from stablerl_jax.data.accuracy import avg_at_k
from stablerl_jax.data.rewards import exact_match_reward


def test_avg_and_pass_at_k_by_hand():
    # Problem "a" is solved in 1 of 2 samples, "b" in none.
    script = iter(["#### 1", "#### 0", "#### 5", "#### 6"])
    res = avg_at_k(lambda ps: [next(script) for _ in ps], ["a", "b"], ["1", "7"], 2,
                   exact_match_reward)
    # Per-problem accuracies 0.5 and 0: std 0.25 over 2 problems -> stderr 0.25 / sqrt(2).
    assert res == {"avg@k": 0.25, "pass@k": 0.5, "stderr": 0.25 / 2**0.5}


def test_prompts_are_repeated_k_times_consecutively():
    seen = []

    def sampler(prompts):
        seen.extend(prompts)
        return [f"#### {p}" for p in prompts]  # echoes the prompt as its answer

    res = avg_at_k(sampler, ["3", "4"], ["3", "5"], 3, exact_match_reward)
    assert seen == ["3"] * 3 + ["4"] * 3
    assert res["avg@k"] == 0.5 and res["pass@k"] == 0.5
    with pytest.raises(ValueError, match="returned 1 completions"):
        avg_at_k(lambda ps: ps[:1], ["a"], ["1"], 2, exact_match_reward)
    with pytest.raises(ValueError, match="k=0"):
        avg_at_k(lambda ps: ps, ["a"], ["1"], 0, exact_match_reward)

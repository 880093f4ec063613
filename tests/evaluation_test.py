"""avg@k with a scripted sampler."""
import pytest

from stablerl_jax.data.evaluation import avg_at_k
from stablerl_jax.data.rewards import exact_match_reward


def test_avg_and_pass_at_k_by_hand():
    # Problem "a" is solved in 1 of 2 samples, "b" in none.
    script = iter(["#### 1", "#### 0", "#### 5", "#### 6"])
    res = avg_at_k(lambda ps: [next(script) for _ in ps], ["a", "b"], ["1", "7"], 2,
                   exact_match_reward)
    assert res == {"avg@k": 0.25, "pass@k": 0.5}
    with pytest.raises(ValueError, match="k=0"):
        avg_at_k(lambda ps: ps, ["a"], ["1"], 0, exact_match_reward)

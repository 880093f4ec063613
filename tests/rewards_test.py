"""Answer parsing and rewards: hand cases and fuzzing."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stablerl_jax.data import rewards as rw


def test_parse_by_hand():
    assert rw.parse_final_answer("3+4=7 #### 7") == "7"
    assert rw.parse_final_answer("#### 1\n#### -12") == "-12"
    assert rw.parse_final_answer("#### 1,000.") == "1000"
    assert rw.parse_final_answer("no answer") is None
    assert rw.parse_final_answer("####   ") is None
    assert rw.parse_final_answer(None) is None


def test_exact_match_by_hand():
    assert rw.exact_match_reward("1+2=3 #### 3", "3") == 1.0
    assert rw.exact_match_reward("#### 03", "3") == 1.0
    assert rw.exact_match_reward("#### 3", "-3") == 0.0
    assert rw.exact_match_reward("#### 3.0", "3") == 0.0
    assert rw.exact_match_reward("3", "3") == 0.0  # no answer line


def test_math_verify_and_batch():
    assert rw.math_verify_reward("#### 1/2", "0.5") == 1.0
    assert rw.math_verify_reward("#### 3", "4") == 0.0
    r = rw.rewards(["#### 5", "#### 4", "junk"], ["5", "5", "5"])
    np.testing.assert_array_equal(r, [1, 0, 0])
    assert r.dtype == np.float32
    np.testing.assert_array_equal(rw.rewards(["#### 4"], ["5"], format_weight=0.5), [0.5])


@settings(max_examples=300, deadline=None)
@given(st.text(), st.integers(-10**6, 10**6))
def test_parser_never_raises_and_never_rewards_a_wrong_answer(text, answer):
    parsed = rw.parse_final_answer(text)
    assert parsed is None or isinstance(parsed, str)
    r = rw.exact_match_reward(text, str(answer))
    assert r in (0.0, 1.0)
    if r == 1.0:
        assert int(parsed) == answer


@settings(max_examples=100, deadline=None)
@given(st.integers(-10**6, 10**6), st.text(alphabet="0123456789 +-=abc"))
def test_correct_answer_line_is_rewarded(answer, prefix):
    assert rw.exact_match_reward(prefix.replace("#", "") + f" #### {answer}", str(answer)) == 1.0

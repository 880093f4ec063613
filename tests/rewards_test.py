"""Answer parsing and rewards: hand cases and fuzzing."""
import threading

import numpy as np
import pytest
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
    assert rw.parse_final_answer(b"#### 3") is None
    assert rw.parse_final_answer("####\n5") is None  # the answer must be on the '####' line
    assert rw.parse_final_answer("#### 5 #### 6") == "5 #### 6"  # not an integer: no reward


def test_exact_match_by_hand():
    assert rw.exact_match_reward("1+2=3 #### 3", "3") == 1.0
    assert rw.exact_match_reward("#### 03", "3") == 1.0
    assert rw.exact_match_reward("#### 3", "-3") == 0.0
    assert rw.exact_match_reward("#### 3.0", "3") == 0.0
    assert rw.exact_match_reward("3", "3") == 0.0  # no answer line
    assert rw.exact_match_reward("#### 5 #### 6", "6") == 0.0
    assert rw.exact_match_reward("#### \u0663", "3") == 0.0  # Arabic-Indic 3: not ASCII
    assert rw.exact_match_reward("#### 7", 7) == 1.0  # integer references are accepted
    assert rw.exact_match_reward("#### 1" + "0" * 60, "1" + "0" * 60) == 0.0  # > 40 digits


def test_math_verify_and_batch():
    assert rw.math_verify_reward("#### 1/2", "0.5") == 1.0
    assert rw.math_verify_reward("#### 3", "4") == 0.0
    r = rw.rewards(["#### 5", "#### 4", "junk"], ["5", "5", "5"])
    np.testing.assert_array_equal(r, [1, 0, 0])
    assert r.dtype == np.float32
    np.testing.assert_array_equal(rw.rewards(["#### 4"], ["5"], format_weight=0.5), [0.5])
    np.testing.assert_array_equal(rw.rewards(["#### 5", "5"], ["5", "5"], format_weight=0.5),
                                  [1.5, 0.0])
    assert rw.rewards([], []).shape == (0,)
    with pytest.raises(ValueError, match="2 texts but 1 answers"):
        rw.rewards(["#### 5", "#### 5"], ["5"])
    with pytest.raises(ValueError, match="reward kind"):
        rw.rewards(["#### 5"], ["5"], kind="f1")


def test_math_verify_by_hand_and_off_the_main_thread():
    assert rw.math_verify_reward("#### \\frac{1}{2}", "0.5") == 1.0
    assert rw.math_verify_reward("so #### 1,000", "1000") == 1.0
    assert rw.math_verify_reward("no answer line", "5") == 0.0
    assert rw.math_verify_reward("#### " + "9" * 300, "9" * 300) == 0.0  # over the cap
    assert rw.math_verify_reward("#### )(}{", "5") == 0.0
    got = []
    t = threading.Thread(target=lambda: got.append(rw.math_verify_reward("#### 1/2", "0.5")))
    t.start()
    t.join()
    assert got == [1.0]  # signal-based timeouts would fail (-> 0.0) outside the main thread


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.text(alphabet="0123456789#+-= \n,.")),
       st.integers(-10**6, 10**6))
def test_parser_never_raises_and_never_rewards_a_wrong_answer(text, answer):
    parsed = rw.parse_final_answer(text)
    assert parsed is None or isinstance(parsed, str)
    r = rw.exact_match_reward(text, str(answer))
    assert r in (0.0, 1.0)
    if r == 1.0:
        assert int(parsed) == answer
    assert rw.format_reward(text) == float(parsed is not None)


@settings(max_examples=100, deadline=None)
@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6),
       st.text(alphabet="0123456789 +-="))
def test_a_wrong_final_line_is_never_rewarded(answer, wrong, prefix):
    if wrong != answer:
        text = f"{prefix} #### {answer}\n#### {wrong}"  # the last line counts
        assert rw.exact_match_reward(text, str(answer)) == 0.0
        assert rw.exact_match_reward(text, str(wrong)) == 1.0


@settings(max_examples=100, deadline=None)
@given(st.integers(-10**6, 10**6), st.text(alphabet="0123456789 +-=abc"))
def test_correct_answer_line_is_rewarded(answer, prefix):
    assert rw.exact_match_reward(prefix.replace("#", "") + f" #### {answer}", str(answer)) == 1.0

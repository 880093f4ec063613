"""Answer parsing and rewards: hand cases and fuzzing."""
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stablerl_jax.data import answers as ans
from stablerl_jax.data import rewards as rw


def test_parse_by_hand():
    assert ans.parse_final_answer("3+4=7 #### 7") == "7"
    assert ans.parse_final_answer("#### 1\n#### -12") == "-12"
    assert ans.parse_final_answer("#### 1,000.") == "1000"
    assert ans.parse_final_answer("no answer") is None
    assert ans.parse_final_answer("####   ") is None
    assert ans.parse_final_answer(None) is None
    assert ans.parse_final_answer(b"#### 3") is None
    assert ans.parse_final_answer("####\n5") is None  # the answer must be on the '####' line
    assert ans.hash_line("#### 5 #### 6") == "5 #### 6"
    assert ans.parse_final_answer("#### 5 #### 6") is None  # not a number: no answer


@pytest.mark.parametrize("line, want", [
    ("#### eleventy 5", None), ("#### 5 dollars", None), ("#### 10cm", None),
    ("#### \\text{five} 5", None), ("#### 五个 5", None), ("#### 5 #### 6", None),
    ("#### -1,234.", "-1234"), ("#### 3.5", "3.5"), ("#### $18", "$18"),
    ("#### \\frac{1}{2}", "\\frac{1}{2}"), ("#### 2\\pi", "2\\pi"),
    ("#### x = 5", "x = 5"), ("#### 72%", "72%")])
def test_a_hash_line_holding_a_word_states_no_answer(line, want):
    # math-verify finds the 5 in "eleventy 5"; a word on the '####' line is prose, not a
    # number, so the line states no answer: the reward is 0 whatever the reference.
    assert ans.parse_final_answer(line) == want
    assert ans.extract_answer(line) == ((want, "hash") if want else (None, "none"))
    if want is None:
        assert rw.math_verify_reward(line, "5") == 0.0
        assert rw.math_verify_reward(line, "6") == 0.0
    # The next extractor is still tried: a stated answer elsewhere counts.
    assert ans.extract_answer(f"The answer is 7.\n{line}")[0] == (want or "7")


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
    parsed, source = ans.extract_answer(text)
    assert parsed is None or isinstance(parsed, str)
    assert source in ans.SOURCES and (source == "none") == (parsed is None)
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


# Real-looking Qwen3 outputs: (case, response, reference, extracted answer, source, reward)
QWEN3 = [
    ("boxed after thinking",
     "<think>\nLet me add: 12 + 7 = 19.\n</think>\n\nThe sum is $\\boxed{19}$.", "19",
     "19", "boxed", 1.0),
    ("boxed fraction vs a decimal reference",
     "<think>half of one</think>\n\nSo the probability is \\boxed{\\frac{1}{2}}.", "0.5",
     "\\frac{1}{2}", "boxed", 1.0),
    ("decimal vs a boxed-fraction reference", "The answer is $0.5$.", "\\frac{1}{2}",
     "0.5", "answer_is", 1.0),
    ("nested braces", "</think>\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}",
     "\\frac{\\sqrt{3}}{2}", "boxed", 1.0),
    ("the last box wins", "First \\boxed{3}, no wait: \\boxed{4}", "4", "4", "boxed", 1.0),
    ("an unclosed last box falls back to the one before",
     "\\boxed{4} and then \\boxed{\\frac{1}{", "4", "4", "boxed", 1.0),
    ("fbox", "Hence \\fbox{12}.", "12", "12", "boxed", 1.0),
    ("boxed with a space", "so \\boxed 7 is it", "7", "7", "boxed", 1.0),
    ("dfrac reference", "\\boxed{0.75}", "\\dfrac{3}{4}", "0.75", "boxed", 1.0),
    ("a box inside the think block only", "<think>maybe \\boxed{5}</think>\nI am not sure.",
     "5", None, "none", 0.0),
    ("truncated thinking with a hash line", "<think>so #### 27 ... wait, let me recheck",
     "27", None, "none", 0.0),
    ("truncated thinking after a closed one", "<think>a</think> x <think> #### 27", "27",
     None, "none", 0.0),
    ("hash after thinking", "<think>9*3</think>\n#### 27", "27", "27", "hash", 1.0),
    ("the answer is, last one, any case",
     "The answer is 3. Hmm, no. THE ANSWER IS 4.", "4", "4", "answer_is", 1.0),
    ("the final answer is:", "The final answer is: 1,024", "1024", "1024", "answer_is", 1.0),
    ("DAPO's answer line", "<think>x</think>\nSo we are done.\nAnswer: 34", "34", "34",
     "answer_is", 1.0),
    ("a word 'answer:' mid-line is not an answer line", "My answer: maybe 3", "3", None,
     "none", 0.0),
    ("box preferred to a hash line", "\\boxed{8}\n#### 9", "8", "8", "boxed", 1.0),
    ("a wrong boxed answer", "<think>hmm</think>\\boxed{20}", "19", "20", "boxed", 0.0),
    ("no answer at all", "<think>x</think>I give up.", "1", None, "none", 0.0),
    ("no think tags (thinking off)", "12 + 7 = 19, so \\boxed{19}", "19", "19", "boxed", 1.0),
]


@pytest.mark.parametrize("case, text, ref, want, source, reward", QWEN3,
                         ids=[c[0] for c in QWEN3])
def test_qwen3_outputs(case, text, ref, want, source, reward):
    assert ans.extract_answer(text) == (want, source)
    assert rw.math_verify_reward(text, ref) == reward
    assert rw.format_reward(text) == float(want is not None)


def test_rewards_report_their_extractor():
    texts = ["\\boxed{2}", "#### 2", "the answer is 2", "<think>\\boxed{2}", "\\boxed{3}"]
    r, sources = rw.rewards_with_source(texts, ["2"] * 5, "math_verify")
    np.testing.assert_array_equal(r, [1, 1, 1, 0, 0])
    assert sources == ["boxed", "hash", "answer_is", "none", "boxed"]


def test_reference_answers_read_like_responses():
    assert ans.readable_answer("\\dfrac{3}{4}") and ans.readable_answer("27")
    assert ans.readable_answer("(-\\infty, 2]")
    assert not ans.readable_answer("\\frac{1}{0}")  # undefined: every reward would be 0
    assert not ans.readable_answer("banana")
    assert ans.opens_think("<|im_start|>assistant\n<think>\n")
    assert not ans.opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")

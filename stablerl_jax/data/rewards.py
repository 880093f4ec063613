"""Verifiable rewards: host-side pure functions that never raise on model output.

The answer a response states is found by `answers.extract_answer` (after the last
`</think>`; `\\boxed{…}`, then `#### N`, then "the answer is N"), then:

    exact-match reward R = 1[int(answer) == int(reference)], ASCII integers only
    math-verify reward R = 1[math_verify.verify(reference, answer)]  (GSM8K / MATH answers)
    format reward      R = 1[the response states an answer]         (off by default)

The paper's reward is the binary verified one; the format reward is optional shaping
(`rewards(..., format_weight=w)` adds w · it); `rewards_with_source` names each extractor.
"""
from __future__ import annotations

import re
import threading

import numpy as np

from stablerl_jax.data.answers import MAX_ANSWER_CHARS, extract_answer, parse_math

# ASCII digits only: `\d` would also accept e.g. Arabic-Indic digits, which int() parses.
_INT = re.compile(r"[+-]?[0-9]{1,40}", re.ASCII)


def _as_int(s: str | None) -> int | None:
    return int(s) if s is not None and _INT.fullmatch(s) else None


def exact_match_reward(text, answer) -> float:
    """1.0 iff the stated answer and the reference are the same integer."""
    got, want = _as_int(extract_answer(text)[0]), _as_int(str(answer).strip())
    return float(got is not None and want is not None and got == want)


def math_verify_reward(text, answer) -> float:
    """1.0 iff math_verify judges the stated answer equal to the reference (numbers,
    fractions, LaTeX), else 0.0. Its signal.alarm timeouts work only in the main thread;
    elsewhere (a data loader) they are off and MAX_ANSWER_CHARS is the only bound."""
    pred = extract_answer(text)[0]
    if pred is None or len(pred) > MAX_ANSWER_CHARS:
        return 0.0
    try:
        from math_verify import verify
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        gold, got = parse_math(str(answer), timeout), parse_math(pred, timeout)
        return float(bool(gold and got and verify(gold, got, timeout_seconds=timeout)))
    except Exception:  # noqa: BLE001 - a reward must never crash on model output
        return 0.0


def format_reward(text, answer=None) -> float:
    """1.0 iff the response states an answer (the reference is ignored)."""
    return float(extract_answer(text)[0] is not None)


REWARDS = {"exact": exact_match_reward, "math_verify": math_verify_reward,
           "format": format_reward}


def rewards_with_source(texts, answers, kind: str = "exact", format_weight: float = 0.0
                        ) -> tuple[np.ndarray, list[str]]:
    """(R_B, source_B): R_B = reward_kind(text, answer) + format_weight · format(text),
    float32 [B], and each answer's extractor (answers.SOURCES; 'none' if there is none)."""
    if kind not in REWARDS:
        raise ValueError(f"reward kind {kind!r}: choose one of {sorted(REWARDS)}")
    texts, answers = list(texts), list(answers)
    if len(texts) != len(answers):
        raise ValueError(f"rewards: {len(texts)} texts but {len(answers)} answers; "
                         "repeat each answer once per response (G times per prompt)")
    fn = REWARDS[kind]
    out = [fn(t, a) + (format_weight * format_reward(t) if format_weight else 0.0)
           for t, a in zip(texts, answers)]
    sources = [extract_answer(t)[1] for t in texts]
    return np.asarray(out, np.float32).reshape(len(texts)), sources


def rewards(texts, answers, kind: str = "exact", format_weight: float = 0.0) -> np.ndarray:
    """Per-response rewards R_B, float32 [B] (`rewards_with_source` without sources)."""
    return rewards_with_source(texts, answers, kind, format_weight)[0]


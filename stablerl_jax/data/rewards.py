"""Verifiable rewards: host-side pure functions that never raise on model output.

    parse_final_answer("... #### -12")  -> "-12"   (the last '####' line wins)
    exact-match reward R = 1[int(parsed) == int(reference)], ASCII integers only
    math-verify reward R = 1[math_verify.verify(reference, parsed)]  (GSM8K / MATH answers)
    format reward      R = 1[a final-answer line is present]         (off by default)

The paper's reward is the binary verified one; the format reward exists only as an
optional shaping term (`rewards(..., format_weight=w)` adds w · format reward).
"""
from __future__ import annotations

import re
import threading

import numpy as np

_ANSWER = re.compile(r"####[ \t]*([^\n]*)")
# ASCII digits only: `\d` would also accept e.g. Arabic-Indic digits, which int() parses.
_INT = re.compile(r"[+-]?[0-9]{1,40}", re.ASCII)
# Longer predictions are not answers; the cap also bounds math_verify's sympy work.
MAX_ANSWER_CHARS = 200


def parse_final_answer(text) -> str | None:
    """The text after the last '####' on its line: stripped, thousands commas and a
    trailing '.' removed; None if there is no such line or it is empty. Never raises."""
    if not isinstance(text, str):
        return None
    found = _ANSWER.findall(text)
    if not found:
        return None
    ans = found[-1].strip().replace(",", "").rstrip(".").strip()
    return ans or None


def _as_int(s: str | None) -> int | None:
    return int(s) if s is not None and _INT.fullmatch(s) else None


def exact_match_reward(text, answer) -> float:
    """1.0 iff the parsed final answer and the reference are the same integer."""
    got, want = _as_int(parse_final_answer(text)), _as_int(str(answer).strip())
    return float(got is not None and want is not None and got == want)


def math_verify_reward(text, answer) -> float:
    """1.0 iff math_verify judges the parsed final answer equal to the reference (numbers,
    fractions, LaTeX); 0.0 on a missing answer or any parser failure.

    math_verify bounds its time with signal.alarm, which only works in the main thread;
    elsewhere (a data-loader thread) its timeouts are turned off rather than letting every
    call fail, and MAX_ANSWER_CHARS is the only bound.
    """
    pred = parse_final_answer(text)
    if pred is None or len(pred) > MAX_ANSWER_CHARS:
        return 0.0
    try:
        from math_verify import parse, verify
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        gold = parse(str(answer), parsing_timeout=timeout)
        return float(bool(verify(gold, parse(pred, parsing_timeout=timeout),
                                 timeout_seconds=timeout)))
    except Exception:  # noqa: BLE001 - a reward must never crash on model output
        return 0.0


def format_reward(text, answer=None) -> float:
    """1.0 iff the response has a non-empty final-answer line (the answer is ignored)."""
    return float(parse_final_answer(text) is not None)


REWARDS = {"exact": exact_match_reward, "math_verify": math_verify_reward,
           "format": format_reward}


def rewards(texts, answers, kind: str = "exact", format_weight: float = 0.0) -> np.ndarray:
    """Per-response rewards R_B = reward_kind(text, answer) + format_weight · format(text),
    float32 [B]."""
    if kind not in REWARDS:
        raise ValueError(f"reward kind {kind!r}: choose one of {sorted(REWARDS)}")
    texts, answers = list(texts), list(answers)
    if len(texts) != len(answers):
        raise ValueError(f"rewards: {len(texts)} texts but {len(answers)} answers; "
                         "repeat each answer once per response (G times per prompt)")
    fn = REWARDS[kind]
    out = [fn(t, a) + (format_weight * format_reward(t) if format_weight else 0.0)
           for t, a in zip(texts, answers)]
    return np.asarray(out, np.float32).reshape(len(texts))

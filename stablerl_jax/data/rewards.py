"""Verifiable rewards: host-side pure functions that never raise on model output.

    parse_final_answer("... #### -12")  -> "-12"   (the last '####' line wins)
    exact-match reward: 1.0 iff the parsed answer equals the reference as an integer
    math-verify reward: 1.0 iff math_verify judges the parsed answer equal (GSM8K/MATH)
    format reward (off by default): 1.0 iff a final-answer line is present
"""
from __future__ import annotations

import re

import numpy as np

_ANSWER = re.compile(r"####\s*([^\n]*)")
_INT = re.compile(r"^[+-]?\d+$")


def parse_final_answer(text) -> str | None:
    """The text after the last '####' (stripped, commas and a trailing '.' removed)."""
    if not isinstance(text, str):
        return None
    found = _ANSWER.findall(text)
    if not found:
        return None
    ans = found[-1].strip().replace(",", "").rstrip(".").strip()
    return ans or None


def _as_int(s: str | None):
    if s is None or not _INT.match(s) or len(s) > 40:
        return None
    return int(s)


def exact_match_reward(text, answer: str) -> float:
    got, want = _as_int(parse_final_answer(text)), _as_int(str(answer).strip())
    return float(got is not None and want is not None and got == want)


def math_verify_reward(text, answer: str) -> float:
    """Equivalence by math_verify (numbers, fractions, LaTeX); 0.0 on any failure."""
    pred = parse_final_answer(text)
    if pred is None:
        return 0.0
    try:
        from math_verify import parse, verify
        return float(bool(verify(parse(str(answer)), parse(pred))))
    except Exception:  # noqa: BLE001 - a reward must never crash on model output
        return 0.0


def format_reward(text, answer: str = "") -> float:
    return float(parse_final_answer(text) is not None)


REWARDS = {"exact": exact_match_reward, "math_verify": math_verify_reward,
           "format": format_reward}


def rewards(texts, answers, kind: str = "exact", format_weight: float = 0.0) -> np.ndarray:
    """Per-response rewards, float32 [B]; optionally + format_weight · format reward."""
    if kind not in REWARDS:
        raise ValueError(f"reward kind {kind!r}: choose one of {sorted(REWARDS)}")
    fn = REWARDS[kind]
    out = [fn(t, a) + format_weight * format_reward(t) for t, a in zip(texts, answers)]
    return np.asarray(out, np.float32)

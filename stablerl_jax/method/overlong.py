"""Over-long responses: DAPO's soft length penalty and the response-length monitors.

Letters: B responses. C = sampling.max_new_tokens (DAPO's L_max), L_buf = rl.overlong_buffer.

A response is *truncated* when it reaches C tokens without a stop id (rollout.py:
`truncated_B`). `rl.overlong` says what it trains on:

    keep     as a finished response (its reward is scored from the cut text)
    mask     no gradient: its tokens leave the loss and the loss's denominators
             (losses.aggregate counts only rows with a scored token). Advantages are
             computed over the whole group first (its reward still moves the group
             baseline), then the row is masked: the order of verl and DAPO's overlong
             filtering.
    penalty  DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13) added to every
             reward, on the response length |y|:

                 R_len(y) = 0                          if |y| <= C − L_buf
                          = (C − L_buf − |y|) / L_buf  if C − L_buf < |y| <= C
                          = −1                         if |y| > C  (never: |y| <= C)

             times rl.overlong_penalty_factor.
"""
from __future__ import annotations

import numpy as np


def length_penalty(lengths_B, max_new_tokens: int, buffer: int, factor: float = 1.0):
    """DAPO's soft overlong punishment factor · R_len(|y|) per response (module
    docstring), float32 [B]: 0 for short responses, down to −factor at C tokens."""
    if not (0 < buffer <= max_new_tokens):
        raise ValueError(f"overlong buffer {buffer} must be in (0, max_new_tokens="
                         f"{max_new_tokens}]; set rl.overlong_buffer")
    lengths_B = np.asarray(lengths_B, np.float64)
    free = max_new_tokens - buffer
    r_B = np.where(lengths_B <= free, 0.0, (free - lengths_B) / buffer)
    r_B = np.where(lengths_B > max_new_tokens, -1.0, r_B)
    return (factor * r_B).astype(np.float32)


def response_stats(lengths_B, truncated_B, max_new_tokens: int) -> dict:
    """The step's response-length monitors (floats): `response/length_mean`,
    `response/length_max`, `response/length_min`, `response/truncated_frac` (no stop id
    in C tokens) and `response/clip_ratio` (length = C, verl's name; it also counts a
    response whose C-th token is a stop id)."""
    lengths_B = np.asarray(lengths_B)
    return {"response/length_mean": float(np.mean(lengths_B)),
            "response/length_max": float(np.max(lengths_B)),
            "response/length_min": float(np.min(lengths_B)),
            "response/truncated_frac": float(np.mean(np.asarray(truncated_B, bool))),
            "response/clip_ratio": float(np.mean(lengths_B >= max_new_tokens))}

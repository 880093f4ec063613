"""Over-long responses: DAPO's soft length penalty and the response-length monitors.
Letters: B responses; C = sampling.max_new_tokens (DAPO's L_max), L_buf = rl.overlong_buffer.

A response is *truncated* when it reaches C tokens without a stop id (rollout.py:
`truncated_B`). `rl.overlong` picks what it trains on:
    keep     a finished response (reward scored from the cut text)
    mask     no gradient: its tokens leave the loss and its denominators (losses.aggregate
             counts only rows with a scored token), after advantages over the whole group
             (its reward still moves the baseline): verl's and DAPO's overlong-filter order
    penalty  DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13) on |y|, times
             rl.overlong_penalty_factor, added to every reward:
                 R_len(y) = 0                          if |y| <= C − L_buf
                          = (C − L_buf − |y|) / L_buf  if C − L_buf < |y| <= C
                          = −1                         if |y| > C  (never: |y| <= C)
"""
from __future__ import annotations

import numpy as np


def length_penalty(lengths_B, max_new_tokens: int, buffer: int, factor: float = 1.0):
    """factor · R_len(|y|), float32 [B]: 0 when short, down to −factor at C tokens."""
    if not (0 < buffer <= max_new_tokens):
        raise ValueError(f"overlong buffer {buffer} must be in (0, max_new_tokens="
                         f"{max_new_tokens}]; set rl.overlong_buffer")
    lengths_B = np.asarray(lengths_B, np.float64)
    free = max_new_tokens - buffer
    r_B = np.where(lengths_B <= free, 0.0, (free - lengths_B) / buffer)
    r_B = np.where(lengths_B > max_new_tokens, -1.0, r_B)
    return (factor * r_B).astype(np.float32)


def response_stats(lengths_B, truncated_B, max_new_tokens: int) -> dict:
    """Floats `response/length_mean`, `response/length_max`, `response/length_min`,
    `response/truncated_frac` (no stop id in C tokens), `response/clip_ratio` (length = C,
    verl's name; also counts a C-th token that is a stop id)."""
    lengths_B = np.asarray(lengths_B)
    return {"response/length_mean": float(np.mean(lengths_B)),
            "response/length_max": float(np.max(lengths_B)),
            "response/length_min": float(np.min(lengths_B)),
            "response/truncated_frac": float(np.mean(np.asarray(truncated_B, bool))),
            "response/clip_ratio": float(np.mean(lengths_B >= max_new_tokens))}

"""Which checkpoint a run may resume from, given its metrics log, and the log's repair.

A resume keeps the metrics rows up to the restored step s and writes the later ones again, so the
log holds each step 0…N once only if the rows kept are exactly 0…s: a checkpoint is usable only
when the log holds every step up to its own once, as rows lost (a log cut short or restored from
an old copy) or duplicated (two runs in one workdir) before s cannot be written again. The newest
usable checkpoint is taken, newer ones set aside (`Checkpointer.restore_latest(usable=…)`); with
none usable the run refuses before changing anything. A torn last line (a process killed
mid-write, a full disk) holds no complete row: it is dropped when the log is rewritten, and
reported.
"""
from __future__ import annotations

import logging
import os

from stablerl_jax.runs.metrics_io import read_metrics, torn_tail


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])


def gap(logged: list[int], step: int) -> str | None:
    """None if `logged`'s steps ≤ `step` are exactly 0…step in file order; else what is wrong."""
    kept = [s for s in logged if s <= step]
    if kept == list(range(step + 1)):
        return None
    missing = sorted(set(range(step + 1)) - set(kept))
    repeated = sorted({s for s in kept if kept.count(s) > 1})
    what = []
    if missing:
        what.append(f"lacks the rows of steps {_span(missing)}")
    if repeated:
        what.append(f"holds steps {repeated[:8]} more than once")
    if not what:
        what.append("holds its rows out of order")
    return " and ".join(what)


def unusable(logged: list[int]):
    """`Checkpointer.restore_latest`'s `usable`: why a step cannot be resumed from."""
    def why(step: int) -> str | None:
        g = gap(logged, step)
        return f"is ahead of the metrics log, which {g}; set aside" if g else None
    return why


def choose(workdir: str, steps: list[int], logged: list[int]) -> None:
    """Refuse (ValueError, before any write) when checkpoints exist but the log covers none."""
    if steps and all(gap(logged, s) for s in steps):
        path = os.path.join(workdir, "metrics.jsonl")
        raise ValueError(
            f"{path} {gap(logged, steps[0])}, "
            f"so no checkpoint (steps {steps}) can be resumed without a hole in the log; "
            "restore metrics.jsonl from a copy, or start the run again in a new workdir")


def report_torn(path: str) -> None:
    """Log a torn last line of a JSONL log (dropped when the log is rewritten)."""
    n = torn_tail(path)
    if n:
        logging.warning("%s: its last line (%d bytes) was cut short mid-write; dropped it",
                        path, n)


def check_metrics_rows(path: str, last: int) -> None:
    """After the log was cut back to step `last`: it must hold steps 0…last once each."""
    logged = [r["step"] for r in read_metrics(path)]
    if logged != list(range(last + 1)):
        raise ValueError(f"{path}: after the resume at step {last} it holds steps "
                         f"{logged[:8]}{'…' if len(logged) > 8 else ''}, not 0..{last} "
                         "once each; restore it from a copy or start again in a new workdir")

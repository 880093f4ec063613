"""`--profile FIRST:LAST`: a jax.profiler trace of global steps FIRST through LAST, numbered as
metrics.jsonl rows (global step k is row k, 1-based).

Each process writes `<workdir>/profile/process_<i>/plugins/profile/<run>/<host>.xplane.pb`, the
layout of TensorBoard's profile plugin (`tensorboard --logdir <workdir>/profile`, Profile tab);
or load the `.xplane.pb` into xprof / Perfetto (ui.perfetto.dev), or read it with
`jax.profiler.ProfileData.from_file`. A `gs://` workdir's trace is written locally
(storage.local_dir) and copied to the bucket when the trace stops.
"""
from __future__ import annotations

import argparse
import os

import jax

from stablerl_jax.runs import storage


def parse(spec: str) -> tuple[int, int]:
    """'FIRST:LAST' (or 'K': one step) -> (FIRST, LAST); else an error naming the fix."""
    parts = spec.split(":")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        first, last = 0, -1
    if not 1 <= first <= last:
        raise ValueError(f"--profile {spec!r}: give FIRST:LAST global steps with 1 <= FIRST "
                         "<= LAST (e.g. --profile 3:4), as metrics.jsonl numbers them")
    return first, last


def add_argument(ap: argparse.ArgumentParser) -> None:
    """`--profile FIRST:LAST` on a command line."""
    def steps(spec: str):
        try:
            return parse(spec)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    ap.add_argument("--profile", type=steps, default=None, metavar="FIRST:LAST",
                    help="trace global steps FIRST..LAST with jax.profiler into "
                         "<workdir>/profile/ (TensorBoard's profile plugin, Perfetto)")


def trace_dir(workdir: str) -> str:
    """This process's trace directory under `<workdir>/profile/`."""
    return os.path.join(workdir, "profile", f"process_{jax.process_index()}")


def window_note(steps: tuple[int, int] | None, start: int, total: int) -> str:
    """What a run training global steps start+1 … total says of the window `steps` at its start:
    '' where the window lies within them, else which part is traced."""
    if not steps:
        return ""
    first, last = steps
    spec = f"--profile {first}:{last}"
    if first > total or last <= start:
        return (f"{spec}: this run trains global steps {start + 1}..{total}, none of the "
                "window; no trace is written")
    if first <= start or last > total:
        return (f"{spec}: this run trains global steps {start + 1}..{total}; only steps "
                f"{max(first, start + 1)}..{min(last, total)} are traced")
    return ""


class Profiler:
    """Traces the window's global steps that the run trains, from before the first to after the
    last (a run resumed past `first` starts at its own first step)."""

    def __init__(self, workdir: str, steps: tuple[int, int] | None):
        self.steps, self.dest = steps, trace_dir(workdir)
        self.local = storage.local_dir(self.dest)
        self.active = False

    def before(self, step: int) -> None:
        if self.steps and not self.active and self.steps[0] <= step <= self.steps[1]:
            os.makedirs(self.local, exist_ok=True)
            jax.profiler.start_trace(self.local)
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step == self.steps[1]:
            self.close()

    def close(self) -> None:
        """Stop a trace in progress (a run that ends or fails inside the window)."""
        if not self.active:
            return
        self.active = False
        self.steps = None  # one trace per run
        jax.profiler.stop_trace()
        if self.local != self.dest:
            storage.copytree(self.local, self.dest)

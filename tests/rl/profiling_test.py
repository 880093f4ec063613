"""`--profile FIRST:LAST` against the steps a run trains (rl/profiling.py): a window
outside them is said when the run starts, and the part inside is traced, a resumed run's
too (the trace itself: tests/rl/costs_test.py)."""
import pytest

from stablerl_jax.rl import profiling


@pytest.mark.parametrize("steps, start, total, note", [
    ((2, 3), 0, 3, ""),
    ((5, 9), 0, 3, "--profile 5:9: this run trains global steps 1..3, none of the window; "
                   "no trace is written"),
    ((1, 2), 3, 6, "--profile 1:2: this run trains global steps 4..6, none of the window"),
    ((2, 5), 0, 3, "--profile 2:5: this run trains global steps 1..3; only steps 2..3 are "
                   "traced"),
    ((2, 5), 3, 6, "only steps 4..5 are traced"),
    ((4, 4), 3, 3, "none of the window"),  # a finished run run again
    (None, 0, 3, ""),
])
def test_a_window_outside_the_runs_steps_is_said(steps, start, total, note):
    said = profiling.window_note(steps, start, total)
    assert (note in said and bool(said) == bool(note)), said


def _traced(monkeypatch, tmp_path, steps, start, total):
    """The steps between the profiler's start_trace and stop_trace calls."""
    events = []
    monkeypatch.setattr(profiling.jax.profiler, "start_trace", lambda d: events.append("on"))
    monkeypatch.setattr(profiling.jax.profiler, "stop_trace", lambda: events.append("off"))
    profiler = profiling.Profiler(str(tmp_path), steps)
    for step in range(start, total):
        profiler.before(step + 1)
        events.append(step + 1)
        profiler.after(step + 1)
    profiler.close()
    if "on" not in events:
        return []
    return events[events.index("on") + 1:events.index("off")]


@pytest.mark.parametrize("steps, start, total, traced", [
    ((2, 3), 0, 5, [2, 3]),
    ((5, 9), 0, 3, []),
    ((2, 5), 3, 6, [4, 5]),  # resumed inside the window: its first own step starts it
    ((2, 9), 0, 3, [2, 3]),  # the run ends inside it: closed at the end
])
def test_the_steps_of_the_window_the_run_trains_are_traced(monkeypatch, tmp_path, steps,
                                                            start, total, traced):
    assert _traced(monkeypatch, tmp_path, steps, start, total) == traced

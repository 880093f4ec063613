"""Which checkpoint the metrics log lets a run resume from (rl/resume.py): a checkpoint of
step s needs the log to hold each of 0…s exactly once; a torn last line is found."""
import pytest

from stablerl_jax.rl import resume
from stablerl_jax.runs.metrics_io import torn_tail


def test_gap_names_what_the_log_lacks_or_repeats():
    assert resume.gap([0, 1, 2, 3], 3) is None
    assert resume.gap([0, 1, 2, 3, 4, 5], 3) is None  # rows after s are written again
    assert resume.gap([0, 1], 3) == "lacks the rows of steps 2..3"
    assert resume.gap([0, 1, 2], 3) == "lacks the rows of steps 3"
    assert resume.gap([0, 1, 2, 1, 2, 3], 3) == "holds steps [1, 2] more than once"
    assert resume.gap([0, 2, 1], 2) == "holds its rows out of order"
    assert resume.gap([], 0) == "lacks the rows of steps 0"
    why = resume.unusable([0, 1, 2])
    assert why(2) is None
    assert why(4) == "is ahead of the metrics log, which lacks the rows of steps 3..4; set aside"


def test_choose_refuses_only_when_no_checkpoint_is_covered(tmp_path):
    resume.choose(str(tmp_path), [3, 4], [0, 1, 2, 3])  # 3 is covered: no error
    resume.choose(str(tmp_path), [], [])  # a fresh run
    with pytest.raises(ValueError, match=r"metrics.jsonl lacks the rows of steps 2..3, so "
                                         r"no checkpoint \(steps \[3, 4\]\)"):
        resume.choose(str(tmp_path), [3, 4], [0, 1])


def test_check_metrics_rows_after_the_cut(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n')
    resume.check_metrics_rows(str(path), 1)
    with pytest.raises(ValueError, match=r"holds steps \[0, 1\], not 0..2 once each"):
        resume.check_metrics_rows(str(path), 2)


def test_torn_tail(tmp_path):
    path = tmp_path / "m.jsonl"
    assert torn_tail(str(path)) == 0  # no file
    path.write_text('{"step": 0}\n{"step": 1}\n')
    assert torn_tail(str(path)) == 0
    path.write_text('{"step": 0}\n{"step": 1, "rew')
    assert torn_tail(str(path)) == len('{"step": 1, "rew')
    path.write_text('{"step": 0}\n{"step": 1}')  # whole, only its newline missing
    assert torn_tail(str(path)) == 0

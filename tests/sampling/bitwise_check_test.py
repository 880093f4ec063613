"""`python -m experiments.bitwise_check`'s statuses: 2 and one line for a bad
argument (before anything is built) or a run out of memory, 1 only when the engines
differ (tests/model/invariant_test.py runs the comparisons), 3 for an error of the tool."""
import pytest

from experiments import bitwise_check

BAD = [  # (arguments, the line must contain)
    (["--rows", "300000000"], "--rows: must be in [1, 4,096], got 300000000"),
    (["--rows", "0"], "--rows: must be in [1, 4,096], got 0"),
    (["--prompt-len", "-3"], "--prompt-len: must be in [1, 1,048,576], got -3"),
    (["--new-tokens", str(2**40)], "--new-tokens: must be in [1, 1,048,576]"),
    (["--rows", "4096", "--prompt-len", "200", "--new-tokens", "100"],
     "--rows × (--prompt-len + --new-tokens) = 1,228,800 tokens"),
    (["--seed", "-1"], "--seed: must be in [0, 2147483647], got -1"),
    (["--seed", str(2**64)], "--seed: must be in [0, 2147483647]"),
    (["--new-tokens", "1000"], "exceeds model.max_seq_len"),
    (["model.row_tile=2147483000"], "model.row_tile: 2,147,483,000 is more than any forward"),
]


@pytest.mark.parametrize("argv, needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_argument_is_status_2_and_one_line(capsys, argv, needle):
    assert bitwise_check.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_running_out_of_memory_is_status_2_not_1(capsys, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise MemoryError
    monkeypatch.setattr(bitwise_check, "check", out_of_memory)
    assert bitwise_check.main(["--rows", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not fit in this machine's memory" in err


def test_an_error_of_the_tool_is_status_3_with_its_traceback(capsys, monkeypatch):
    def bug(*args, **kwargs):
        raise KeyError("a bug")
    monkeypatch.setattr(bitwise_check, "check", bug)
    monkeypatch.setattr("sys.argv", ["bitwise_check", "--rows", "8"])
    assert bitwise_check._main() == 3
    assert "Traceback" in capsys.readouterr().err

"""What the command-line bad-input tables share (tests/bad_input_test.py,
tests/bad_file_input_test.py, tests/interop/bad_hf_input_test.py): a user error is one
line on stderr and exit status 2 (--traceback shows the full traceback instead), and
nothing outside the workdir changes."""
import os

import pytest
from rl_helpers import tiny_cfg

from experiments import train


def one_line(capsys, argv, *needles):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert "--traceback for the full traceback" in err
    return err


def outside(root, workdir):
    """Name, size, mtime and link target of every path under `root` but in `workdir`."""
    return sorted((str(p), p.lstat().st_size, p.lstat().st_mtime_ns,
                   os.readlink(p) if p.is_symlink() else None)
                  for p in root.rglob("*") if workdir not in (p, *p.parents))


def refused_outside_untouched(capsys, tmp_path, overrides, *needles):
    workdir = tmp_path / "run"
    before = outside(tmp_path, workdir)
    err = one_line(capsys, ["--workdir", str(workdir), "--quiet", "--compile-cache=",
                            *overrides], *needles)
    assert outside(tmp_path, workdir) == before
    ckpts = workdir / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())  # no step trained
    return err


def jsonl_cfg(path, **task):
    cfg = tiny_cfg()
    return cfg.replace(task=cfg.task.replace(kind="jsonl", jsonl_dir=str(path), **task))

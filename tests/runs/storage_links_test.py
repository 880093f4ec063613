"""Nothing a run writes follows a link out of its workdir (storage.open_no_follow): each
file a run writes, made a symbolic link to a file outside (or a dangling one), is
refused in one line naming it, and the file it points to keeps its bytes. A workdir
or checkpoints/ that is itself a link to a directory is followed."""
import logging
import os

import pytest
from cli_helpers import one_line

from stablerl_jax.rl import history
from stablerl_jax.runs import lock as run_lock
from stablerl_jax.runs import metrics_io, storage
from stablerl_jax.runs.checkpoint_guards import ErrorLog


def _write_lock(work, path):
    fd_path = run_lock.acquire(str(work))
    run_lock.release(fd_path)


def _write_log(work, path):
    metrics_io.JsonlLog(str(path)).write({"step": 0})


def _write_whole(work, path):
    storage.write_text(str(path), "{}")


def _replace_whole(work, path):
    storage.atomic_write(str(path), "{}")


def _append(work, path):
    storage.AppendFile(str(path)).append("row\n")


def _copy(work, path):
    src = work / "source.txt"
    src.write_text("copied")
    storage.copy(str(src), str(path))


def _plot(work, path):
    metrics_io.plot_metrics([{"step": 0, "reward": 0.5}, {"step": 1, "reward": 0.7}],
                            str(path.parent))


def _error_log(work, path):
    log = ErrorLog(str(path), str(work / "checkpoints"))
    try:
        logging.getLogger("absl").error("a failed save")
    finally:
        log.close()


# (the path a run writes, relative to the workdir; how the run writes it)
WRITTEN = [
    ("run.lock", _write_lock),
    ("metrics.jsonl", _write_log),
    ("samples.jsonl", _write_log),
    ("minibatches.jsonl", _write_log),
    ("attribution.jsonl", _write_log),
    ("summary.json", _write_whole),
    ("sft.json", _replace_whole),
    ("trackers.json", _replace_whole),
    ("sft_run/metrics.jsonl", _append),
    ("plots/reward.png", _plot),
    ("checkpoints.log", _error_log),
    ("export/config.json", _copy),
]


@pytest.mark.parametrize("dangling", [False, True], ids=["to a file", "dangling"])
@pytest.mark.parametrize("name, write", WRITTEN, ids=[n for n, _ in WRITTEN])
def test_a_link_in_place_of_a_written_file_is_refused_and_its_target_untouched(
        tmp_path, name, write, dangling):
    work = tmp_path / "run"
    target = tmp_path / "outside" / "precious.txt"
    target.parent.mkdir()
    if not dangling:
        target.write_text("precious")
    link = work / name
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    with pytest.raises(ValueError) as e:
        write(work, link)
    msg = str(e.value)
    assert "\n" not in msg and str(link) in msg and "symbolic link" in msg
    assert link.is_symlink()  # left as it was
    if dangling:
        assert not target.exists()
    else:
        assert target.read_text() == "precious"


def test_a_linked_workdir_and_checkpoint_directory_are_followed(tmp_path):
    real = tmp_path / "disk" / "run"
    real.mkdir(parents=True)
    (tmp_path / "run").symlink_to(real)
    path = run_lock.acquire(str(tmp_path / "run"))
    try:
        assert path == str(real / run_lock.LOCK_FILE)
    finally:
        run_lock.release(path)
    (tmp_path / "ckpt").mkdir()
    (real / "checkpoints").symlink_to(tmp_path / "ckpt")
    storage.write_text(str(real / "checkpoints" / "note"), "x")
    assert (tmp_path / "ckpt" / "note").read_text() == "x"


def test_history_moved_aside_moves_a_link_not_its_target(tmp_path):
    work = tmp_path / "run"
    work.mkdir()
    target = tmp_path / "precious.json"
    target.write_text("{}")
    (work / "summary.json").symlink_to(target)
    history.move_aside(str(work))
    assert (work / "replaced.1" / "summary.json").is_symlink()
    assert target.read_text() == "{}"


def test_a_linked_run_lock_is_one_line_at_the_command_line(capsys, tmp_path):
    """`run.lock` a link to a file outside the workdir (which a lock opened with O_CREAT
    had truncated to 0 bytes): exit 2 and one line before any work, the file intact."""
    work = tmp_path / "run"
    work.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    (work / run_lock.LOCK_FILE).symlink_to(target)
    one_line(capsys, ["--workdir", str(work), "--quiet", "--compile-cache=", "sft.steps=0"],
             f"{work / run_lock.LOCK_FILE} is a symbolic link", "never writes through a link")
    assert target.read_text() == "precious"
    assert sorted(os.listdir(work)) == [run_lock.LOCK_FILE]  # nothing else written

"""A workdir's history (rl/history.py): every combination of present, missing and
corrupt checkpoints, metrics, summary, stray entries and links, with and without
--replace-history; refused in one line, or moved aside with nothing deleted."""
import itertools
import json
import os
import shutil

import jax.numpy as jnp
import pytest
from rl_helpers import tiny_cfg

from stablerl_jax.rl import history, preflight
from stablerl_jax.runs.checkpoint import Checkpointer


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory):
    """A committed checkpoint step 2 of this module's Checkpointer (copied into cases)."""
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    ckpt = Checkpointer(str(root), keep=2, async_=False)
    ckpt.save(2, {"w": jnp.arange(4.0)}, {"step": 2})
    ckpt.close()
    return root / "2"


CHECKPOINTS = ("none", "step", "corrupt", "empty-dir", "stray")
METRICS = ("none", "short", "long")
STRAY = ("none", "note", "tmp-folder")


def _workdir(root, step_dir, checkpoints, metrics, summary, stray):
    work = root / "run"
    ckpts = work / "checkpoints"
    ckpts.mkdir(parents=True)
    if checkpoints == "step":
        shutil.copytree(step_dir, ckpts / "2")
    elif checkpoints == "corrupt":  # what a resume leaves of a step that did not restore
        shutil.copytree(step_dir, ckpts / "2.corrupt")
    elif checkpoints == "empty-dir":  # a folder named like a step, holding nothing
        (ckpts / "4").mkdir()
    if stray == "note":
        (ckpts / "notes.txt").write_text("keep me")
    elif stray == "tmp-folder":
        (ckpts / "tmp").mkdir()
    steps = {"none": (), "short": (0, 1), "long": tuple(range(31))}[metrics]
    if steps:
        (work / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in steps))
        (work / "samples.jsonl").write_text(json.dumps({"step": steps[-1]}) + "\n")
    if summary:
        (work / "summary.json").write_text('{"steps": 30}')
        (work / "plots").mkdir()
        (work / "plots" / "reward.png").write_bytes(b"png")
    return work


def _files(work):
    """{relative path: bytes} of every file under `work`."""
    return {str(p.relative_to(work)): p.read_bytes() for p in work.rglob("*") if p.is_file()}


@pytest.mark.parametrize("checkpoints, metrics, summary, stray", list(itertools.product(
    CHECKPOINTS, METRICS, (False, True), STRAY)))
def test_history_is_kept_unless_a_step_resumes_or_the_flag_moves_it(
        tmp_path, step_dir, checkpoints, metrics, summary, stray):
    cfg = tiny_cfg(checkpoint_every=1)
    work = _workdir(tmp_path, step_dir, checkpoints, metrics, summary, stray)
    before = _files(work)
    resumable = checkpoints == "step"
    has_history = metrics == "long" or summary
    if resumable or not has_history:
        preflight.check_history(cfg, str(work))  # the resume (or a short restart) decides
        assert _files(work) == before
        return
    with pytest.raises(ValueError) as e:
        preflight.check_history(cfg, str(work))
    msg = str(e.value)
    assert "\n" not in msg and "--replace-history" in msg and "holds another run's" in msg
    assert ("metrics.jsonl: 31 rows to step 30" in msg) == (metrics == "long")
    assert ("summary.json" in msg) == summary
    assert _files(work) == before  # refused: nothing changed
    preflight.check_history(cfg, str(work), replace=True)
    moved = {k.removeprefix("replaced.1/"): v for k, v in _files(work).items()
             if k.startswith("replaced.1/")}
    kept = {k: v for k, v in _files(work).items() if not k.startswith("replaced.1/")}
    assert {**moved, **kept} == before  # nothing deleted: moved aside or left
    assert not any(k in kept for k in ("metrics.jsonl", "summary.json", "samples.jsonl"))
    assert all(k.startswith("checkpoints/") for k in kept)
    preflight.check_history(cfg, str(work))  # the new run starts over there


def test_a_second_replacement_takes_the_next_free_name(tmp_path, step_dir):
    cfg = tiny_cfg(checkpoint_every=1)
    work = _workdir(tmp_path, step_dir, "none", "long", True, "none")
    preflight.check_history(cfg, str(work), replace=True)
    (work / "summary.json").write_text("{}")
    preflight.check_history(cfg, str(work), replace=True)
    assert (work / "replaced.1" / "metrics.jsonl").exists()
    assert (work / "replaced.2" / "summary.json").read_text() == "{}"


def test_an_export_directory_is_history_too(tmp_path, step_dir):
    cfg = tiny_cfg(checkpoint_every=1)
    work = _workdir(tmp_path, step_dir, "none", "none", False, "none")
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"the export {export}"):
        preflight.check_history(cfg, str(work), export_hf=str(export))
    preflight.check_history(cfg, str(work), replace=True, export_hf=str(export))
    assert not export.exists()
    assert (tmp_path / "export.replaced.1" / "config.json").read_text() == "{}"


def test_a_step_record_other_than_its_name_does_not_resume(tmp_path, step_dir):
    # `cp -r checkpoints/2 checkpoints/3`: the restore would set 3 aside as corrupt.
    cfg = tiny_cfg(checkpoint_every=1)
    work = _workdir(tmp_path, step_dir, "none", "long", False, "none")
    shutil.copytree(step_dir, work / "checkpoints" / "3")
    with pytest.raises(ValueError, match="--replace-history"):
        preflight.check_history(cfg, str(work))


def test_steps_that_list_but_do_not_restore_keep_the_history(tmp_path, step_dir):
    """A committed step whose state file is damaged lists as resumable; the restore
    sets it aside, and then the history is kept (or moved aside under the flag)."""
    cfg = tiny_cfg(checkpoint_every=1)
    work = _workdir(tmp_path, step_dir, "step", "long", True, "none")
    preflight.check_history(cfg, str(work))  # it lists: left to the restore
    for root, _, files in os.walk(work / "checkpoints" / "2" / "state"):
        for f in files:
            if not f.startswith("_"):
                with open(os.path.join(root, f), "r+b") as fh:
                    fh.write(b"\xff" * 8)
    ckpt = Checkpointer(str(work / "checkpoints"), async_=False)
    try:
        assert ckpt.restore_latest({"w": jnp.zeros(4)}) is None
    finally:
        ckpt.close()
    assert os.listdir(work / "checkpoints") == ["2.corrupt"]
    before = _files(work)
    with pytest.raises(ValueError, match="no checkpoint that restores.*--replace-history"):
        history.after_restore(cfg, str(work), replace=False)
    assert _files(work) == before
    (work / "trackers.json").write_text("{}")
    history.after_restore(cfg, str(work), replace=True)
    assert (work / "replaced.1" / "summary.json").exists()
    assert (work / "trackers.json").exists()  # the open trackers keep their record


@pytest.mark.parametrize("steps, refused", [
    ((0,), False),               # killed before its first checkpoint: restarts
    ((0, 1, 2, 3, 4), False),    # the save of step 2 may be unfinished
    (tuple(range(6)), True),     # step 2's save was done, and is gone
], ids=["step 0", "before the first checkpoint", "checkpoint gone"])
def test_a_short_log_restarts_and_one_past_two_checkpoints_is_history(tmp_path, steps,
                                                                      refused):
    cfg = tiny_cfg(checkpoint_every=2)
    work = tmp_path / "run"
    work.mkdir()
    (work / "minibatches.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in steps))
    if not refused:
        preflight.check_history(cfg, str(work))
        return
    with pytest.raises(ValueError, match="minibatches.jsonl: 6 rows to step 5"):
        preflight.check_history(cfg, str(work))

"""Which entries of a checkpoint directory are a Checkpointer's steps (checkpoint.py),
which are the remains of a save cut short, and their clean-up: orbax lists, resumes from
and deletes (keep-N) only committed steps of this module.

What "complete" means. Orbax (0.12) writes a step into `<step>.orbax-checkpoint-tmp`, writes
`commit_success.txt` into it when every item is on disk, then renames it to `<step>`. So:
- a save killed midway leaves a `<step>.orbax-checkpoint-tmp` directory, never listed as a
  step, and removed when the next `Checkpointer` opens the directory if it holds nothing
  but what such a save writes (`save_remains`: orbax's step metadata naming no other
  items, `state`, `meta` and their temporary directories, orbax's commit file (written
  there before the rename), a step record of that step);
- a step directory of this module's ("Whose directories" below) without `commit_success.txt`
  (a half-copied step, or a filesystem without atomic rename) is incomplete too. Orbax
  itself would list it on a local disk, and then both resume from it and skip every later
  save whose step is not above it, so it is renamed aside to `<step>.incomplete` (kept,
  never deleted) when a `Checkpointer` opens, and only committed steps are ever listed.
- any other name in the directory is left alone.

On an object store (a `gs://` directory, where nothing renames atomically: storage.py)
orbax writes a step in place, into `<step>/`, and `commit_success.txt` last. A save killed
midway there leaves a `<step>/` without the commit file: one holding orbax's step metadata
or an item directory (`state/`, `meta/`) and nothing else (`save_remains`) is that save's
remains and is removed when the next `Checkpointer` opens, so the step can be saved
again; anything else is left alone, as on a disk. Orbax's own clean-up is off everywhere:
it deletes every entry whose name holds `.orbax-checkpoint-tmp` (other programs' too), and
on an object store every uncommitted directory. Steps set aside are copied object by
object, then deleted.

Whose directories. A step directory is this module's when orbax's step metadata in it
(`_CHECKPOINT_METADATA`) names the items 'state' and 'meta' and its meta (`meta/metadata`)
holds a step record (`checkpoint_step`; in checkpoints written before `save` stored it,
the training loop's "step"). Both: another program's orbax checkpoints with items of
those names have the first, and nothing but these checkpoints writes the second. Every
committed step of this module holds both (orbax commits a step after its items and its
step metadata). One exception, for damage: where one of the two files is there but is
not JSON, the other alone decides, so that a step whose meta was damaged is still set
aside as corrupt and the run falls back past it (else the run would stop at that step's
next save). Whether the record equals the directory's name is not part of the test: a
copied step directory is this module's, and `restore_latest` sets it aside as corrupt.
A save cut short needs neither record (it may have written neither yet): its remains are
judged by `save_remains` above. Only this module's step directories are listed, resumed
from, set aside or deleted (keep-N). Anything else in the directory (say a `checkpoints/`
symlinked to a shared disk that already held `1 2 3 7`, or another program's
`5.orbax-checkpoint-tmp-…`) is left untouched and named in one warning when a
`Checkpointer` opens; a save whose step directory, or orbax's temporary directory for it,
such an entry occupies fails with `CheckpointSaveError` instead of overwriting it
(orbax's own save would delete it first).
"""
from __future__ import annotations

import json
import logging
import os
import re

import orbax.checkpoint as ocp

from stablerl_jax import distributed
from stablerl_jax.runs import storage

COMMIT_FILE = "commit_success.txt"
STEP = "checkpoint_step"  # the step record in a step's meta
_ORBAX_STEP_META = "_CHECKPOINT_METADATA"
_ITEMS = {"state", "meta"}
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")  # orbax's step names
_SET_ASIDE = re.compile(r"[0-9]+\.(incomplete|corrupt|unusable)[0-9]*")  # set_aside's names
TMP_SUFFIX = ".orbax-checkpoint-tmp"
# Orbax's temporary directory of a step (0.12: no timestamp; earlier versions: one), and
# of an item inside it.
_TMP_NAME = re.compile(r"(0|[1-9][0-9]*)" + re.escape(TMP_SUFFIX) + r"(-[0-9]+)?")
_ITEM_NAME = re.compile(r"(state|meta)(" + re.escape(TMP_SUFFIX) + r"(-[0-9]+)?)?")


def set_aside(path: str, suffix: str) -> str:
    """Rename `path` to `path + suffix` (or `…suffix<n>` if taken); returns the new path.
    Nothing is deleted: a bad checkpoint stays for inspection."""
    dest, n = path + suffix, 1
    while storage.lexists(dest):
        dest, n = f"{path}{suffix}{n}", n + 1
    storage.rename(path, dest)
    return dest


_DAMAGED = object()  # what `_read_json` returns for a file that is there but not JSON


def _read_json(path: str):
    """The JSON value of a file; None where there is none, `_DAMAGED` where the file is
    there but does not parse (or cannot be read)."""
    try:
        text = storage.read_text(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return _DAMAGED
    try:
        return json.loads(text)
    except ValueError:
        return _DAMAGED


def stored_step(meta):
    """The step record of a step's meta: `checkpoint_step`, or the training loop's "step"
    in checkpoints written before `save` stored it; None if there is no integer one."""
    if not isinstance(meta, dict):
        return None
    stored = meta.get(STEP, meta.get("step"))
    return stored if isinstance(stored, int) and not isinstance(stored, bool) else None


def is_own_step(path: str) -> bool:
    """Whether the step directory `path` was written by a Checkpointer (module docstring,
    "Whose directories"): orbax's step metadata names the items 'state' and 'meta', and
    the meta holds a step record; one of the two files may be damaged (there, but not
    JSON) if the other says so. A symlink never is: a Checkpointer writes none."""
    if storage.islink(path) or not storage.isdir(path):
        return False
    orbax_meta = _read_json(os.path.join(path, _ORBAX_STEP_META))
    meta = _read_json(os.path.join(path, "meta", "metadata"))
    handlers = orbax_meta.get("item_handlers") if isinstance(orbax_meta, dict) else None
    says = [isinstance(handlers, dict) and set(handlers) == _ITEMS,
            stored_step(meta) is not None]
    damaged = [orbax_meta is _DAMAGED, meta is _DAMAGED]
    return all(s or d for s, d in zip(says, damaged)) and any(says)


def is_step(path: str) -> bool:
    """A committed step directory of this module: what a resume may use."""
    return storage.exists(os.path.join(path, COMMIT_FILE)) and is_own_step(path)


def resumable_steps(directory: str) -> list[int]:
    """The committed steps of this module in `directory` whose step record is their
    name, ascending ([] where there is no directory): what a resume may try to restore.
    Stray files, other programs' entries and steps set aside are not."""
    if not storage.isdir(directory):
        return []
    steps = []
    for name in storage.listdir(directory):
        path = os.path.join(directory, name)
        if _STEP_NAME.fullmatch(name) and is_step(path) and stored_step(
                _read_json(os.path.join(path, "meta", "metadata"))) == int(name):
            steps.append(int(name))
    return sorted(steps)


def save_remains(path: str, step: int, *, in_place: bool) -> bool:
    """Whether the directory `path` holds nothing but what a `save` of `step` cut short
    leaves (module docstring, "Whose directories"): orbax's step metadata, naming no
    items but 'state' and 'meta' (it names none until the commit), and those items
    (`state/`, `meta/`, or orbax's temporary `state.orbax-checkpoint-tmp…`), with a
    step record of `step` where the meta is readable. In orbax's temporary directory
    also `commit_success.txt`: orbax writes it there before the rename, so a save killed
    between the two leaves it (never renamed, the step was never committed). In place
    (an object store), at least one of them (there, an empty directory does not exist);
    in orbax's temporary directory on a disk, also none (a save killed right after
    creating it). A file killed mid-write (unreadable JSON) does not count against it."""
    if storage.islink(path) or not storage.isdir(path):
        return False
    names = storage.listdir(path)
    if in_place and not names:
        return False
    for name in names:
        if name == _ORBAX_STEP_META:
            orbax_meta = _read_json(os.path.join(path, name))
            if orbax_meta is None or orbax_meta is _DAMAGED:
                continue
            handlers = orbax_meta.get("item_handlers") if isinstance(orbax_meta,
                                                                     dict) else False
            if not (handlers is None or (isinstance(handlers, dict)
                                         and set(handlers) <= _ITEMS)):
                return False
        elif name == COMMIT_FILE:
            if in_place:  # (in place, the commit file makes a step, never remains)
                return False
        elif not _ITEM_NAME.fullmatch(name):
            return False
        elif name.startswith("meta"):
            meta = _read_json(os.path.join(path, name, "metadata"))
            if meta is not None and meta is not _DAMAGED and stored_step(meta) != step:
                return False
    return True


def sort_out(directory: str) -> list[str]:
    """Remove the remains of this module's saves cut short (orbax's temporary directories
    on a disk, uncommitted step directories on an object store), move this module's other
    uncommitted step directories aside to `<step>.incomplete` (module docstring), and
    return the names of the entries it did not write, in natural order."""
    foreign = []
    in_place = not storage.renames_atomically(directory)
    for name in storage.listdir(directory):
        path = os.path.join(directory, name)
        tmp = _TMP_NAME.fullmatch(name)
        if tmp and save_remains(path, int(tmp.group(1)), in_place=False):
            logging.info("removing %s (a checkpoint save cut short)", path)
            storage.rmtree(path)
        elif (in_place and _STEP_NAME.fullmatch(name)
              and not storage.exists(os.path.join(path, COMMIT_FILE))
              and save_remains(path, int(name), in_place=True)):
            logging.warning("checkpoint %s has no %s (a save cut short); removed it", path,
                            COMMIT_FILE)
            storage.rmtree(path)
        elif _STEP_NAME.fullmatch(name) and is_own_step(path):
            if not storage.exists(os.path.join(path, COMMIT_FILE)):
                dest = set_aside(path, ".incomplete")
                logging.warning("checkpoint %s has no %s; moved to %s", path, COMMIT_FILE,
                                dest)
        elif not _SET_ASIDE.fullmatch(name):
            foreign.append(name)
    return sorted(foreign, key=_natural)


def _natural(name: str):
    """Names by their leading number (`2`, `5.orbax-checkpoint-tmp`, `10`), then the rest."""
    number = re.match(r"[0-9]+", name)
    return (number is None, int(number.group()) if number else 0, name)


class OwnSteps:
    """Orbax's standard step names, listing only committed steps of this module: orbax then
    neither resumes from, counts (it skips every save not above its latest step) nor
    deletes (keep-N) a directory it did not write."""

    def __init__(self):
        self._names = ocp.path.step.standard_name_format()

    def build_name(self, step: int) -> str:
        return self._names.build_name(step)

    def find_all(self, base_path):
        return (m for m in self._names.find_all(base_path) if is_step(str(m.path)))

    def find_step(self, base_path, step: int):
        found = self._names.find_step(base_path, step)
        if not is_step(str(found.path)):
            raise ValueError(f"{found.path} is not a committed checkpoint of this run")
        return found


class OwnStepDeleter:
    """Keep-N's deletions (orbax's CheckpointDeleter protocol, run in orbax's finalize
    thread after a save commits): exactly `<dir>/<step>`, and only a committed step of this
    module, by the main process. Orbax's own deleter deletes a `<step>.orbax-checkpoint-
    tmp…` entry in its place where there is one (another program's too), leaving the step."""

    def __init__(self, directory: str):
        self.directory = directory

    def delete(self, step: int) -> None:
        path = os.path.join(self.directory, str(step))
        if distributed.is_main() and is_step(path):
            storage.rmtree(path)

    def delete_steps(self, steps) -> None:
        for step in steps:
            self.delete(step)

    def close(self) -> None:
        pass

"""Which checkpoint-directory entries are steps (checkpoint.py) or cut-short saves' remains, and
their clean-up; orbax lists, resumes from and deletes (keep-N) own committed steps only.

What "complete" means. Orbax (0.12) writes a step into `<step>.orbax-checkpoint-tmp`, adds
`commit_success.txt` once every item is on disk, then renames it to `<step>`. So:
- a save killed midway leaves a `<step>.orbax-checkpoint-tmp` directory, never listed; the next
  `Checkpointer` to open removes it if it holds only what such a save writes (`save_remains`:
  `state`, `meta`, orbax's metadata);
- an own step directory ("Whose directories") without `commit_success.txt` (half-copied, or no
  atomic rename) is incomplete too; orbax would list it on a disk, resume from it and skip later
  saves not above it, so an opening `Checkpointer` renames it to `<step>.incomplete` (kept,
  never deleted);
- any other name is left alone.

On an object store (a `gs://` directory, no atomic rename: storage.py) orbax writes a step in
place, `commit_success.txt` last; an uncommitted `<step>/` holding only orbax's step metadata or
`state/`, `meta/` is a killed save's remains (`save_remains`), removed so the step can be saved
again. Orbax's own clean-up, off here, deletes every entry whose name holds
`.orbax-checkpoint-tmp` (other programs' too), and on an object store every uncommitted
directory. Steps set aside there are copied object by object, then deleted.

Whose directories. A step directory is this module's when its orbax step metadata
(`_CHECKPOINT_METADATA`) names the items 'state' and 'meta' (other programs' may too) and its
meta (`meta/metadata`) holds a step record (`checkpoint_step`, or the training loop's "step" in
older checkpoints; nothing else writes one), as every committed own step does. If one file is
there but not JSON, the other decides, so a step with damaged meta is still set aside as corrupt
(the run falls back past it instead of stopping at its next save). A copied step, its record
unlike its name, is own: `restore_latest` sets it aside as corrupt. Cut-short saves:
`save_remains`. Anything else (say a `checkpoints/` symlinked to a shared disk holding
`1 2 3 7`, or another program's `5.orbax-checkpoint-tmp-…`) is never listed, resumed from, set
aside or deleted, but named in one warning when a `Checkpointer` opens; a save whose step or
orbax temporary directory is such an entry fails with `CheckpointSaveError` rather than
overwrite it (orbax would delete it first)."""
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
    """Rename `path` to `path + suffix` (`…suffix<n>` if taken) and return the new path. Nothing
    is deleted: a bad checkpoint stays for inspection."""
    dest, n = path + suffix, 1
    while storage.lexists(dest):
        dest, n = f"{path}{suffix}{n}", n + 1
    storage.rename(path, dest)
    return dest


_DAMAGED = object()  # what `_read_json` returns for a file that is there but not JSON


def _read_json(path: str):
    """A file's JSON; None if absent, `_DAMAGED` if unparsable or unreadable."""
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
    """A meta's integer step record (`checkpoint_step`; older: the loop's "step"), else None."""
    if not isinstance(meta, dict):
        return None
    stored = meta.get(STEP, meta.get("step"))
    return stored if isinstance(stored, int) and not isinstance(stored, bool) else None


def is_own_step(path: str) -> bool:
    """Whether the step directory `path` was written by a Checkpointer (module docstring, "Whose
    directories"). A symlink never is: a Checkpointer writes none."""
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
    """Own committed steps in `directory` whose step record is their name, ascending ([] without
    one): what a resume may try (not stray files, others' entries, steps set aside)."""
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
    """Whether `path` holds only what a cut-short `save` of `step` leaves: orbax's step metadata
    naming at most 'state' and 'meta', those items (`state/`, `meta/`, temporary
    `state.orbax-checkpoint-tmp…`), a step record of `step` if readable, and in orbax's
    temporary directory `commit_success.txt` (written before the rename, which a killed save
    never reached). In place (an object store: no empty directories) at least one entry; a
    disk's temporary directory may be empty (killed right after creation). Unreadable JSON (cut
    mid-write) does not count against it."""
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
    """Remove the remains of own saves cut short (orbax's temporary directories on a disk,
    uncommitted step directories on an object store), move other own uncommitted steps to
    `<step>.incomplete`, and return the names of entries not written here, in natural order."""
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
    """Orbax's standard step names listing own committed steps only: orbax never resumes from,
    counts (it skips saves not above its latest step) or deletes (keep-N) others."""

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
    """Keep-N's deletions (orbax's CheckpointDeleter protocol, its finalize thread after a
    commit): exactly `<dir>/<step>`, an own committed step only, by the main process; orbax's
    deleter would delete a `<step>.orbax-checkpoint-tmp…` entry (anyone's) instead."""

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

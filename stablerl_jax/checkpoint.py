"""Checkpoints with orbax: atomic, optionally async, keep-N, resume from complete steps only.

Layout of a run's checkpoint directory (one subdirectory per saved global step):

    <dir>/<step>/state/   the train state: a pytree of arrays (params, optimizer state, counters)
    <dir>/<step>/meta/    a small JSON dict (config, data position, ...)

What "complete" means. Orbax (0.12) writes a step into `<step>.orbax-checkpoint-tmp`, writes
`commit_success.txt` into it when every item is on disk, then renames it to `<step>`. So:
- a save killed midway leaves a `*.orbax-checkpoint-tmp*` directory, never listed as a step
  (and removed when the next `Checkpointer` opens the directory);
- a directory named like a step but without `commit_success.txt` (a half-copied step, or a
  filesystem without atomic rename) is incomplete too. Orbax itself would list it on a local
  disk, and then both resume from it and skip every later save whose step is not above it,
  so it is renamed aside to `<step>.incomplete` (kept, never deleted) before orbax looks.
- any other name in the directory is ignored.

Restores use the target's shapes, dtypes and shardings, so a sharded run resumes sharded.
Shapes and dtypes must match the checkpoint exactly: orbax would silently cast a dtype,
which breaks bit-exact resume, so a mismatch is an error that names the leaf.

Checksums. `save` stores two 32-bit checksums of every array's bits in the meta (a plain
and a position-weighted sum of its 32-bit words, computed on the devices, so sharded
arrays need no host copy); `restore` recomputes them and refuses a checkpoint whose bits
changed (a flipped byte restores without any error from orbax). `restore_latest` tries
the complete steps newest first and falls back past any that does not restore (truncated,
zero-filled, missing files, garbage metadata, a checksum mismatch), saying which and why,
and moves each such step aside to `<step>.corrupt` (kept, never deleted) so that later
saves of that step are not skipped.

Step numbers. `save` also stores the step in the meta (`checkpoint_step`), and
`restore_latest` treats a step directory whose stored step differs from its name (a
copied `<step>` directory) as corrupt: falls back past it, says so, moves it aside.

Failed saves. An async save that fails in the background (disk full, a file-size limit,
permissions) leaves only its `*.orbax-checkpoint-tmp` directory, never a step; `check_saves`
(non-blocking, once per training step) and `wait` turn that failure into one
`CheckpointSaveError` naming the step, the cause and the fix, so the run stops at its next
step instead of training on without checkpoints.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from stablerl_jax import distributed

_COMMIT_FILE = "commit_success.txt"
_CHECKSUMS = "checksums"
_STEP = "checkpoint_step"


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed; its message names the step, the cause and the fix."""


def _words_u32(x):
    """The bits of x as uint32 words (narrower dtypes widened, wider ones split)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = x.dtype.itemsize * 8
    if bits == 64:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing axis of 2
    return jax.lax.bitcast_convert_type(x, getattr(jnp, f"uint{bits}")).astype(jnp.uint32)


@jax.jit
def _checksum(x):
    """(Σ w, Σ (i+1)·w) over the uint32 words w_i of x, both mod 2³²: integer sums are
    exact in any order, so sharded and unsharded arrays give the same numbers."""
    w = _words_u32(x).reshape(-1)
    i = jnp.arange(1, w.shape[0] + 1, dtype=jnp.uint32)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * i, dtype=jnp.uint32)])


def checksums(state) -> dict[str, list[int]]:
    """{leaf path: [sum, weighted sum]} of a pytree of arrays (module docstring)."""
    sums = _checksums_jit(_leaves(state))  # one program for every leaf
    return {k: [int(v) for v in distributed.host(x)] for k, x in sums.items()}


_checksums_jit = jax.jit(lambda leaves: jax.tree.map(_checksum, leaves))


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _leaves(tree) -> dict[str, Any]:
    """{'a/b/0/mu': leaf}. NamedTuple fields and dict keys map to the same names, because
    orbax's metadata records an optax NamedTuple state as a dict of its fields."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_name(k) for k in path): leaf for path, leaf in flat}


def _abstract(tree):
    """ShapeDtypeStruct targets carrying each leaf's sharding (None for host arrays)."""
    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            raise ValueError("checkpointed state holds a typed PRNG key; store "
                             "jax.random.key_data(key) instead and rewrap it after restore")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(one, tree)


def _check_matches(saved_meta, target, where: str) -> None:
    """Raise a ValueError listing leaves whose path, shape or dtype differ."""
    saved, want = _leaves(saved_meta), _leaves(target)
    problems = [f"{p}: in checkpoint, not in target" for p in sorted(saved.keys() - want.keys())]
    problems += [f"{p}: in target, not in checkpoint" for p in sorted(want.keys() - saved.keys())]
    for p in sorted(saved.keys() & want.keys()):
        a, b = saved[p], want[p]
        if tuple(a.shape) != tuple(b.shape) or np.dtype(a.dtype) != np.dtype(b.dtype):
            problems.append(f"{p}: checkpoint {a.dtype}{list(a.shape)} vs target "
                            f"{b.dtype}{list(b.shape)}")
    if problems:
        more = f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""
        raise ValueError(
            f"checkpoint {where} does not match the target state: " + "; ".join(problems[:8])
            + more + ". Restore with the model/optimizer config the checkpoint was written "
            "with, or start a fresh run in a new directory.")


def _check_step(meta: dict, step: int) -> None:
    """A step directory must hold the step it is named for (a copy does not). Checkpoints
    written before `save` stored it are judged by the training loop's "step" entry."""
    stored = meta.get(_STEP, meta.get("step"))
    if stored is not None and stored != step:
        raise ValueError(f"it holds the state of step {stored}, not {step} (a copied or "
                         "renamed step directory)")


def set_aside(path: str, suffix: str) -> str:
    """Rename `path` to `path + suffix` (or `…suffix<n>` if taken); returns the new path.
    Nothing is deleted: a bad checkpoint stays for inspection."""
    dest, n = path + suffix, 1
    while os.path.exists(dest):
        dest, n = f"{path}{suffix}{n}", n + 1
    os.rename(path, dest)
    return dest


def _set_aside_incomplete(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.isdigit() and os.path.isdir(path) and not os.path.exists(
                os.path.join(path, _COMMIT_FILE)):
            dest = set_aside(path, ".incomplete")
            logging.warning("checkpoint %s has no %s; moved to %s", path, _COMMIT_FILE, dest)


class Checkpointer:
    """Per-step {'state': pytree of arrays, 'meta': JSON dict}, keeping the newest `keep`."""

    def __init__(self, directory: str, keep: int = 2, async_: bool = True):
        directory = os.path.abspath(directory)
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"checkpoint directory {directory!r} is a file; pass a directory "
                             "path (or move the file away)")
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1 (number of checkpoints kept)")
        os.makedirs(directory, exist_ok=True)
        if not os.access(directory, os.W_OK):
            raise PermissionError(f"checkpoint directory {directory!r} is not writable; fix "
                                  "its permissions or use another workdir")
        if distributed.is_main():
            _set_aside_incomplete(directory)
        distributed.barrier("checkpoint directory")
        self.directory = directory
        self.keep, self.async_ = keep, async_
        self._pending: int | None = None  # the step of the last save started
        self._failed: CheckpointSaveError | None = None  # reported once, then kept
        self.manager = self._manager()

    def _manager(self):
        return ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, enable_async_checkpointing=self.async_, create=True,
                cleanup_tmp_directories=True),  # leftovers of killed saves
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (an async save still in flight is not listed)."""
        return sorted(s for s in self.manager.all_steps() if os.path.exists(
            os.path.join(self.directory, str(s), _COMMIT_FILE)))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Start saving `step`; returns False if orbax skipped it (a step not above the
        latest saved one, unless force). With async, arrays are copied off the devices
        before this returns, so the caller may donate `state` right away."""
        try:
            json.dumps(meta)
        except TypeError as e:
            raise ValueError(f"checkpoint meta must be JSON-serializable: {e}") from None
        _abstract(state)  # rejects typed PRNG keys before anything is written
        meta = {**meta, _CHECKSUMS: checksums(state), _STEP: int(step)}
        # Orbax waits for the previous save before starting this one anyway; waiting
        # here names the step whose save failed, if one did.
        self.check_saves()
        self.wait()
        try:
            started = self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=force)
        except Exception as e:  # noqa: BLE001 (a synchronous save fails here)
            raise self._save_error(step, e) from e
        self._pending = step
        return started

    def _save_error(self, step, e: BaseException) -> CheckpointSaveError:
        where = os.path.join(self.directory, str(step))
        cause = " ".join(f"{type(e).__name__}: {e}".split())
        if len(cause) > 400:  # TensorStore puts the OS error (e.g. "File too large") last
            cause = cause[:150] + " … " + cause[-250:]
        self._failed = CheckpointSaveError(
            f"checkpoint {where} could not be saved ({cause}); free disk space, raise the "
            "file-size limit or fix the permissions of the checkpoint directory, then run "
            "the same command again: it resumes from the last complete checkpoint")
        return self._failed

    def check_saves(self) -> None:
        """Raise CheckpointSaveError if a background save has failed (without waiting
        for one still in flight)."""
        if self._failed is not None:
            raise self._failed
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until pending async saves (and keep-N deletions) are on disk; raise
        CheckpointSaveError (once) if one failed."""
        if self._failed is not None:
            return  # reported already; nothing more will be written by that save
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 (orbax / TensorStore raise many kinds)
            raise self._save_error(self._pending, e) from e

    def restore(self, step: int | None, target_state) -> tuple[Any, dict]:
        """(state, meta) of `step` (None: the latest complete one). `target_state` (arrays or
        ShapeDtypeStructs) gives the tree structure, shapes, dtypes and shardings. Raises
        if the step does not restore or its checksums do not match."""
        self.wait()
        steps = self.all_steps()
        if not steps:
            raise ValueError(f"no complete checkpoint in {self.directory!r}; start a fresh run "
                             "or point to the workdir of the run to resume")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise ValueError(f"no complete checkpoint for step {step} in {self.directory!r}; "
                             f"available steps: {steps}")
        target = _abstract(target_state)
        where = os.path.join(self.directory, str(step))
        _check_matches(self.manager.item_metadata(step)["state"], target, where)
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        meta = dict(out.meta)
        meta.pop(_STEP, None)
        saved = meta.pop(_CHECKSUMS, None)
        if saved is not None:
            got = checksums(out.state)
            bad = sorted(k for k in saved if got.get(k) != saved[k])
            if bad:
                raise ValueError(f"checkpoint {where}: the bits of {bad[:4]} differ from "
                                 "their checksums at save time (a corrupted file)")
        return out.state, meta

    def read_meta(self, step: int) -> dict:
        """The meta dict of a complete step, without restoring its state (checked to
        hold that step)."""
        self.wait()
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = dict(out.meta)
        _check_step(meta, step)
        meta.pop(_STEP, None)
        return meta

    def restore_latest(self, target_state, check_meta=None,
                       usable=None) -> tuple[int, Any, dict] | None:
        """(step, state, meta) of the newest complete step that restores, or None if there
        is none. Steps that fail (module docstring), or whose stored step is not their
        directory's name, are logged and moved aside. `check_meta(meta)` runs before a
        step's state is restored; what it raises (e.g. a changed config) propagates: that
        is the caller's error, not corruption. `usable(step)` -> None, or why a sound step
        may not be resumed from (e.g. the metrics log stops before it): such steps are
        moved aside to `<step>.unusable`, so that the resumed run saves them again."""
        self.wait()
        for step in reversed(self.all_steps()):
            why = usable(step) if usable is not None else None
            if why:
                self._set_aside(step, ".unusable", why)
                continue
            try:
                meta = self.read_meta(step)
            except Exception as e:  # noqa: BLE001 (orbax / TensorStore / JSON raise many)
                self._corrupt(step, e)
                continue
            if check_meta is not None:
                check_meta(meta)
            try:
                state, meta = self.restore(step, target_state)
                return step, state, meta
            except Exception as e:  # noqa: BLE001
                if "does not match the target state" in str(e):
                    raise  # another model or optimizer: not corruption, the caller's error
                self._corrupt(step, e)
        return None

    def _corrupt(self, step: int, e: Exception) -> None:
        """Log why `step` does not restore and move it aside (a later save may then write
        that step again)."""
        self._set_aside(step, ".corrupt", f"does not restore ({type(e).__name__}: "
                        f"{str(e)[:300]}); falling back to an earlier step")

    def _set_aside(self, step: int, suffix: str, why: str) -> None:
        path = os.path.join(self.directory, str(step))
        logging.warning("checkpoint %s %s", path, why)
        if distributed.is_main():
            logging.warning("moved %s to %s", path, set_aside(path, suffix))
        distributed.barrier("checkpoint set aside")
        self.manager.close()
        self.manager = self._manager()

    def close(self) -> None:
        try:
            self.manager.close()
        except Exception:  # noqa: BLE001
            if self._failed is None:  # a failure nobody reported yet
                raise


def save_params(path: str, params) -> None:
    """Save one params pytree to `path` (atomically: temporary directory, then rename)."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        raise ValueError(f"params checkpoint {path!r} already exists; pass a new path or "
                         "delete the old one")
    distributed.barrier("params checkpoint")  # every process checked before one writes
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, params)
        ckpt.wait_until_finished()


def is_complete(path: str) -> bool:
    """Whether a `save_params` directory (or a checkpoint step) was fully written."""
    return os.path.exists(os.path.join(path, _COMMIT_FILE))


def load_params(path: str, target=None):
    """Load params saved by `save_params`. With `target` (arrays or ShapeDtypeStructs, e.g.
    from jax.eval_shape(init_params)), structure/shapes/dtypes are checked and the result
    lands on the target's shardings; without it, arrays come back as saved on one device."""
    path = os.path.abspath(path)
    if not os.path.exists(os.path.join(path, _COMMIT_FILE)):
        raise ValueError(f"no complete params checkpoint at {path!r}; run the SFT cold start "
                         "first (it writes one there) or pass the right path")
    with ocp.StandardCheckpointer() as ckpt:
        if target is None:
            return ckpt.restore(path)
        target = _abstract(target)
        _check_matches(ckpt.metadata(path).item_metadata, target, path)
        return ckpt.restore(path, target)

"""Checkpoints with orbax: atomic, optionally async, keep-N, resume from complete steps only.

Layout (one subdirectory per saved global step):

    <dir>/<step>/state/   the train state: a pytree of arrays (params, optimizer state, counters)
    <dir>/<step>/meta/    a small JSON dict (config, data position, ...)

Which entries are complete steps, and the fate of the rest (cut-short saves' remains removed,
own uncommitted steps moved to `<step>.incomplete`): checkpoint_steps.py.

Restores take the target's shardings (a sharded run resumes sharded) and exact shapes and dtypes
(orbax would silently cast a dtype, breaking bit-exact resume): mismatches raise, naming leaves.

Checksums. `save` stores the step (`checkpoint_step`) and two 32-bit checksums per array in the
meta (plain and position-weighted sums of its 32-bit words, on device); `restore` refuses
changed bits, which orbax restores silently. `restore_latest` tries complete steps newest first,
past any that does not restore (truncated, zero-filled, missing files, garbage metadata, a
checksum mismatch, a stored step other than its name: a copied `<step>`), saying why, and moves
it to `<step>.corrupt` (kept, never deleted) so later saves of it are not skipped.

Failed saves. A failed background save (disk full, a file-size limit, permissions) leaves only
its `*.orbax-checkpoint-tmp` directory; `check_saves` (non-blocking, every training step) and
`wait` raise one `CheckpointSaveError` naming the step, the cause and the fix, stopping the run
at its next step. Orbax's error records (a traceback per array and thread) go to
`checkpoints.log` in the workdir, not the terminal; the error names it.

Interrupts. Ctrl-C (SIGINT) must end a run promptly, but a KeyboardInterrupt in the blocking
part of orbax's async save (writers started, their directory not yet made) lets `close` shut
down the executor that would make it ("cannot schedule new futures after shutdown"), and the
writers wait 300 s for it at exit. So an open `Checkpointer`'s SIGINT handler (main thread, over
Python's own) holds an interrupt inside orbax's `save` until it has started; `stop` (run by the
caller on KeyboardInterrupt, and by an interrupted `wait` or `close`) gives the save in flight
`INTERRUPT_WAIT_S` seconds (a second Ctrl-C ends the wait), then cancels it: done within
`INTERRUPT_WAIT_S + CANCEL_WAIT_S` seconds of the interrupt reaching Python (which cannot stop a
device computation); resume starts from the newest complete step. A KeyboardInterrupt Python
drops (printing it) in a `__del__` or weakref callback is re-raised by `check_saves` and `wait`.
SIGTERM keeps Python's default (exit at once, like a kill, which resume handles)."""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from stablerl_jax import distributed
from stablerl_jax.runs import checkpoint_guards, storage
from stablerl_jax.runs import checkpoint_steps as steps_lib

_CHECKSUMS = "checksums"
LOG_FILE = "checkpoints.log"
INTERRUPT_WAIT_S = 30.0  # the longest an interrupted run waits for the save in flight
CANCEL_WAIT_S = 10.0  # the longest it then waits for orbax to drop a cancelled save


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
    """{'a/b/0/mu': leaf}; NamedTuple fields as dict keys, as orbax records an optax state."""
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
    """A step directory must hold the step it is named for (a copy does not); checkpoints older
    than `save`'s record are judged by the training loop's "step"."""
    stored = steps_lib.stored_step(meta)
    if stored is not None and stored != step:
        raise ValueError(f"it holds the state of step {stored}, not {step} (a copied or "
                         "renamed step directory)")


class Checkpointer:
    """Per-step {'state': pytree of arrays, 'meta': JSON dict}, the newest `keep` kept. While
    open, routes orbax's error records to `<parent of directory>/checkpoints.log` and (main
    thread) handles SIGINT (module docstring); `close` or `stop` ends both."""

    def __init__(self, directory: str, keep: int = 2, async_: bool = True):
        directory = storage.abspath(directory)
        if storage.isfile(directory):
            raise ValueError(f"checkpoint directory {directory!r} is a file; pass a directory "
                             "path (or move the file away)")
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1 (number of checkpoints kept)")
        storage.makedirs(directory)
        if not storage.writable(directory):
            raise PermissionError(f"checkpoint directory {directory!r} is not writable; fix "
                                  "its permissions or use another workdir")
        if distributed.is_main():
            foreign = steps_lib.sort_out(directory)
            if foreign:
                logging.warning(
                    "checkpoint directory %s holds entries these checkpoints did not write, "
                    "left untouched: %s (a save of a step named there stops the run instead "
                    "of overwriting it)", directory, ", ".join(foreign))
        distributed.barrier("checkpoint directory")
        self.directory = directory
        self.keep, self.async_ = keep, async_
        self._pending: int | None = None  # the step of the last save started
        self._failed: CheckpointSaveError | None = None  # reported once, then kept
        self._closed = False
        self._log = checkpoint_guards.ErrorLog(
            os.path.join(os.path.dirname(directory), LOG_FILE), directory)
        try:
            self.manager = self._manager()
        except BaseException:
            self._log.close()
            raise
        self._interrupts = checkpoint_guards.INTERRUPTS
        self._interrupts.open()

    def _manager(self):
        manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, enable_async_checkpointing=self.async_, create=True,
                # Orbax's clean-up deletes every `*.orbax-checkpoint-tmp*` entry, other
                # programs' too: `checkpoint_steps.sort_out` removed the remains of its saves.
                cleanup_tmp_directories=False,
                step_name_format=steps_lib.OwnSteps()),
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})
        if hasattr(manager, "_checkpoint_deleter"):
            manager._checkpoint_deleter = steps_lib.OwnStepDeleter(self.directory)
        return manager

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (an async save still in flight is not listed)."""
        return sorted(s for s in self.manager.all_steps() if storage.exists(
            os.path.join(self.directory, str(s), steps_lib.COMMIT_FILE)))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Start saving `step`; False if orbax skipped it (not above the latest step, unless
        force). Async: arrays are off the devices on return, so `state` may be donated."""
        try:
            json.dumps(meta)
        except TypeError as e:
            raise ValueError(f"checkpoint meta must be JSON-serializable: {e}") from None
        _abstract(state)  # rejects typed PRNG keys before anything is written
        meta = {**meta, _CHECKSUMS: checksums(state), steps_lib.STEP: int(step)}
        # Orbax waits for the previous save before starting this one anyway; waiting
        # here names the step whose save failed, if one did.
        self.check_saves()
        self.wait()
        where = os.path.join(self.directory, str(step))
        taken = ([where] if storage.lexists(where) and step not in self.manager.all_steps()
                 else []) + [p for p in [where + steps_lib.TMP_SUFFIX] if storage.lexists(p)]
        if taken:  # by an entry `checkpoint_steps.sort_out` left alone: orbax would delete it
            self._failed = CheckpointSaveError(
                f"checkpoint {where} could not be saved: {taken[0]} exists and was not "
                "written by these checkpoints (no orbax step metadata naming 'state' and "
                f"'meta' with a step record in the meta); move it out of {self.directory} "
                "or use another workdir, then run the same command again: it resumes from "
                "the last complete checkpoint")
            raise self._failed
        with self._interrupts.holding():  # an interrupt in orbax's save: raised after it
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
        log = f" (orbax's log of the failure: {self._log.path})" if self._log.written else ""
        self._failed = CheckpointSaveError(
            f"checkpoint {where} could not be saved ({cause}); free disk space, raise the "
            "file-size limit or fix the permissions of the checkpoint directory, then run "
            f"the same command again: it resumes from the last complete checkpoint{log}")
        return self._failed

    def check_saves(self) -> None:
        """Raise a background save's CheckpointSaveError (not waiting for one in flight), or
        KeyboardInterrupt for an interrupt that did not end the run."""
        self._interrupts.check()
        if self._failed is not None:
            raise self._failed
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until async saves (and keep-N deletions) are on disk; raise as `check_saves` (a
        CheckpointSaveError once). Interrupted while waiting, it `stop`s."""
        if self._failed is not None or self._closed:
            return  # reported already; nothing more will be written by that save
        try:
            self.manager.wait_until_finished()
        except KeyboardInterrupt:  # in orbax's join (which logged it): bound the rest
            self.stop()
            raise
        except Exception as e:  # noqa: BLE001 (orbax / TensorStore raise many kinds)
            raise self._save_error(self._pending, e) from e
        self._interrupts.check()

    def restore(self, step: int | None, target_state) -> tuple[Any, dict]:
        """(state, meta) of `step` (None: latest complete) with `target_state`'s shapes, dtypes
        and shardings (arrays or ShapeDtypeStructs); raises on a failed restore or checksum."""
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
        meta.pop(steps_lib.STEP, None)
        saved = meta.pop(_CHECKSUMS, None)
        if saved is not None:
            got = checksums(out.state)
            bad = sorted(k for k in saved if got.get(k) != saved[k])
            if bad:
                raise ValueError(f"checkpoint {where}: the bits of {bad[:4]} differ from "
                                 "their checksums at save time (a corrupted file)")
        return out.state, meta

    def read_meta(self, step: int) -> dict:
        """A complete step's meta, state not restored (checked to hold that step)."""
        self.wait()
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = dict(out.meta)
        _check_step(meta, step)
        meta.pop(steps_lib.STEP, None)
        return meta

    def restore_latest(self, target_state, check_meta=None,
                       usable=None) -> tuple[int, Any, dict] | None:
        """(step, state, meta) of the newest complete step that restores, else None; failing
        ones (module docstring) are logged and moved aside. `check_meta(meta)` runs before the
        state restores; its errors (e.g. a changed config) propagate: the caller's, not
        corruption. `usable(step)`: None, or why a sound step may not be resumed from (e.g.
        metrics end before it): moved to `<step>.unusable`, saved again by the resumed run."""
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
        """Log why `step` does not restore; move it aside so a later save can write it again."""
        self._set_aside(step, ".corrupt", f"does not restore ({type(e).__name__}: "
                        f"{str(e)[:300]}); falling back to an earlier step")

    def _set_aside(self, step: int, suffix: str, why: str) -> None:
        path = os.path.join(self.directory, str(step))
        logging.warning("checkpoint %s %s", path, why)
        if distributed.is_main():
            logging.warning("moved %s to %s", path, steps_lib.set_aside(path, suffix))
        distributed.barrier("checkpoint set aside")
        self.manager.close()
        self.manager = self._manager()

    def close(self) -> None:
        """Finish saves in flight and close (idempotent); `stop`s if interrupted meanwhile."""
        if self._closed:
            return
        try:
            self.manager.close()
        except KeyboardInterrupt:
            self.stop()
            raise
        except Exception:  # noqa: BLE001
            if self._failed is None:  # a failure nobody reported yet
                raise
        finally:
            self._release()

    def _release(self) -> None:
        if not self._closed:
            self._closed = True
            self._interrupts.close()
            self._log.close()

    def stop(self, timeout_s: float = INTERRUPT_WAIT_S) -> None:
        """Close after an interrupt (module docstring, "Interrupts"): the save in flight gets
        timeout_s (another Ctrl-C ends the wait), then is cancelled (CANCEL_WAIT_S more at
        most), its `*.orbax-checkpoint-tmp` directory left to the next Checkpointer (if orbax
        keeps it, Python waits for its threads at exit). Raises nothing: the caller reports the
        interrupt (a failed save is in the log); `wait` and `close` then no-op."""
        if self._closed:
            return
        self._interrupts.pending = False  # this one ends the run
        seen = self._interrupts.count
        try:
            with self._interrupts.holding(raise_after=False):
                try:
                    self._wait_saving(timeout_s, lambda: self._interrupts.count == seen)
                except KeyboardInterrupt:  # a second one, where the handler is not ours
                    pass
                if self._saving():
                    # Orbax 0.12's CheckpointManager has no cancel; its async
                    # checkpointer's drops the writes and leaves the step uncommitted.
                    cancel = getattr(getattr(self.manager, "_checkpointer", None), "cancel",
                                     None)
                    if cancel is not None:
                        cancel()
                    self._wait_saving(CANCEL_WAIT_S, lambda: True)
                if not self._saving():  # else close would wait for it: leave it to exit
                    try:
                        self.manager.close()
                    except Exception:  # noqa: BLE001 (a failed or cancelled save)
                        pass
        finally:
            self._release()

    def _saving(self) -> bool:
        return self.manager.is_saving_in_progress()

    def _wait_saving(self, timeout_s: float, go_on) -> None:
        """Poll (joining orbax's thread would log a KeyboardInterrupt's traceback)."""
        deadline = time.monotonic() + timeout_s
        while self._saving() and time.monotonic() < deadline and go_on():
            time.sleep(0.05)


def save_params(path: str, params) -> None:
    """Save one params pytree to `path` (atomically: temporary directory, then rename)."""
    path = storage.abspath(path)
    if storage.exists(path):
        raise ValueError(f"params checkpoint {path!r} already exists; pass a new path or "
                         "delete the old one")
    distributed.barrier("params checkpoint")  # every process checked before one writes
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, params)
        ckpt.wait_until_finished()


def is_complete(path: str) -> bool:
    """Whether a `save_params` directory (or a checkpoint step) was fully written."""
    return storage.exists(os.path.join(path, steps_lib.COMMIT_FILE))


def load_params(path: str, target=None):
    """Load `save_params` output. With `target` (arrays or ShapeDtypeStructs, e.g.
    jax.eval_shape(init_params)) structure, shapes and dtypes are checked and the result lands
    on its shardings; without it, arrays come back as saved, on one device."""
    path = storage.abspath(path)
    if not storage.exists(os.path.join(path, steps_lib.COMMIT_FILE)):
        raise ValueError(f"no complete params checkpoint at {path!r}; run the SFT cold start "
                         "first (it writes one there) or pass the right path")
    with ocp.StandardCheckpointer() as ckpt:
        if target is None:
            return ckpt.restore(path)
        target = _abstract(target)
        _check_matches(ckpt.metadata(path).item_metadata, target, path)
        return ckpt.restore(path, target)

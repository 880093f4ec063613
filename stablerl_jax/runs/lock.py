"""One run per workdir: an exclusive lock file, `<workdir>/run.lock`.

Two runs in one workdir would interleave metrics rows and race on checkpoint steps, so the
second refuses at once, naming the holder. The lock is an `fcntl.flock`: one open file holds it
at a time and the kernel drops it when the holder exits (SIGKILL included), so racing processes
cannot both win and a crash never blocks the next run. The content (host, pid, start time, as
JSON) only names the holder and is emptied on a clean release: content found on locking is a
dead holder's, taken over with a warning. The file is never opened through a symbolic link
(`storage.open_no_follow`: a `run.lock` link is refused, its target untouched; a linked workdir
is followed) and never deleted (a third process could lock a new file of that name while a
second holds the old one). Process 0 holds it for a multi-process run; within a process it is
re-entrant (an entry point locking before the cold start and its training loop share one hold).

On an object store (a `gs://` workdir) the lock is the object `<workdir>/run.lock` under
generation preconditions (storage_gcs.py): created only if absent, naming the holder (host, pid,
start time, boot id), rewritten every HEARTBEAT_S seconds by a daemon thread only if still this
run's version. A run finding it refuses unless the holder is dead (not renewed, by the store's
clock, for STALE_AFTER_S, or a gone process of this host and boot), then takes it over under the
precondition of the version read, with a warning. A run whose lock was taken over (stalled, or
cut off from the store) learns it at its next renewal and stops at its next step (`check_held`),
never deleting the new holder's object; a clean release deletes it. Host clocks must agree with
the store's to well within STALE_AFTER_S (NTP does)."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import socket
import threading
import time

from stablerl_jax.runs import storage, storage_gcs

LOCK_FILE = "run.lock"
HEARTBEAT_S = 60.0  # how often a run on an object store renews its lock object
STALE_AFTER_S = 600.0  # a lock object not renewed for this long is a dead run's

_held: dict[str, list] = {}  # lock file's realpath (or URI) -> [fd or _ObjectLock, depth]


class WorkdirBusy(ValueError):
    """Another live run holds the workdir's lock."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _holder_text(info: dict) -> str:
    started = info.get("started")
    when = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
            if isinstance(started, (int, float)) else "an unknown time")
    return f"pid {info.get('pid')} on host {info.get('host')!r} (started {when})"


def _read_holder(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    return _parse_holder(raw) if raw.strip() else None


def acquire(workdir: str) -> str:
    """Lock `workdir` (created if missing) for this process; returns the lock file's path.
    Raises WorkdirBusy naming the holder when another process holds it."""
    if storage.is_remote(workdir):
        path = os.path.join(workdir.rstrip("/"), LOCK_FILE)
        if path in _held:
            _held[path][1] += 1
        else:
            _held[path] = [_ObjectLock(workdir, path), 1]
        return path
    os.makedirs(workdir, exist_ok=True)
    # A workdir that is a link is followed; a lock file that is one is refused.
    path = os.path.join(os.path.realpath(workdir), LOCK_FILE)
    if path in _held:
        _held[path][1] += 1
        return path
    fd = storage.open_no_follow(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        who = _holder_text(holder) if holder else "another process"
        raise WorkdirBusy(
            f"workdir {workdir!r} is in use by {who} (lock file {path}); wait for that run "
            "to finish or stop it, or pass another --workdir") from None
    try:
        stale = _read_holder(fd)
        if stale is not None:
            here = stale.get("host") == socket.gethostname()
            pid = stale.get("pid")
            why = ("that process is gone" if here and isinstance(pid, int)
                   and not _pid_alive(pid) else "it no longer holds the lock")
            logging.warning("workdir %s: taking over the lock of %s: %s", workdir,
                            _holder_text(stale), why)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(me) + "\n").encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)  # closing drops the flock
        raise
    _held[path] = [fd, 1]
    return path


def release(path: str) -> None:
    """Undo one `acquire` returning `path`; the last one empties the file and unlocks."""
    entry = _held.get(path)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _held[path]
    if isinstance(entry[0], _ObjectLock):
        entry[0].release()
        return
    fd = entry[0]
    try:
        os.ftruncate(fd, 0)  # empty: a released lock, not a dead holder
    finally:
        os.close(fd)


def check_held() -> None:
    """Raise WorkdirBusy if another run took over a held object-store lock; called every step."""
    for entry in list(_held.values()):
        if isinstance(entry[0], _ObjectLock) and entry[0].lost:
            raise WorkdirBusy(entry[0].lost)


def _boot_id() -> str | None:
    """This machine's boot (Linux): a holder on this host from before a reboot is gone."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


class _ObjectLock:
    """The lock of a workdir on an object store (module docstring), held once made."""

    def __init__(self, workdir: str, path: str):
        self.workdir, self.path, self.lost = workdir, path, None
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                   "boot": _boot_id(), "token": secrets.token_hex(8)}
        self.generation = self._take()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True,
                                        name=f"lock heartbeat {path}")
        self._thread.start()

    def _data(self) -> bytes:
        return (json.dumps({**self.me, "heartbeat": time.time()}) + "\n").encode()

    def _take(self) -> int:
        for _ in range(8):  # each round: another run wrote the object in between
            generation = storage_gcs.create_object(self.path, self._data())
            if generation is not None:
                return generation
            found = storage_gcs.read_object(self.path)
            if found is None:
                continue  # released in between
            holder = _parse_holder(found.data)
            if holder.get("token") == self.me["token"]:
                return found.generation  # our own create, sent twice by a retry
            why = self._dead(holder, found.updated)
            if why is None:
                age = max(0.0, time.time() - found.updated)
                raise WorkdirBusy(
                    f"workdir {self.workdir!r} is in use by {_holder_text(holder)}, its "
                    f"lock renewed {age:.0f} s ago (lock object {self.path}); wait for "
                    "that run to finish or stop it, or pass another --workdir")
            generation = storage_gcs.replace_object(self.path, self._data(), found.generation)
            if generation is not None:
                logging.warning("workdir %s: taking over the lock of %s: %s", self.workdir,
                                _holder_text(holder), why)
                return generation
        raise WorkdirBusy(f"workdir {self.workdir!r}: its lock object {self.path} kept "
                          "changing while this run tried to take it; another run is "
                          "starting there: pass another --workdir")

    def _dead(self, holder: dict, updated: float) -> str | None:
        """Why the holder of a lock object last written at `updated` is gone, or None."""
        if holder.get("host") == self.me["host"]:
            pid = holder.get("pid")
            if holder.get("boot") and self.me["boot"] and holder["boot"] != self.me["boot"]:
                return "this host was restarted since"
            if isinstance(pid, int) and not _pid_alive(pid):
                return "that process is gone"
        age = time.time() - updated
        if age > STALE_AFTER_S:
            return f"its lock was last renewed {age:.0f} s ago (> {STALE_AFTER_S:.0f} s)"
        return None

    def _renew(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                generation = storage_gcs.replace_object(self.path, self._data(), self.generation)
            except Exception as e:  # noqa: BLE001 (a network error: try again next time)
                logging.warning("workdir %s: could not renew the run lock (%s); trying again "
                                "in %.0f s", self.workdir, " ".join(str(e).split())[:200],
                                HEARTBEAT_S)
                continue
            if generation is None:
                self._lose()
                return
            self.generation = generation

    def _lose(self) -> None:
        try:
            found = storage_gcs.read_object(self.path)
        except Exception:  # noqa: BLE001 (the run stops either way)
            found = None
        who = _holder_text(_parse_holder(found.data)) if found else "another run"
        self.lost = (f"workdir {self.workdir!r}: the run lock was taken over by {who} while "
                     f"this run held it (not renewed for over {STALE_AFTER_S:.0f} s: this "
                     "process stalled or could not reach the store); stopped so that two "
                     "runs do not write one workdir")
        logging.error("%s", self.lost)

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        if not self.lost:
            storage_gcs.delete_object(self.path, self.generation)


def _parse_holder(raw: bytes) -> dict:
    try:
        info = json.loads(raw)
    except ValueError:
        return {"pid": None, "host": None}
    return info if isinstance(info, dict) else {"pid": None, "host": None}


class Lock:
    """`with workdir.Lock(path, enabled):` holds the lock of `path` for the block (a
    no-op when not enabled: every process of a multi-process run but the first)."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.workdir, self.enabled, self.path = workdir, enabled, None

    def __enter__(self):
        if self.enabled:
            self.path = acquire(self.workdir)
        return self

    def __exit__(self, *exc):
        if self.path is not None:
            release(self.path)
            self.path = None

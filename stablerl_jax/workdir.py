"""One run per workdir: an exclusive lock file, `<workdir>/run.lock`.

Two runs writing one workdir interleave their metrics rows and race on the same
checkpoint step directories, so the second one to start refuses at once, naming the
holder. The lock is an OS-level `fcntl.flock` on the lock file: the kernel grants it to
one open file at a time and drops it when its holder exits, however it exits (SIGKILL
included), so two processes racing cannot both win and a crashed run never blocks the
next one. The file's content only names the holder for the messages (host, pid, start
time, as JSON); it is emptied on a clean release. Content found by a run that gets the
lock is therefore a holder that died without releasing: it is taken over and said so.

The file is never deleted: unlinking it would let a third process lock a new file of the
same name while a second still holds the old one. In a multi-process run process 0 holds
the lock for all (the others share its workdir). Within one process the lock is
re-entrant: an entry point that locks the workdir before the cold start and the training
loop that locks it again share one hold.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time

LOCK_FILE = "run.lock"

_held: dict[str, list] = {}  # realpath of a lock file -> [fd, depth]


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
    if not raw.strip():
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return {"pid": None, "host": None}
    return info if isinstance(info, dict) else {"pid": None, "host": None}


def acquire(workdir: str) -> str:
    """Lock `workdir` (created if missing) for this process; returns the lock file's path.
    Raises WorkdirBusy naming the holder when another process holds it."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.realpath(os.path.join(workdir, LOCK_FILE))
    if path in _held:
        _held[path][1] += 1
        return path
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
    fd = entry[0]
    try:
        os.ftruncate(fd, 0)  # empty: a released lock, not a dead holder
    finally:
        os.close(fd)


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

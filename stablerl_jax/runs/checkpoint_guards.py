"""What an open Checkpointer (checkpoint.py) installs around orbax: a workdir log file for a
failed save's orbax error records (`ErrorLog`, `ORBAX_ERRORS`), also taking the unraisable
"Event loop is closed" errors (a printed traceback each) of TensorStore callbacks completing
after the save's event loop closed; and a SIGINT handler holding a Ctrl-C inside orbax's save
until the save has started (`INTERRUPTS`; checkpoint.py's module docstring, "Interrupts")."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import traceback

from stablerl_jax.runs import storage


class UnraisableHook:
    """The guards' one `sys.unraisablehook`: an error no handler takes goes to the prior hook.
    Installed while a handler is registered; handed back when the last leaves, unless replaced
    since. One hook for all guards, so two cannot each hold the other as the hook they replaced
    (a loop); an error raised inside it (same thread) goes to Python's own."""

    def __init__(self):
        self.handlers: list = []
        self.prior = None  # the hook ours replaced, while installed
        self._busy = threading.local()

    def add(self, handler) -> None:
        if handler not in self.handlers:
            self.handlers.append(handler)
        if sys.unraisablehook != self.hook:  # not installed, or replaced since
            self.prior, sys.unraisablehook = sys.unraisablehook, self.hook

    def remove(self, handler) -> None:
        if handler in self.handlers:
            self.handlers.remove(handler)
        if not self.handlers and sys.unraisablehook == self.hook:
            sys.unraisablehook, self.prior = self.prior, None

    def hook(self, info) -> None:
        if getattr(self._busy, "on", False):
            return sys.__unraisablehook__(info)
        self._busy.on = True
        try:
            if not any(handler(info) for handler in list(self.handlers)):
                (self.prior or sys.__unraisablehook__)(info)
        finally:
            self._busy.on = False


UNRAISABLE = UnraisableHook()


class ErrorLog:
    """One open Checkpointer's log file of orbax errors (on an object store, an object uploaded
    whole per record). A record it cannot take (the failed save's disk is full) is dropped
    silently: logging would print a traceback instead."""

    def __init__(self, path: str, directory: str):
        self.path, self.directory, self.written, self.closed = path, directory, False, False
        self._file = storage.log_handler(path)
        self._file.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s [%(threadName)s] %(pathname)s:%(lineno)d: %(message)s"))
        self._file.handleError = self._dropped
        self._failed = False
        ORBAX_ERRORS.add(self)

    def _dropped(self, record) -> None:
        self._failed = True

    def write(self, record) -> None:
        self._failed = False
        self._file.handle(record)
        self.written = self.written or not self._failed
        if not self._failed:
            ORBAX_ERRORS.took(self)

    def close(self) -> None:
        """Stop taking records; the log that took the latest stays open for its failed save's
        late errors (`OrbaxErrors.recent`)."""
        self.closed = True
        ORBAX_ERRORS.remove(self)
        if ORBAX_ERRORS.recent is not self:
            self._file.close()

    def _close_file(self) -> None:
        self._file.close()


def _after_loop_closed(info) -> bool:
    """Whether an unraisable error is asyncio's "Event loop is closed" in
    `call_soon_threadsafe`: a TensorStore write outliving a failed or cancelled save's event
    loop."""
    return (isinstance(info.exc_value, RuntimeError)
            and str(info.exc_value) == "Event loop is closed"
            and any(f.name == "call_soon_threadsafe"
                    for f in traceback.extract_tb(info.exc_traceback)))


class OrbaxErrors(logging.Filter):
    """On the 'absl' logger (orbax's): while a Checkpointer is open, orbax's error records go to
    the log of the open Checkpointer whose directory they name (else the newest), not the
    terminal. A failed save's leftovers, possibly after its Checkpointer closed, go to the log
    that took the latest record (`recent`, kept open with the hook): asyncio's "Task exception
    was never retrieved" of orbax tasks naming its directory, and (`sys.unraisablehook`) its
    late callbacks' errors (`_after_loop_closed`). Inert unless a log is open or took one."""

    def __init__(self):
        super().__init__()
        self.logs: list[ErrorLog] = []
        self.recent: ErrorLog | None = None  # the log that took the latest record

    def took(self, log: ErrorLog) -> None:
        if self.recent is not None and self.recent is not log and self.recent.closed:
            self.recent._close_file()
        self.recent = log

    def add(self, log: ErrorLog) -> None:
        self.logs.append(log)
        UNRAISABLE.add(self._unraisable)

    def remove(self, log: ErrorLog) -> None:
        if log in self.logs:
            self.logs.remove(log)
        if not self.logs and self.recent is None:
            UNRAISABLE.remove(self._unraisable)

    def _unraisable(self, info) -> bool:
        target = self.recent or (self.logs[-1] if self.logs else None)
        if target is None or not _after_loop_closed(info):
            return False
        target.write(logging.LogRecord(
            "orbax", logging.ERROR, __file__, 0, "a checkpoint save's callback ran after "
            "the save's event loop closed (a failed or cancelled save)", None,
            (info.exc_type, info.exc_value, info.exc_traceback)))
        return True

    def filter(self, record) -> bool:
        orbax = f"{os.sep}orbax{os.sep}"
        from_orbax = orbax in record.pathname and self.logs
        late = record.name == "asyncio" and (self.logs or self.recent)
        if record.levelno < logging.ERROR or not (from_orbax or late):
            return True
        try:
            text = record.getMessage()
            if record.exc_info:
                text += logging.Formatter().formatException(record.exc_info)
        except Exception:  # noqa: BLE001 (a malformed record still goes to a log)
            text = ""
        if from_orbax:
            log = next((log for log in reversed(self.logs)
                        if log.directory + os.sep in text), self.logs[-1])
        else:  # asyncio's "Task exception was never retrieved" of a failed save's task
            logs = self.logs + [log for log in [self.recent] if log not in self.logs]
            log = next((log for log in reversed(logs) if orbax in text
                        and log.directory + os.sep in text), None)
            if log is None:
                return True
        log.write(record)
        return False


ORBAX_ERRORS = OrbaxErrors()
logging.getLogger("absl").addFilter(ORBAX_ERRORS)
# Orbax's save tasks that failed are garbage-collected later, maybe after the
# Checkpointer closed: asyncio then logs "Task exception was never retrieved", a
# traceback each (the failure is reported already, by CheckpointSaveError).
logging.getLogger("asyncio").addFilter(ORBAX_ERRORS)


class Interrupts:
    """SIGINT while Checkpointers are open (checkpoint.py, "Interrupts"): one handler, installed
    by the first to open, only in the main thread over Python's own (not where SIGINT is
    ignored, as in a background job, or caller-handled); handed back by the last to close."""

    def __init__(self):
        self.count = 0  # interrupts received
        self.pending = False  # one received and not yet seen to end the run
        self._holding = self._deferred = False
        self._users, self._installed = 0, False

    def open(self) -> None:
        self._users += 1
        self.pending = False  # one left by a run that ended without closing is not ours
        if (not self._installed and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, self._handle)
            UNRAISABLE.add(self._unraisable)
            self._installed = True

    def close(self) -> None:
        self._users -= 1
        if (self._users > 0 or not self._installed
                or threading.current_thread() is not threading.main_thread()):
            return
        self._installed = False
        if signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        UNRAISABLE.remove(self._unraisable)

    def _handle(self, signum, frame) -> None:
        self.count += 1
        self.pending = True
        if self._holding:
            self._deferred = True
        else:
            raise KeyboardInterrupt

    def _unraisable(self, info) -> bool:
        # A KeyboardInterrupt raised inside a __del__ or weakref callback: Python prints it
        # and goes on; `check` raises it again, so it need not be printed.
        return self.pending and issubclass(info.exc_type, KeyboardInterrupt)

    @contextlib.contextmanager
    def holding(self, *, raise_after: bool = True):
        """Interrupts in the block are only counted; with raise_after, one that came
        is raised when the outermost block ends normally."""
        outer = self._holding
        self._holding = True
        try:
            yield
        finally:
            self._holding = outer
        if raise_after and self._deferred and not outer:
            self._deferred = False
            raise KeyboardInterrupt

    def check(self) -> None:
        """Raise KeyboardInterrupt for an interrupt that did not end the run."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


INTERRUPTS = Interrupts()

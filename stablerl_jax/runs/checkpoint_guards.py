"""What an open Checkpointer (checkpoint.py) installs around orbax: orbax's error records
of a failed save sent to a log file in the workdir instead of the terminal (`ErrorLog`,
`ORBAX_ERRORS`; so are the "Event loop is closed" errors of TensorStore's callbacks that
complete after a failed save's event loop closed, which Python prints as unraisable
exceptions, a traceback each), and the SIGINT handler that holds a Ctrl-C landing inside orbax's save
until the save has started (`INTERRUPTS`; checkpoint.py's module docstring,
"Interrupts")."""
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
    """The guards' one `sys.unraisablehook`: each handler (a guard's) says whether it took
    the error, and one none took goes to the hook that was in place before. Installed while
    a handler is registered and handed back when the last one leaves, unless another hook
    was installed over it since. One hook for all the guards, so that no two of them can
    each hold the other as the hook they replaced (a guard opening again after another
    replaced it would otherwise chain the two in a loop); an error raised while the hook
    runs in the same thread goes to Python's own."""

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
    """The log file of one open Checkpointer's orbax errors. A record the file cannot take
    (the disk that failed the save is full) is dropped without a word: logging's own
    report of that would be a traceback on the terminal again. On an object store the
    file is an object, uploaded again whole at each record."""

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
        """Stop taking orbax's records; the log that took the latest one stays open for
        the late errors of its failed save (`OrbaxErrors.recent`)."""
        self.closed = True
        ORBAX_ERRORS.remove(self)
        if ORBAX_ERRORS.recent is not self:
            self._file.close()

    def _close_file(self) -> None:
        self._file.close()


def _after_loop_closed(info) -> bool:
    """Whether an unraisable exception is asyncio's "Event loop is closed" raised in
    `call_soon_threadsafe`: a TensorStore write of a save completing after the event
    loop of orbax's save thread closed, which a failed (or cancelled) save leaves."""
    return (isinstance(info.exc_value, RuntimeError)
            and str(info.exc_value) == "Event loop is closed"
            and any(f.name == "call_soon_threadsafe"
                    for f in traceback.extract_tb(info.exc_traceback)))


class OrbaxErrors(logging.Filter):
    """On the 'absl' logger (orbax logs there): while a Checkpointer is open, orbax's error
    records go, tracebacks and all, to the log of the open Checkpointer whose directory
    they name (else the newest one's) instead of the terminal. What a failed save leaves
    behind goes to the log that took the latest record (that of the failed save), open
    or not: on the 'asyncio' logger, "Task exception was never retrieved" of orbax's
    tasks naming its directory, and, through `sys.unraisablehook`, the unraisable errors
    of a save's callbacks after its event loop closed (`_after_loop_closed`). Those may
    come after its Checkpointer closed (TensorStore's writes of a failed save end when
    they end, its tasks are collected when they are), so that log stays open for them
    (`recent`), and the hook with it. Inert otherwise: the hook is installed while a log
    is open or has taken a record."""

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
    """SIGINT while Checkpointers are open (module docstring, "Interrupts"), one handler
    for all of them: installed by the first to open, in the main thread and over Python's
    own handler only (not where SIGINT is ignored, as in a background job, nor where the
    caller handles it), and handed back when the last one closes."""

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

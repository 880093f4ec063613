"""What an open Checkpointer (checkpoint.py) installs around orbax: orbax's error records
of a failed save sent to a log file in the workdir instead of the terminal (`ErrorLog`,
`ORBAX_ERRORS`), and the SIGINT handler that holds a Ctrl-C landing inside orbax's save
until the save has started (`INTERRUPTS`; checkpoint.py's module docstring,
"Interrupts")."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading

from stablerl_jax import storage


class ErrorLog:
    """The log file of one open Checkpointer's orbax errors. A record the file cannot take
    (the disk that failed the save is full) is dropped without a word: logging's own
    report of that would be a traceback on the terminal again. On an object store the
    file is an object, uploaded again whole at each record."""

    def __init__(self, path: str, directory: str):
        self.path, self.directory, self.written = path, directory, False
        self._file = storage.log_handler(path)
        self._file.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s [%(threadName)s] %(pathname)s:%(lineno)d: %(message)s"))
        self._file.handleError = self._dropped
        self._failed = False
        ORBAX_ERRORS.logs.append(self)

    def _dropped(self, record) -> None:
        self._failed = True

    def write(self, record) -> None:
        self._failed = False
        self._file.handle(record)
        self.written = self.written or not self._failed

    def close(self) -> None:
        if self in ORBAX_ERRORS.logs:
            ORBAX_ERRORS.logs.remove(self)
        self._file.close()


class OrbaxErrors(logging.Filter):
    """On the 'absl' logger (orbax logs there): while a Checkpointer is open, orbax's error
    records go, tracebacks and all, to the log of the open Checkpointer whose directory
    they name (else the newest one's) instead of the terminal. Inert otherwise."""

    def __init__(self):
        super().__init__()
        self.logs: list[ErrorLog] = []

    def filter(self, record) -> bool:
        if (not self.logs or record.levelno < logging.ERROR
                or f"{os.sep}orbax{os.sep}" not in record.pathname):
            return True
        try:
            text = record.getMessage()
            if record.exc_info:
                text += logging.Formatter().formatException(record.exc_info)
        except Exception:  # noqa: BLE001 (a malformed record still goes to a log)
            text = ""
        log = next((log for log in reversed(self.logs) if log.directory + os.sep in text),
                   self.logs[-1])
        log.write(record)
        return False


ORBAX_ERRORS = OrbaxErrors()
logging.getLogger("absl").addFilter(ORBAX_ERRORS)


class Interrupts:
    """SIGINT while Checkpointers are open (module docstring, "Interrupts"), one handler
    for all of them: installed by the first to open, in the main thread and over Python's
    own handler only (not where SIGINT is ignored, as in a background job, nor where the
    caller handles it), and handed back when the last one closes."""

    def __init__(self):
        self.count = 0  # interrupts received
        self.pending = False  # one received and not yet seen to end the run
        self._holding = self._deferred = False
        self._users, self._installed, self._hook = 0, False, None

    def open(self) -> None:
        self._users += 1
        self.pending = False  # one left by a run that ended without closing is not ours
        if (not self._installed and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, self._handle)
            self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
            self._installed = True

    def close(self) -> None:
        self._users -= 1
        if (self._users > 0 or not self._installed
                or threading.current_thread() is not threading.main_thread()):
            return
        self._installed = False
        if signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._hook

    def _handle(self, signum, frame) -> None:
        self.count += 1
        self.pending = True
        if self._holding:
            self._deferred = True
        else:
            raise KeyboardInterrupt

    def _unraisable(self, info) -> None:
        # A KeyboardInterrupt raised inside a __del__ or weakref callback: Python prints it
        # and goes on; `check` raises it again, so it need not be printed.
        if not (self.pending and issubclass(info.exc_type, KeyboardInterrupt)):
            self._hook(info)

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

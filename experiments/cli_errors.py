"""One-line errors at the command line: an entry point's user error (a bad setting, file
or workdir, a failed checkpoint save: the messages name the field or file and the fix)
prints as one line on stderr and exits with status 2, the way argparse reports a bad
argument; `--traceback` shows the full traceback instead. Ctrl-C (KeyboardInterrupt) also
ends in one line, with status 130 (128 + SIGINT: what a shell reports for a command that
Ctrl-C ended); the training loops have by then finished or dropped the checkpoint save in
flight, within the bound stablerl_jax/runs/checkpoint.py states. Anything else (a bug) keeps
its traceback."""
from __future__ import annotations

import functools
import inspect
import os
import sys

from stablerl_jax.runs.checkpoint import CheckpointSaveError

# ValueError covers ConfigError, WorkdirBusy and JSON decoding errors; OSError a workdir
# or file that cannot be read or written (permissions, a full disk, a missing path).
USER_ERRORS = (ValueError, OSError, CheckpointSaveError)
FLAG = "--traceback"


def one_line_errors(main):
    """Wrap an entry point `main(..., argv=None, ...)`: strips `--traceback` from argv
    (sys.argv[1:] when None) and turns USER_ERRORS into one line and SystemExit(2), and
    KeyboardInterrupt into one line and SystemExit(130)."""
    sig = inspect.signature(main)

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        argv = bound.arguments.get("argv")
        argv = list(sys.argv[1:] if argv is None else argv)
        full = FLAG in argv
        bound.arguments["argv"] = [a for a in argv if a != FLAG]
        prog = os.path.basename(sys.argv[0]) or "stablerl_jax"
        try:
            return main(*bound.args, **bound.kwargs)
        except USER_ERRORS as e:
            if full:
                raise
            msg = " ".join(str(e).split()) or type(e).__name__
            print(f"{prog}: error: {msg} ({FLAG} for the full traceback)", file=sys.stderr,
                  flush=True)
            raise SystemExit(2) from None
        except KeyboardInterrupt:
            if full:
                raise
            print(f"{prog}: interrupted; run the same command again to resume from the last "
                  "complete checkpoint", file=sys.stderr, flush=True)
            raise SystemExit(130) from None

    return wrapped

"""Old `python -m` names of commands that now live with the entry points (`experiments/`):
a command lives there, not inside the layer it exercises. The old module calls
`run_moved` when run as a script; it imports nothing of the entry points."""
import importlib.util
import runpy
import sys


def run_moved(old: str, new: str) -> None:
    """Run module `new` as `python -m new` would, after a note on stderr naming it. Away
    from the repository root, where `experiments/` is not importable: one line saying
    where the command went, exit 2."""
    if importlib.util.find_spec(new.split(".")[0]) is None:
        print(f"{old} is now {new}: run `python -m {new}` from the repository root",
              file=sys.stderr)
        sys.exit(2)
    print(f"note: {old} is now {new} (python -m {new})", file=sys.stderr)
    runpy.run_module(new, run_name="__main__", alter_sys=True)

"""The old name of the command `python -m experiments.bitwise_check` (a command lives with the
entry points, not inside the layer it exercises). Run from the repository root,
`python -m stablerl_jax.sampling.bitwise_check ...` says so on stderr and runs it; it imports
nothing of the package, so it draws no arrow."""
import importlib.util
import runpy
import sys

NEW = "experiments.bitwise_check"

if __name__ == "__main__":
    if importlib.util.find_spec("experiments") is None:
        print(f"stablerl_jax.sampling.bitwise_check is now {NEW}: run `python -m {NEW}` from the "
              "repository root", file=sys.stderr)
        sys.exit(2)
    print(f"note: stablerl_jax.sampling.bitwise_check is now {NEW} (python -m {NEW})",
          file=sys.stderr)
    runpy.run_module(NEW, run_name="__main__", alter_sys=True)

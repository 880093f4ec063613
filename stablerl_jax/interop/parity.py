"""The old name of the command `python -m experiments.parity` (stablerl_jax/moved.py)."""
from stablerl_jax.moved import run_moved

if __name__ == "__main__":
    run_moved("stablerl_jax.interop.parity", "experiments.parity")

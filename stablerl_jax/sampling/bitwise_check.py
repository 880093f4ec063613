"""The old name of the command `python -m experiments.bitwise_check` (stablerl_jax/moved.py)."""
from stablerl_jax.moved import run_moved

if __name__ == "__main__":
    run_moved("stablerl_jax.sampling.bitwise_check", "experiments.bitwise_check")

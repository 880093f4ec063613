"""The old name of rl/step_fns.py (the training engine's step functions): importing it
warns and gives that module."""
import sys
import warnings

from stablerl_jax.rl import step_fns

warnings.warn("stablerl_jax.rl.steps is now stablerl_jax.rl.step_fns", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = step_fns

"""Experiment entry points: `python -m experiments.<name>`.

Importing the package comes before anything else an entry point does, so this is where a
host without a TPU tells libtpu (the `tpu` extra) not to probe for hardware, before JAX
starts a backend (stablerl_jax/libtpu_env.py; a TPU host is left as it is).
"""
from stablerl_jax.libtpu_env import quiet_libtpu

quiet_libtpu()

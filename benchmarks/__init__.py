"""Benchmark entry points: `python -m benchmarks.<name>`. As for the experiments, a host
without a TPU tells libtpu not to probe for hardware before JAX starts a backend
(stablerl_jax/pod/libtpu_env.py)."""
from stablerl_jax.pod.libtpu_env import quiet_libtpu

quiet_libtpu()

"""Wall-clock timing shared by the benchmarks: compile + warm-up once, then the median;
`phase` prints a line as each long phase starts, so a benchmark shows progress."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

_START = time.perf_counter()


def phase(what: str) -> None:
    """One line when a phase starts, with the seconds since the benchmark began."""
    print(f"[{time.perf_counter() - _START:6.0f} s] {what}", flush=True)


def median_seconds(fn, *args, reps: int = 3) -> float:
    """Median over `reps` calls of fn(*args), after one untimed call (compile, warm-up);
    every call is waited for with block_until_ready (device work is asynchronous)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def matmul_peak(dtype, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of a bare n×n×n `jnp.dot` of random `dtype` matrices (float32 accumulation,
    output in `dtype`): the measured peak the benchmarks report rates against."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype))
    return 2 * n**3 / median_seconds(f, a, b, reps=reps)

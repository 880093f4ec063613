"""Wall-clock timing shared by the benchmarks: compile + warm-up once, then the median."""
from __future__ import annotations

import time

import jax
import numpy as np


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

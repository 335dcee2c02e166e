"""Timing helper shared by the benchmark scripts (run as `python benchmarks/<script>.py`, which puts this folder
on sys.path)."""

import time

import jax
import numpy as np


def median_seconds(fn, repeats: int = 3) -> float:
    """Median wall seconds of `fn()` (its result blocked on) over `repeats` calls, after one untimed warm-up
    call (compilation)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))

"""Helpers shared by the benchmark scripts (run as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import statistics
import time

import jax


def timeit(fn, *args, reps: int = 10, warmup: int = 2) -> float:
    """Median wall time (s) of `fn(*args)` over `reps` calls after `warmup`, each waited for."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_flops(batch: int, heads: int, tokens: int, head_dim: int, causal: bool, bwd: bool) -> float:
    """Matmul FLOPs of attention over `tokens`: 4 B H T^2 D forward, half when causal, x3.5 with the backward."""
    f = 4.0 * batch * heads * tokens * tokens * head_dim * (0.5 if causal else 1.0)
    return f * (3.5 if bwd else 1.0)

"""Median wall time of a GPU-check step, the device drained before and after each run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)

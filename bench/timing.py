"""Timing of GPU (or CPU) calls for the micro-benchmarks: warm-ups, then repeated timings each
between two synchronisations, reported as a median with its [min, max]."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], reps: int, cuda: bool, inner: int = 1) -> list[float]:
    """Seconds per call of `fn`: two warm-up calls (compiling happens there), then `reps`
    timings of `inner` calls each between two synchronisations, divided by `inner`."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        if cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / inner)
    return out


def spread_ms(ts: list[float], digits: int = 3) -> str:
    """'median [min, max]' of timings in seconds, in milliseconds."""
    med = statistics.median(ts) * 1e3
    return f"{med:.{digits}f} [{min(ts) * 1e3:.{digits}f}, {max(ts) * 1e3:.{digits}f}]"

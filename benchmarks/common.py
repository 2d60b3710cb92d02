"""Small helpers shared by the benchmark modules: timing and markdown tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def best_of(fn: Callable[[], object], *, repeat: int = 5, number: int = 1) -> float:
    """The fastest of `repeat` timings of `number` calls, in seconds per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of samples, by linear interpolation."""
    return statistics.quantiles(samples, n=100, method="inclusive")[max(0, min(98, int(q) - 1))]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)

"""The engine's lock, with the time each holder kept it, per operation.

Every handler and background task takes the engine lock for short sections; `hold(operation)`
records how long each outermost hold lasted, so a slow section shows up under its operation's
name (the benchmark and the status read `stats()`). Re-entrant holds count once, in the
outermost one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec

__all__ = ["HoldStats", "TimedLock"]


class HoldStats(msgspec.Struct):
    """How long one operation held the engine lock: count, total and longest, in seconds."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0


class TimedLock:
    """A re-entrant lock whose holds are timed per operation name."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()
        self._stats: dict[str, HoldStats] = {}
        self._stats_lock = threading.Lock()

    @contextmanager
    def hold(self, operation: str) -> Iterator[None]:
        """Hold the lock for `operation`; its hold time is recorded when the outermost ends."""
        with self._lock:
            depth: int = getattr(self._local, "depth", 0)
            self._local.depth = depth + 1
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._local.depth = depth
                if depth == 0:
                    self._record(operation, time.perf_counter() - t0)

    def __enter__(self) -> None:
        self._lock.acquire()
        depth: int = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth == 0:
            self._local.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        depth: int = self._local.depth - 1
        self._local.depth = depth
        if depth == 0:
            self._record("background", time.perf_counter() - self._local.t0)
        self._lock.release()

    def _record(self, operation: str, seconds: float) -> None:
        with self._stats_lock:
            stats = self._stats.get(operation)
            if stats is None:
                stats = self._stats[operation] = HoldStats()
            stats.count += 1
            stats.total_s += seconds
            stats.max_s = max(stats.max_s, seconds)

    def stats(self) -> dict[str, HoldStats]:
        """A copy of the hold statistics, by operation."""
        with self._stats_lock:
            return {op: HoldStats(s.count, s.total_s, s.max_s) for op, s in self._stats.items()}

    def reset_stats(self) -> None:
        """Forget the statistics (a benchmark measures one phase at a time)."""
        with self._stats_lock:
            self._stats.clear()

"""The engine's lock, with the time each holder kept it, per operation.

Every handler and background task takes the engine lock for short sections; `hold(operation)`
records how long each outermost hold lasted, so a slow section shows up under its operation's
name (the benchmark and the status read `stats()`). Re-entrant holds count once, in the
outermost one.
"""

from __future__ import annotations

import threading
import time

import msgspec

__all__ = ["HoldStats", "TimedLock"]


class HoldStats(msgspec.Struct):
    """How long one operation held the engine lock: count, total and longest, in seconds."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0


class _Hold:
    """One hold of a TimedLock for an operation (a class, not a generator: it is cheaper)."""

    __slots__ = ("_lock", "_operation")

    def __init__(self, lock: TimedLock, operation: str) -> None:
        self._lock = lock
        self._operation = operation

    def __enter__(self) -> None:
        self._lock._enter()

    def __exit__(self, *exc: object) -> None:
        self._lock._exit(self._operation)


class TimedLock:
    """A re-entrant lock whose holds are timed per operation name."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # The holder's depth and the start of its outermost hold: read and written only by the
        # thread holding `_lock`, so plain attributes do (no thread-local lookups per hold).
        self._depth = 0
        self._t0 = 0.0
        self._stats: dict[str, HoldStats] = {}
        self._stats_lock = threading.Lock()

    def hold(self, operation: str) -> _Hold:
        """Hold the lock for `operation`; its hold time is recorded when the outermost ends."""
        return _Hold(self, operation)

    def __enter__(self) -> None:
        self._enter()

    def __exit__(self, *exc: object) -> None:
        self._exit("background")

    def _enter(self) -> None:
        self._lock.acquire()
        depth = self._depth
        self._depth = depth + 1
        if depth == 0:
            self._t0 = time.perf_counter()

    def _exit(self, operation: str) -> None:
        depth = self._depth - 1
        self._depth = depth
        if depth == 0:
            self._record(operation, time.perf_counter() - self._t0)
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

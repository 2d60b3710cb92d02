"""What every L2 tier counts, in one place: read outcomes, errors, latencies, health.

A tier owns one `TierCounters`; its read path ends in `settle()` (hit, miss, mismatch or
corrupt, judged by `format.verify`), its failures in `failed()`, and `snapshot()` turns the
counts into the typed `TierStats` the server reports. Repeated identical warnings are
rate-limited here too, so a failing backend cannot flood the log.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.base import LATENCY_BOUNDS_S, CodecStats, Latency, TierStats

#: a tier is reported unhealthy for this long after an error
UNHEALTHY_FOR_S = 5.0
#: the same warning is logged at most once per this many seconds (the rest are counted)
WARN_EVERY_S = 10.0

_COMMON = (
    "hits",
    "misses",
    "corrupt",
    "errors",
    "layout_mismatches",
    "size_mismatches",
    "puts",
    "bytes_written",
    "bytes_read",
)


class _LatencyRecorder:
    __slots__ = ("buckets", "count", "max_s", "total_s")

    def __init__(self) -> None:
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.buckets = [0] * (len(LATENCY_BOUNDS_S) + 1)

    def add(self, seconds: float, n: int) -> None:
        self.count += n
        self.total_s += seconds
        per_call = seconds / n
        self.max_s = max(self.max_s, per_call)
        self.buckets[bisect.bisect_left(LATENCY_BOUNDS_S, per_call)] += n

    def frozen(self) -> Latency:
        return Latency(
            count=self.count, total_s=self.total_s, max_s=self.max_s, buckets=tuple(self.buckets)
        )


class TierCounters:
    """Thread-safe counters of one tier; `extra` names the counters only this kind of tier has."""

    def __init__(self, logger: logging.Logger, extra: tuple[str, ...] = ()) -> None:
        self._log = logger
        self._lock = threading.Lock()
        self._n: dict[str, int] = dict.fromkeys(_COMMON + extra, 0)
        self._extra = extra
        self._read = _LatencyRecorder()
        self._write = _LatencyRecorder()
        self._last_error = ""
        self._error_at = float("-inf")
        self._warned: dict[str, float] = {}
        self._suppressed = 0

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._n[name]

    @contextmanager
    def timed(self, kind: str, n: int = 1) -> Iterator[None]:
        """Record the wall time of the block as `n` reads or writes (`kind` "read"/"write")."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            if n:
                with self._lock:
                    (self._read if kind == "read" else self._write).add(elapsed, n)

    def wrote(self, n: int, nbytes: int) -> None:
        with self._lock:
            self._n["puts"] += n
            self._n["bytes_written"] += nbytes

    def settle(self, verdict: fmt.Verdict | None, nbytes: int) -> fmt.Hit:
        """Count one read's outcome (None = not stored); a true Hit for a hit. The caller
        deletes a corrupt object (it knows where it lives)."""
        with self._lock:
            if verdict is fmt.Verdict.OK or verdict is fmt.Verdict.UNRESUMABLE:
                self._n["hits"] += 1
                self._n["bytes_read"] += nbytes
                return fmt.Hit.RESUMABLE if verdict is fmt.Verdict.OK else fmt.Hit.UNRESUMABLE
            self._n["misses"] += 1
            if verdict is fmt.Verdict.LAYOUT_MISMATCH:
                self._n["layout_mismatches"] += 1
            elif verdict is fmt.Verdict.SIZE_MISMATCH:
                self._n["size_mismatches"] += 1
            elif verdict is fmt.Verdict.CORRUPT:
                self._n["corrupt"] += 1
            return fmt.Hit.MISS

    def failed(self, what: str, exc: BaseException | str, *, count: bool = True) -> None:
        """Count an error (unless `count` is False), remember its text and warn, rate-limited
        per `what`."""
        text = f"{what}: {exc}"
        now = time.monotonic()
        with self._lock:
            if count:
                self._n["errors"] += 1
            self._last_error = text
            self._error_at = now
        self.warn(what, text)

    def warn(self, what: str, text: str) -> None:
        """Log `text` unless a warning about `what` was logged in the last `WARN_EVERY_S`."""
        now = time.monotonic()
        with self._lock:
            if now - self._warned.get(what, float("-inf")) < WARN_EVERY_S:
                self._suppressed += 1
                return
            self._warned[what] = now
            suppressed, self._suppressed = self._suppressed, 0
        more = f" ({suppressed} similar warnings suppressed)" if suppressed else ""
        self._log.warning("%s%s", text, more)

    def snapshot(
        self,
        *,
        name: str,
        kind: str,
        url: str,
        objects: int,
        used_bytes: int,
        capacity_bytes: int,
        healthy: bool = True,
        extra: dict[str, int] | None = None,
        codec: CodecStats | None = None,
    ) -> TierStats:
        """The typed stats; `healthy` is ANDed with "no error in the last UNHEALTHY_FOR_S"."""
        with self._lock:
            n = dict(self._n)
            ok = healthy and time.monotonic() - self._error_at >= UNHEALTHY_FOR_S
            out_extra = {k: n[k] for k in self._extra}
            out_extra.update(extra or {})
            return TierStats(
                name=name,
                kind=kind,
                url=url,
                healthy=ok,
                last_error=self._last_error,
                objects=objects,
                used_bytes=used_bytes,
                capacity_bytes=capacity_bytes,
                hits=n["hits"],
                misses=n["misses"],
                corrupt=n["corrupt"],
                errors=n["errors"],
                layout_mismatches=n["layout_mismatches"],
                size_mismatches=n["size_mismatches"],
                puts=n["puts"],
                bytes_written=n["bytes_written"],
                bytes_read=n["bytes_read"],
                read_latency=self._read.frozen(),
                write_latency=self._write.frozen(),
                extra=out_extra,
                codec=codec or CodecStats(),
            )

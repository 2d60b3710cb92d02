"""Background periodic threads (session cleanup, lease reaping, L2 write-through...) and the
process-wide registry the admin API reads to list them and report health.

A `PeriodicThread` runs `execute_fn` every `interval` seconds on a daemon thread named
`kvtier-<name>`. The first cycle runs one interval after `start()`, unless `wake()` asks for one
sooner. A thread starts at most once: `start()` on a started or stopped thread raises
RuntimeError. `ThreadLevel` values are the lower-case strings "critical", "high", "medium", "low".
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

# A thread is active while a cycle completed within this many intervals.
ACTIVE_INTERVALS = 3


class ThreadLevel(enum.Enum):
    """How much the server depends on a thread; CRITICAL and HIGH ones decide health."""

    CRITICAL = "critical"
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"


# Levels whose stalled threads make the process unhealthy.
HEALTH_LEVELS = frozenset({ThreadLevel.CRITICAL, ThreadLevel.HIGH})


@dataclass(frozen=True)
class ThreadRunSummary:
    """The outcome of one cycle; `timestamp` is wall-clock seconds, `duration_ms` real time."""

    success: bool
    message: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    timestamp: float = field(default_factory=time.time)
    duration_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy, for the admin API."""
        return {
            "success": self.success,
            "message": self.message,
            "extra_info": dict(self.extra_info),
            "timestamp": self.timestamp,
            "duration_ms": self.duration_ms,
        }


# A cycle's body: a ThreadRunSummary is recorded as is; any other return counts as success.
ExecuteFn = Callable[[], ThreadRunSummary | object]


class PeriodicThread:
    """Runs `execute_fn` every `interval` seconds on a daemon thread until stopped.

    `clock` (monotonic seconds) stamps completed cycles for `is_active` and health; tests inject
    a fake one. Sleeping always uses real time, so `stop()` and `wake()` interrupt it at once.
    """

    def __init__(
        self,
        name: str,
        interval: float,
        execute_fn: ExecuteFn,
        level: ThreadLevel = ThreadLevel.MEDIUM,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"periodic thread name must be a non-empty string, got {name!r}")
        if not isinstance(interval, int | float) or not (interval > 0 and math.isfinite(interval)):
            raise ValueError(
                f"periodic thread {name!r}: interval must be a finite number of seconds > 0, "
                f"got {interval!r}"
            )
        if not isinstance(level, ThreadLevel):
            raise ValueError(
                f"periodic thread {name!r}: level must be a ThreadLevel, got {level!r}"
            )
        self.name = name
        self.interval = float(interval)
        self.level = level
        self._execute_fn = execute_fn
        self._clock = clock
        # Guards every field below; never held while execute_fn runs.
        self._lock = threading.Lock()
        self._cycle_done = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._started_at: float | None = None
        self._run_count = 0
        self._failure_count = 0
        self._last_summary: ThreadRunSummary | None = None
        self._last_run_time: float | None = None
        # Set by stop() too, so one wait wakes for either reason.
        self._wake_event = threading.Event()

    def __repr__(self) -> str:
        return (
            f"PeriodicThread(name={self.name!r}, interval={self.interval}, "
            f"level={self.level.value}, running={self.is_running()})"
        )

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the daemon thread; its first cycle runs one interval from now (or on wake)."""
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"periodic thread {self.name!r} was stopped; it cannot restart")
            if self._thread is not None:
                raise RuntimeError(f"periodic thread {self.name!r} is already started")
            self._started_at = self._clock()
            self._thread = threading.Thread(target=self._loop, name=f"kvtier-{self.name}")
            self._thread.daemon = True
            self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Ask the thread to exit and wait up to `timeout` s for a running cycle to finish.

        Idempotent. A sleeping thread exits at once; a stop before start makes start() refuse.
        """
        thread = self._signal_stop()
        if thread is None or thread is threading.current_thread():
            return  # never started, or called from execute_fn itself (joining would deadlock)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning(
                "periodic thread %s did not finish its cycle within %ss of stop()",
                self.name,
                timeout,
            )

    def _signal_stop(self) -> threading.Thread | None:
        """Mark stopped and interrupt the sleep without waiting; returns the thread to join."""
        with self._lock:
            self._stopped = True
            self._cycle_done.notify_all()
            thread = self._thread
        self._wake_event.set()
        return thread

    def wake(self) -> None:
        """Run a cycle now; during a cycle, run one more right after it. No-op unless running."""
        with self._lock:
            if self._thread is None or self._stopped:
                return
        self._wake_event.set()

    # -- state -----------------------------------------------------------------------------

    def is_running(self) -> bool:
        """Started, not stopped, and the OS thread still alive."""
        with self._lock:
            thread, stopped = self._thread, self._stopped
        return thread is not None and not stopped and thread.is_alive()

    def is_active(self) -> bool:
        """Running, with a completed cycle (or the start, if none yet) within 3 intervals."""
        return self.is_running() and self._staleness()[0] <= ACTIVE_INTERVALS * self.interval

    def _staleness(self) -> tuple[float, bool]:
        """Seconds on `clock` since the last completed cycle (or since start if none yet), and
        whether a cycle has ever completed."""
        with self._lock:
            last_run, started = self._last_run_time, self._started_at
        reference = last_run if last_run is not None else started
        if reference is None:
            return math.inf, False
        return self._clock() - reference, last_run is not None

    @property
    def run_count(self) -> int:
        """Cycles completed, failed ones included."""
        with self._lock:
            return self._run_count

    @property
    def failure_count(self) -> int:
        """Cycles that raised or returned a summary with success=False."""
        with self._lock:
            return self._failure_count

    @property
    def last_summary(self) -> ThreadRunSummary | None:
        """The summary of the last completed cycle, or None before the first."""
        with self._lock:
            return self._last_summary

    @property
    def last_run_time(self) -> float | None:
        """When (on `clock`) the last cycle completed, or None before the first."""
        with self._lock:
            return self._last_run_time

    def wait_for_runs(self, count: int, timeout: float | None = None) -> bool:
        """Block until `count` cycles have completed; False on timeout or if the thread stops.

        Lets tests (and callers of wake()) wait for a cycle without polling.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cycle_done:
            while self._run_count < count:
                if self._stopped:
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cycle_done.wait(remaining)
            return True

    def to_dict(self) -> dict[str, Any]:
        """A consistent JSON-ready snapshot for the admin API."""
        running, active = self.is_running(), self.is_active()
        with self._lock:
            summary = self._last_summary
            return {
                "name": self.name,
                "level": self.level.value,
                "interval": self.interval,
                "running": running,
                "active": active,
                "run_count": self._run_count,
                "failure_count": self._failure_count,
                "last_summary": None if summary is None else summary.to_dict(),
            }

    # -- the thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            self._wake_event.wait(self.interval)
            # Cleared before the cycle, so a wake() that arrives during it sets the event again
            # and the next wait returns at once: exactly one extra cycle, however many wakes.
            self._wake_event.clear()
            with self._lock:
                if self._stopped:
                    return
            self._run_cycle()

    def _run_cycle(self) -> None:
        began = time.perf_counter()
        try:
            result = self._execute_fn()
        except Exception as exc:
            logger.exception("periodic thread %s: cycle failed", self.name)
            summary = ThreadRunSummary(success=False, message=repr(exc))
        else:
            if isinstance(result, ThreadRunSummary):
                summary = result
            else:
                summary = ThreadRunSummary(success=True)
            if not summary.success:
                logger.warning("periodic thread %s: cycle reported failure: %s", self.name, summary)
        if summary.duration_ms == 0.0:
            elapsed_ms = (time.perf_counter() - began) * 1000.0
            summary = dataclasses.replace(summary, duration_ms=elapsed_ms)
        finished = self._clock()
        with self._lock:
            self._run_count += 1
            if not summary.success:
                self._failure_count += 1
            self._last_summary = summary
            self._last_run_time = finished
            self._cycle_done.notify_all()


class PeriodicThreadRegistry:
    """Named periodic threads of this process; `get_instance()` is the shared one."""

    _instance: ClassVar[PeriodicThreadRegistry | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[str, PeriodicThread] = {}

    @classmethod
    def get_instance(cls) -> PeriodicThreadRegistry:
        """The process-wide registry, created on first use."""
        instance = cls._instance
        if instance is None:
            with cls._instance_lock:
                instance = cls._instance
                if instance is None:
                    instance = cls._instance = cls()
        return instance

    def register(self, thread: PeriodicThread) -> None:
        """Add `thread` under its name; a name already registered raises ValueError."""
        with self._lock:
            if thread.name in self._threads:
                raise ValueError(f"a periodic thread named {thread.name!r} is already registered")
            self._threads[thread.name] = thread

    def unregister(self, name: str) -> PeriodicThread | None:
        """Remove and return the thread named `name` (None if absent); it is not stopped."""
        with self._lock:
            return self._threads.pop(name, None)

    def get(self, name: str) -> PeriodicThread | None:
        """The thread registered as `name`, or None."""
        with self._lock:
            return self._threads.get(name)

    def get_all(self) -> list[PeriodicThread]:
        """Every registered thread, in registration order."""
        with self._lock:
            return list(self._threads.values())

    def get_by_level(self, level: ThreadLevel) -> list[PeriodicThread]:
        """The registered threads of `level`, in registration order."""
        return [t for t in self.get_all() if t.level is level]

    def health(self) -> dict[str, Any]:
        """Running CRITICAL/HIGH threads with no completed cycle (or start) in 3 intervals."""
        unhealthy: list[dict[str, Any]] = []
        for thread in self.get_all():
            if thread.level not in HEALTH_LEVELS or not thread.is_running():
                continue
            staleness, ever_ran = thread._staleness()
            limit = ACTIVE_INTERVALS * thread.interval
            if staleness <= limit:
                continue
            since = "since its last cycle" if ever_ran else "since start, never completed a cycle"
            unhealthy.append(
                {
                    "name": thread.name,
                    "level": thread.level.value,
                    "reason": (
                        f"{staleness:.1f}s {since}; limit is {ACTIVE_INTERVALS} x interval "
                        f"{thread.interval:g}s = {limit:g}s"
                    ),
                    "seconds_since_last_run": staleness,
                }
            )
        return {"healthy": not unhealthy, "unhealthy": unhealthy}

    def is_healthy(self) -> bool:
        """True when no running CRITICAL/HIGH thread has stalled."""
        return bool(self.health()["healthy"])

    def stop_all(self, timeout: float = 5.0) -> None:
        """Stop every registered thread, waiting at most `timeout` s in total."""
        threads = self.get_all()
        for thread in threads:
            thread._signal_stop()  # all sleep-interrupts first, so the joins overlap
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.stop(max(0.0, deadline - time.monotonic()))

    def reset(self) -> None:
        """Stop every thread and empty the registry (for tests)."""
        self.stop_all()
        with self._lock:
            self._threads.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._threads)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._threads


def create_periodic_thread(
    name: str,
    interval: float,
    execute_fn: ExecuteFn,
    level: ThreadLevel = ThreadLevel.MEDIUM,
    *,
    registry: PeriodicThreadRegistry | None = None,
    start: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> PeriodicThread:
    """Create a thread and register it (in the shared registry by default); start it if asked."""
    thread = PeriodicThread(name, interval, execute_fn, level, clock=clock)
    (registry if registry is not None else PeriodicThreadRegistry.get_instance()).register(thread)
    if start:
        thread.start()
    return thread

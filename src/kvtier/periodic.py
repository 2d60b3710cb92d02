"""Background periodic threads (session cleanup, lease reaping, L2 write-through...) and the
process-wide registry the admin API reads to list them and report health.

The public names and semantics follow LMCache's `periodic_thread` module, so people and code that
know that server feel at home: a `PeriodicThread` runs `_execute()` (overridden by a subclass, or
calling the `execute_fn` it was given) on a daemon thread named `kvtier-<name>`: first after
`init_wait` seconds (0: at once), then every `interval` seconds; `wake()` asks for a cycle sooner.
`start()` returns the worker thread. A running or stopped thread cannot start again
(RuntimeError); one whose loop ended by itself, because a cycle raised `IrrecoverableException`,
can (the lineage's contract).
`ThreadLevel` values are the lower-case strings "critical", "high", "medium", "low".
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
from typing import Any, ClassVar, NoReturn, final

logger = logging.getLogger(__name__)


class IrrecoverableException(Exception):
    """Raised by a cycle to end its thread's loop (counted as a failed cycle); the thread can
    be started again."""


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


@final
class StateFlag:
    """An immutable boolean that reads the same as a property and as a method call.

    LMCache exposes `is_running` / `is_active` as properties (`if t.is_running:`) while kvtier's
    callers call them (`t.is_running()`); returning this object lets both spellings work. It is
    truthy like the bool it carries, equal to and hashing like that bool, and calling it returns it.
    """

    __slots__ = ("_value",)
    _value: bool

    def __init__(self, value: bool) -> None:
        object.__setattr__(self, "_value", bool(value))

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"StateFlag is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"StateFlag is immutable; cannot delete {name!r}")

    def __bool__(self) -> bool:
        return self._value

    def __call__(self) -> bool:
        return self._value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StateFlag):
            return self._value == other._value
        if isinstance(other, int):  # bool is an int; True == 1 holds for bools too
            return self._value == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return repr(self._value)


_TRUE = StateFlag(True)
_FALSE = StateFlag(False)


def _flag(value: bool) -> StateFlag:
    return _TRUE if value else _FALSE


def _check_seconds(thread: str, knob: str, value: object, *, allow_zero: bool) -> float:
    """`value` as float seconds, or ValueError naming the thread and the knob."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
        if math.isfinite(seconds) and (seconds > 0 or (allow_zero and seconds == 0)):
            return seconds
    bound = ">= 0" if allow_zero else "> 0"
    raise ValueError(
        f"periodic thread {thread!r}: {knob} must be a finite number of seconds {bound}, "
        f"got {value!r}"
    )


class PeriodicThread:
    """Runs `_execute()` on a daemon thread: after `init_wait` s, then every `interval` s.

    Subclass and override `_execute()` (LMCache style), or pass `execute_fn`. `clock` (monotonic
    seconds) stamps starts and completed cycles for `is_active` and health; tests inject a fake
    one. Sleeping always uses real time, so `stop()` and `wake()` interrupt it at once.
    """

    def __init__(
        self,
        name: str,
        interval: float,
        level: ThreadLevel = ThreadLevel.MEDIUM,
        init_wait: float = 0.0,
        *,
        execute_fn: ExecuteFn | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"periodic thread name must be a non-empty string, got {name!r}")
        interval = _check_seconds(name, "interval", interval, allow_zero=False)
        if not isinstance(level, ThreadLevel):
            hint = " (pass the body as execute_fn=... by keyword)" if callable(level) else ""
            raise ValueError(
                f"periodic thread {name!r}: level must be a ThreadLevel, got {level!r}{hint}"
            )
        init_wait = _check_seconds(name, "init_wait", init_wait, allow_zero=True)
        if execute_fn is not None and not callable(execute_fn):
            raise TypeError(
                f"periodic thread {name!r}: execute_fn must be callable, got {execute_fn!r}"
            )
        if execute_fn is None and type(self)._execute is PeriodicThread._execute:
            raise TypeError(
                f"periodic thread {name!r} has nothing to run: pass execute_fn=... or subclass "
                "PeriodicThread and override _execute()"
            )
        self._name = name
        self._interval = interval
        self._level = level
        self._init_wait = init_wait
        self._execute_fn = execute_fn
        self._clock = clock
        # Guards every field below; never held while a cycle runs.
        self._lock = threading.Lock()
        self._cycle_done = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._ended = False  # the loop ended by itself (IrrecoverableException): may restart
        self._started_at: float | None = None
        self._run_count = 0
        self._failure_count = 0
        self._last_summary: ThreadRunSummary | None = None
        self._last_run_time: float | None = None
        # Set by stop() too, so one wait wakes for either reason.
        self._wake_event = threading.Event()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._name!r}, interval={self._interval}, "
            f"level={self._level.value}, running={self.is_running()})"
        )

    # -- configuration ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The registry key; the OS thread is named `kvtier-<name>`."""
        return self._name

    @property
    def interval(self) -> float:
        """Seconds between the end of one cycle and the start of the next."""
        return self._interval

    @property
    def level(self) -> ThreadLevel:
        """How much the server depends on this thread."""
        return self._level

    @property
    def init_wait(self) -> float:
        """Seconds from start() to the first cycle."""
        return self._init_wait

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> threading.Thread:
        """Start the daemon thread and return it; its first cycle runs after `init_wait` s.

        A thread whose loop ended on an `IrrecoverableException` starts again with a new worker.
        """
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"periodic thread {self._name!r} was stopped; it cannot restart")
            if self._thread is not None and not self._ended:
                raise RuntimeError(f"periodic thread {self._name!r} is already started")
            self._ended = False
            self._started_at = self._clock()
            thread = threading.Thread(target=self._loop, name=f"kvtier-{self._name}")
            thread.daemon = True
            self._thread = thread
            thread.start()
            return thread

    def stop(self, timeout: float | None = 5.0) -> None:
        """Ask the thread to exit and wait up to `timeout` s for a running cycle to finish.

        Idempotent. A sleeping thread exits at once; a stop before start makes start() refuse.
        """
        thread = self._signal_stop()
        if thread is None or thread is threading.current_thread():
            return  # never started, or called from the cycle itself (joining would deadlock)
        thread.join(timeout)
        if thread.is_alive():
            logger.warning(
                "periodic thread %s did not finish its cycle within %ss of stop()",
                self._name,
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

    @property
    def is_running(self) -> StateFlag:
        """Started, not stopped, and the OS thread alive; read as a property or call it."""
        with self._lock:
            return _flag(self._running_locked())

    @property
    def is_active(self) -> StateFlag:
        """Running, and the last cycle completed within 3 intervals; before the first cycle,
        started within `init_wait` + 3 intervals. Usable as a property or a call."""
        with self._lock:
            return _flag(self._running_locked() and self._stale_locked()[0] <= 0.0)

    def _running_locked(self) -> bool:
        thread = self._thread
        return thread is not None and not self._stopped and thread.is_alive()

    def _stale_locked(self) -> tuple[float, float, bool]:
        """(seconds past the activity limit, seconds since the last cycle or start, ever ran);
        the first is > 0 when the thread missed its interval. Caller holds the lock."""
        if self._last_run_time is not None:
            since = self._clock() - self._last_run_time
            return since - ACTIVE_INTERVALS * self._interval, since, True
        if self._started_at is None:
            return math.inf, math.inf, False
        since = self._clock() - self._started_at
        return since - self._init_wait - ACTIVE_INTERVALS * self._interval, since, False

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
    def total_runs(self) -> int:
        """LMCache's name for `run_count`."""
        return self.run_count

    @property
    def failed_runs(self) -> int:
        """LMCache's name for `failure_count`."""
        return self.failure_count

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

    def get_status(self) -> dict[str, Any]:
        """A consistent JSON-ready snapshot with LMCache's keys; times are on `clock`.

        `success_rate` is the fraction of cycles that succeeded, 1.0 before the first cycle.
        """
        with self._lock:
            running = self._running_locked()
            excess, _, _ = self._stale_locked()
            last_run, total, failed = self._last_run_time, self._run_count, self._failure_count
            summary = self._last_summary
            now = self._clock()
        return {
            "name": self._name,
            "level": self._level.value,
            "interval": self._interval,
            "init_wait": self._init_wait,
            "is_running": running,
            "is_active": running and excess <= 0.0,
            "last_run_time": last_run,
            "last_run_ago": None if last_run is None else now - last_run,
            "total_runs": total,
            "failed_runs": failed,
            "success_rate": 1.0 if total == 0 else (total - failed) / total,
            "last_summary": None if summary is None else summary.to_dict(),
        }

    def to_dict(self) -> dict[str, Any]:
        """`get_status()` plus the names the admin API and status page read."""
        status = self.get_status()
        status["running"] = status["is_running"]
        status["active"] = status["is_active"]
        status["run_count"] = status["total_runs"]
        status["failure_count"] = status["failed_runs"]
        return status

    # -- the thread ------------------------------------------------------------------------

    def _execute(self) -> ThreadRunSummary:
        """One cycle's work; subclasses override it, the default calls `execute_fn`."""
        if self._execute_fn is None:
            raise NotImplementedError(
                f"periodic thread {self._name!r}: override _execute() or pass execute_fn"
            )
        result = self._execute_fn()
        return result if isinstance(result, ThreadRunSummary) else ThreadRunSummary(success=True)

    def _loop(self) -> None:
        if self._init_wait > 0:
            self._wake_event.wait(self._init_wait)
        while True:
            # Cleared before the cycle, so a wake() that arrives during it sets the event again
            # and the next wait returns at once: exactly one extra cycle, however many wakes.
            self._wake_event.clear()
            with self._lock:
                if self._stopped:
                    return
            if not self._run_cycle():
                with self._lock:
                    self._ended = True
                return
            self._wake_event.wait(self._interval)

    def _run_cycle(self) -> bool:
        """One cycle; False when it raised IrrecoverableException (the loop ends)."""
        began = time.perf_counter()
        go_on = True
        try:
            result: object = self._execute()
        except IrrecoverableException as exc:
            logger.error("periodic thread %s: irrecoverable, stopping: %s", self._name, exc)
            summary = ThreadRunSummary(success=False, message=repr(exc))
            go_on = False
        except Exception as exc:
            logger.exception("periodic thread %s: cycle failed", self._name)
            summary = ThreadRunSummary(success=False, message=repr(exc))
        else:
            # A subclass may return None despite the annotation: that counts as success too.
            if isinstance(result, ThreadRunSummary):
                summary = result
            else:
                summary = ThreadRunSummary(success=True)
            if not summary.success:
                logger.warning(
                    "periodic thread %s: cycle reported failure: %s", self._name, summary
                )
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
        return go_on


class _ResetDescriptor:
    """`PeriodicThreadRegistry.reset` that works on the class and on an instance.

    LMCache calls `PeriodicThreadRegistry.reset()` on the class to drop the shared singleton;
    kvtier's tests call `registry.reset()` on an instance to empty that registry. Both spellings
    exist in the wild, so the attribute dispatches on how it is looked up.
    """

    def __get__(
        self, obj: PeriodicThreadRegistry | None, owner: type[PeriodicThreadRegistry]
    ) -> Callable[[], None]:
        if obj is None:
            return owner._reset_shared
        return obj._reset_threads


class PeriodicThreadRegistry:
    """Named periodic threads of this process; `get_instance()` is the shared one.

    `reset()` on the class stops the shared registry's threads, empties it and drops it (the
    next `get_instance()` makes a new one); on an instance it stops and empties that registry.
    """

    _instance: ClassVar[PeriodicThreadRegistry | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()
    reset: ClassVar[_ResetDescriptor] = _ResetDescriptor()

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

    @classmethod
    def _reset_shared(cls) -> None:
        """Stop and empty the shared registry and drop it (for tests)."""
        with cls._instance_lock:
            instance, cls._instance = cls._instance, None
        if instance is not None:
            instance._reset_threads()

    def _reset_threads(self) -> None:
        """Stop every thread and empty this registry (for tests)."""
        self.stop_all()
        self.unregister_all()

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

    def unregister_all(self) -> list[PeriodicThread]:
        """Remove and return every thread, in registration order; none is stopped."""
        with self._lock:
            threads = list(self._threads.values())
            self._threads.clear()
        return threads

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

    def get_running_count(self) -> int:
        """How many registered threads are running."""
        return sum(1 for t in self.get_all() if t.is_running)

    def get_active_count(self) -> int:
        """How many registered threads are active (running and not stalled)."""
        return sum(1 for t in self.get_all() if t.is_active)

    def get_count_by_level(self, level: ThreadLevel) -> dict[str, int]:
        """{"total", "running", "active"} counts of the threads of one level."""
        threads = self.get_by_level(level)
        return {
            "total": len(threads),
            "running": sum(1 for t in threads if t.is_running),
            "active": sum(1 for t in threads if t.is_active),
        }

    def get_summary(self) -> dict[str, Any]:
        """Counts overall and by level, and every thread's status (the lineage's summary)."""
        threads = self.get_all()
        return {
            "total_count": len(threads),
            "running_count": sum(1 for t in threads if t.is_running),
            "active_count": sum(1 for t in threads if t.is_active),
            "by_level": {level.value: self.get_count_by_level(level) for level in ThreadLevel},
            "threads": [t.get_status() for t in threads],
        }

    def health(self) -> dict[str, Any]:
        """Running CRITICAL/HIGH threads that missed their interval, as `is_active` judges it."""
        unhealthy: list[dict[str, Any]] = []
        for thread in self.get_all():
            if thread.level not in HEALTH_LEVELS:
                continue
            with thread._lock:
                if not thread._running_locked():
                    continue
                excess, since, ever_ran = thread._stale_locked()
            if excess <= 0.0:
                continue
            limit = since - excess
            what = "since its last cycle" if ever_ran else "since start, never completed a cycle"
            rule = f"{ACTIVE_INTERVALS} x interval {thread.interval:g}s"
            if not ever_ran and thread.init_wait:
                rule = f"init_wait {thread.init_wait:g}s + {rule}"
            unhealthy.append(
                {
                    "name": thread.name,
                    "level": thread.level.value,
                    "reason": f"{since:.1f}s {what}; limit is {rule} = {limit:g}s",
                    "seconds_since_last_run": since,
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
    init_wait: float = 0.0,
    auto_register: bool = True,
    *,
    registry: PeriodicThreadRegistry | None = None,
    start: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> PeriodicThread:
    """Create a thread running `execute_fn` and, unless `auto_register` is False, register it
    (in the shared registry by default); start it if asked. The positional order is the
    lineage's: (name, interval, execute_fn, level, init_wait, auto_register)."""
    thread = PeriodicThread(name, interval, level, init_wait, execute_fn=execute_fn, clock=clock)
    if auto_register:
        target = registry if registry is not None else PeriodicThreadRegistry.get_instance()
        target.register(thread)
    if start:
        thread.start()
    return thread

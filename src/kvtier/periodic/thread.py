"""`PeriodicThread`: one daemon thread running a cycle every `interval` seconds, its state and
its counters (see `kvtier.periodic`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.periodic.flag import StateFlag, as_flag
from kvtier.periodic.levels import ACTIVE_INTERVALS, ThreadLevel
from kvtier.periodic.summary import ExecuteFn, IrrecoverableException, ThreadRunSummary

logger = logging.getLogger(__name__)


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
            return as_flag(self._running_locked())

    @property
    def is_active(self) -> StateFlag:
        """Running, and the last cycle completed within 3 intervals; before the first cycle,
        started within `init_wait` + 3 intervals. Usable as a property or a call."""
        with self._lock:
            return as_flag(self._running_locked() and self._stale_locked()[0] <= 0.0)

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

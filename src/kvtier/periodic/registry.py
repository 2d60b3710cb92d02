"""`PeriodicThreadRegistry`: the process's named periodic threads, their counts and health, and
`create_periodic_thread`, which makes one and registers it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

from kvtier.periodic.levels import ACTIVE_INTERVALS, HEALTH_LEVELS, ThreadLevel
from kvtier.periodic.summary import ExecuteFn
from kvtier.periodic.thread import PeriodicThread


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

"""Tests for kvtier.periodic: cycle semantics, stop/wake, activity on a fake clock, registry."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator

import pytest

from kvtier.periodic import (
    PeriodicThread,
    PeriodicThreadRegistry,
    ThreadLevel,
    ThreadRunSummary,
    create_periodic_thread,
)

# Long enough that no cycle ever runs by itself during a test: only wake() triggers cycles.
NEVER = 60.0
# Generous bound on waits that should succeed; they normally return in milliseconds.
WAIT = 5.0


class FakeClock:
    """A monotonic clock that moves only when the test advances it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def registry() -> Iterator[PeriodicThreadRegistry]:
    """The shared registry, emptied (threads stopped) before and after each test."""
    shared = PeriodicThreadRegistry.get_instance()
    shared.reset()
    yield shared
    shared.reset()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def os_thread(name: str) -> threading.Thread | None:
    """The live OS thread a PeriodicThread called `name` runs on, if any."""
    return next((t for t in threading.enumerate() if t.name == f"kvtier-{name}"), None)


def make(
    registry: PeriodicThreadRegistry,
    name: str,
    fn: object = None,
    level: ThreadLevel = ThreadLevel.MEDIUM,
    clock: FakeClock | None = None,
    interval: float = NEVER,
) -> PeriodicThread:
    """A registered, started thread (so the fixture stops it) running `fn` (or a no-op)."""
    execute = fn if callable(fn) else (lambda: None)
    if clock is None:
        thread = create_periodic_thread(name, interval, execute, level, start=True)
    else:
        thread = create_periodic_thread(name, interval, execute, level, start=True, clock=clock)
    assert registry.get(name) is thread
    return thread


# -- construction ----------------------------------------------------------------------------


@pytest.mark.parametrize("interval", [0, -1.0, math.nan, math.inf])
def test_bad_interval_raises_value_error_naming_it(interval: float) -> None:
    with pytest.raises(ValueError, match="interval"):
        PeriodicThread("bad", interval, lambda: None)


def test_empty_name_raises_value_error() -> None:
    with pytest.raises(ValueError, match="name"):
        PeriodicThread("", 1.0, lambda: None)


def test_levels_are_lower_case_strings() -> None:
    assert [level.value for level in ThreadLevel] == ["critical", "high", "medium", "low"]


# -- lifecycle -------------------------------------------------------------------------------


def test_runs_on_a_daemon_thread_named_after_it(registry: PeriodicThreadRegistry) -> None:
    thread = make(registry, "named")
    os = os_thread("named")
    assert os is not None and os.daemon
    assert thread.is_running()


def test_stop_interrupts_a_long_sleep(registry: PeriodicThreadRegistry) -> None:
    # The interval is 60 s; a thread that slept with time.sleep would still be alive after a
    # 1 s join, so "not alive" shows stop() returned within 1 s because the sleep was cut short.
    thread = make(registry, "sleeper")
    os = os_thread("sleeper")
    assert os is not None
    thread.stop(timeout=1.0)
    assert not os.is_alive()
    assert not thread.is_running()
    assert thread.run_count == 0
    thread.stop(timeout=1.0)  # idempotent


def test_start_twice_and_restart_raise_runtime_error(registry: PeriodicThreadRegistry) -> None:
    thread = make(registry, "once")
    with pytest.raises(RuntimeError, match="already started"):
        thread.start()
    thread.stop()
    with pytest.raises(RuntimeError, match="cannot restart"):
        thread.start()


def test_stop_before_start_prevents_start() -> None:
    thread = PeriodicThread("never-started", NEVER, lambda: None)
    thread.stop()
    assert not thread.is_running()
    with pytest.raises(RuntimeError):
        thread.start()


def test_stop_from_inside_the_cycle_does_not_deadlock(registry: PeriodicThreadRegistry) -> None:
    holder: list[PeriodicThread] = []
    thread = make(registry, "self-stopper", lambda: holder[0].stop())
    holder.append(thread)
    os = os_thread("self-stopper")
    assert os is not None
    thread.wake()
    os.join(WAIT)
    assert not os.is_alive()
    assert thread.run_count == 1
    assert not thread.is_running()


# -- wake ------------------------------------------------------------------------------------


def test_wake_runs_a_cycle_now(registry: PeriodicThreadRegistry) -> None:
    thread = make(registry, "waker")
    thread.wake()
    assert thread.wait_for_runs(1, timeout=WAIT)
    assert thread.run_count == 1
    assert thread.failure_count == 0


def test_wake_before_start_is_a_noop(registry: PeriodicThreadRegistry) -> None:
    thread = PeriodicThread("early", NEVER, lambda: None)
    registry.register(thread)
    thread.wake()
    thread.start()
    # Had the early wake been kept, the first cycle would run at once instead of in 60 s.
    assert not thread.wait_for_runs(1, timeout=0.3)
    assert thread.run_count == 0


def test_wake_during_a_cycle_runs_exactly_one_more(registry: PeriodicThreadRegistry) -> None:
    entered = threading.Event()
    release = threading.Event()
    calls: list[int] = []

    def body() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            entered.set()
            assert release.wait(WAIT)

    thread = make(registry, "busy", body)
    thread.wake()
    assert entered.wait(WAIT)
    thread.wake()  # both arrive during the first cycle and collapse into one follow-up
    thread.wake()
    release.set()
    assert thread.wait_for_runs(2, timeout=WAIT)
    # A third cycle would follow at once if the wakes were queued; the interval is 60 s.
    assert not thread.wait_for_runs(3, timeout=0.3)
    assert calls == [0, 1]


# -- cycle outcomes --------------------------------------------------------------------------


def test_exception_counts_as_failure_and_thread_keeps_going(
    registry: PeriodicThreadRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    def body() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk on fire")

    thread = make(registry, "flaky", body)
    with caplog.at_level(logging.ERROR, logger="kvtier.periodic"):
        thread.wake()
        assert thread.wait_for_runs(1, timeout=WAIT)
    assert thread.failure_count == 1
    summary = thread.last_summary
    assert summary is not None and not summary.success
    assert summary.message == repr(OSError("disk on fire"))
    logged = [r for r in caplog.records if "flaky" in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # logged with its traceback

    thread.wake()
    assert thread.wait_for_runs(2, timeout=WAIT)
    assert thread.is_running()
    assert (thread.run_count, thread.failure_count) == (2, 1)
    summary = thread.last_summary
    assert summary is not None and summary.success


def test_returned_summaries_are_recorded(registry: PeriodicThreadRegistry) -> None:
    results: list[object] = [
        ThreadRunSummary(success=True, message="swept", extra_info={"removed": 3}),
        ThreadRunSummary(success=False, message="redis down", duration_ms=12.5),
        "anything else",
    ]
    thread = make(registry, "reporter", lambda: results.pop(0))

    thread.wake()
    assert thread.wait_for_runs(1, timeout=WAIT)
    first = thread.last_summary
    assert first is not None
    assert (first.success, first.message, first.extra_info) == (True, "swept", {"removed": 3})
    assert first.duration_ms > 0.0  # filled in because the body left it 0
    assert thread.failure_count == 0

    thread.wake()
    assert thread.wait_for_runs(2, timeout=WAIT)
    second = thread.last_summary
    assert second is not None and second.message == "redis down"
    assert second.duration_ms == 12.5  # kept: the body measured it
    assert thread.failure_count == 1  # success=False counts as a failure

    thread.wake()
    assert thread.wait_for_runs(3, timeout=WAIT)
    third = thread.last_summary
    assert third is not None and third.success and third.message == ""
    assert (thread.run_count, thread.failure_count) == (3, 1)


def test_summary_and_thread_to_dict(registry: PeriodicThreadRegistry) -> None:
    summary = ThreadRunSummary(True, "ok", {"n": 1}, timestamp=5.0, duration_ms=2.0)
    assert summary.to_dict() == {
        "success": True,
        "message": "ok",
        "extra_info": {"n": 1},
        "timestamp": 5.0,
        "duration_ms": 2.0,
    }
    thread = make(registry, "dicty", lambda: summary, level=ThreadLevel.HIGH)
    assert thread.to_dict() == {
        "name": "dicty",
        "level": "high",
        "interval": NEVER,
        "running": True,
        "active": True,
        "run_count": 0,
        "failure_count": 0,
        "last_summary": None,
    }
    thread.wake()
    assert thread.wait_for_runs(1, timeout=WAIT)
    as_dict = thread.to_dict()
    assert as_dict["run_count"] == 1
    assert as_dict["last_summary"] == summary.to_dict()


# -- activity on a fake clock ----------------------------------------------------------------


def test_is_active_follows_the_fake_clock(
    registry: PeriodicThreadRegistry, clock: FakeClock
) -> None:
    thread = make(registry, "ticker", clock=clock, interval=10.0)
    assert thread.is_active()  # counted from start before the first cycle
    clock.advance(30.5)
    assert not thread.is_active()  # 3 intervals since start and no cycle

    thread.wake()
    assert thread.wait_for_runs(1, timeout=WAIT)
    assert thread.last_run_time == clock.now
    assert thread.is_active()
    clock.advance(30.0)
    assert thread.is_active()  # exactly 3 intervals is still within
    clock.advance(0.5)
    assert not thread.is_active()

    thread.wake()
    assert thread.wait_for_runs(2, timeout=WAIT)
    assert thread.is_active()
    thread.stop()
    assert not thread.is_active()  # a stopped thread is never active


# -- registry --------------------------------------------------------------------------------


def test_get_instance_is_one_object_across_threads() -> None:
    seen: list[PeriodicThreadRegistry] = []
    workers = [
        threading.Thread(target=lambda: seen.append(PeriodicThreadRegistry.get_instance()))
        for _ in range(8)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(seen) == 8
    assert all(r is PeriodicThreadRegistry.get_instance() for r in seen)


def test_duplicate_name_raises_value_error_naming_it(registry: PeriodicThreadRegistry) -> None:
    registry.register(PeriodicThread("twin", NEVER, lambda: None))
    with pytest.raises(ValueError, match="'twin'"):
        registry.register(PeriodicThread("twin", NEVER, lambda: None))
    with pytest.raises(ValueError, match="'twin'"):
        create_periodic_thread("twin", NEVER, lambda: None)
    assert len(registry) == 1


def test_get_unregister_contains_len(registry: PeriodicThreadRegistry) -> None:
    a = PeriodicThread("a", NEVER, lambda: None)
    b = PeriodicThread("b", NEVER, lambda: None)
    registry.register(a)
    registry.register(b)
    assert registry.get("a") is a
    assert registry.get("missing") is None
    assert "b" in registry and "missing" not in registry
    assert registry.get_all() == [a, b]
    assert registry.unregister("a") is a
    assert registry.unregister("a") is None
    assert registry.get("a") is None
    assert len(registry) == 1


def test_get_by_level(registry: PeriodicThreadRegistry) -> None:
    crit = create_periodic_thread("crit", NEVER, lambda: None, ThreadLevel.CRITICAL)
    low1 = create_periodic_thread("low1", NEVER, lambda: None, ThreadLevel.LOW)
    low2 = create_periodic_thread("low2", NEVER, lambda: None, ThreadLevel.LOW)
    assert registry.get_by_level(ThreadLevel.CRITICAL) == [crit]
    assert registry.get_by_level(ThreadLevel.LOW) == [low1, low2]
    assert registry.get_by_level(ThreadLevel.HIGH) == []


def test_health_reports_stalled_critical_and_high_only(
    registry: PeriodicThreadRegistry, clock: FakeClock
) -> None:
    crit = make(registry, "reaper", level=ThreadLevel.CRITICAL, clock=clock, interval=NEVER)
    high = make(registry, "cleanup", level=ThreadLevel.HIGH, clock=clock, interval=NEVER)
    make(registry, "stats", level=ThreadLevel.MEDIUM, clock=clock, interval=NEVER)
    make(registry, "gc", level=ThreadLevel.LOW, clock=clock, interval=NEVER)
    # Registered but never started: not running, so it cannot stall.
    create_periodic_thread("idle", NEVER, lambda: None, ThreadLevel.CRITICAL, clock=clock)
    assert registry.health() == {"healthy": True, "unhealthy": []}

    high.wake()
    assert high.wait_for_runs(1, timeout=WAIT)
    clock.advance(3 * NEVER + 1)  # both miss 3 intervals; MEDIUM and LOW ones are ignored
    health = registry.health()
    assert health["healthy"] is False and not registry.is_healthy()
    by_name = {entry["name"]: entry for entry in health["unhealthy"]}
    assert set(by_name) == {"reaper", "cleanup"}
    assert by_name["reaper"]["level"] == "critical"
    assert by_name["reaper"]["seconds_since_last_run"] == 3 * NEVER + 1  # from start
    assert "never completed" in by_name["reaper"]["reason"]
    assert by_name["cleanup"]["level"] == "high"
    assert "last cycle" in by_name["cleanup"]["reason"]

    crit.wake()
    high.wake()
    assert crit.wait_for_runs(1, timeout=WAIT) and high.wait_for_runs(2, timeout=WAIT)
    assert registry.is_healthy()

    clock.advance(3 * NEVER + 1)
    crit.stop()  # a stopped thread no longer counts, however stale
    assert [entry["name"] for entry in registry.health()["unhealthy"]] == ["cleanup"]


def test_create_periodic_thread_registers_and_optionally_starts(
    registry: PeriodicThreadRegistry,
) -> None:
    idle = create_periodic_thread("idle", NEVER, lambda: None)
    assert registry.get("idle") is idle and not idle.is_running()
    running = create_periodic_thread("running", NEVER, lambda: None, start=True)
    assert running.is_running()

    private = PeriodicThreadRegistry()
    mine = create_periodic_thread("idle", NEVER, lambda: None, registry=private)
    assert private.get("idle") is mine and registry.get("idle") is idle


def test_reset_stops_threads_and_empties(registry: PeriodicThreadRegistry) -> None:
    threads = [make(registry, f"worker{i}") for i in range(3)]
    oses = [os_thread(f"worker{i}") for i in range(3)]
    registry.reset()
    assert len(registry) == 0
    assert not any(t.is_running() for t in threads)
    assert not any(os is not None and os.is_alive() for os in oses)


def test_stop_all_waits_for_a_running_cycle(registry: PeriodicThreadRegistry) -> None:
    entered = threading.Event()
    release = threading.Event()
    finished = threading.Event()

    def body() -> None:
        entered.set()
        assert release.wait(WAIT)
        finished.set()

    thread = make(registry, "slow", body)
    thread.wake()
    assert entered.wait(WAIT)
    threading.Timer(0.05, release.set).start()
    registry.stop_all(timeout=WAIT)
    assert finished.is_set()  # stop_all returned only after the cycle finished
    assert thread.run_count == 1
    assert len(registry) == 1  # stop_all keeps registrations; reset() drops them

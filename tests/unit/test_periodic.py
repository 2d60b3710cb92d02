"""Tests for kvtier.periodic: cycle semantics, stop/wake, activity on a fake clock, registry."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterator

import pytest
from testkit.clock import FakeClock

from kvtier.periodic import (
    IrrecoverableException,
    PeriodicThread,
    PeriodicThreadRegistry,
    ThreadLevel,
    ThreadRunSummary,
    create_periodic_thread,
)

# Long enough that no cycle but the immediate first one runs by itself during a test.
NEVER = 60.0
# Generous bound on waits that should succeed; they normally return in milliseconds.
WAIT = 5.0


@pytest.fixture(autouse=True)
def registry() -> Iterator[PeriodicThreadRegistry]:
    """The shared registry, emptied (threads stopped) before and after each test."""
    shared = PeriodicThreadRegistry.get_instance()
    shared.reset()
    yield shared
    shared.reset()
    PeriodicThreadRegistry.reset()  # also empties a fresh singleton a test made


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
    init_wait: float = NEVER,
) -> PeriodicThread:
    """A registered, started thread (so the fixture stops it) running `fn` (or a no-op).

    `init_wait` defaults to NEVER so only wake() triggers cycles; pass 0 for the immediate one.
    """
    execute = fn if callable(fn) else (lambda: None)
    thread = create_periodic_thread(
        name,
        interval,
        execute,
        level,
        start=True,
        clock=clock if clock is not None else time.monotonic,
        init_wait=init_wait,
    )
    assert registry.get(name) is thread
    return thread


class Counter(PeriodicThread):
    """A lineage-style subclass: overrides `_execute`, no execute_fn."""

    def __init__(self, name: str, interval: float, init_wait: float, clock: FakeClock) -> None:
        super().__init__(name, interval, ThreadLevel.HIGH, init_wait, clock=clock)
        self.calls = 0

    def _execute(self) -> ThreadRunSummary:
        self.calls += 1
        return ThreadRunSummary(success=self.calls != 2, message=f"call {self.calls}")


# -- construction ----------------------------------------------------------------------------


@pytest.mark.parametrize("interval", [0, -1.0, math.nan, math.inf])
def test_bad_interval_raises_value_error_naming_it(interval: float) -> None:
    with pytest.raises(ValueError, match="interval"):
        PeriodicThread("bad", interval, execute_fn=lambda: None)


def test_empty_name_raises_value_error() -> None:
    with pytest.raises(ValueError, match="name"):
        PeriodicThread("", 1.0, execute_fn=lambda: None)


@pytest.mark.parametrize("init_wait", [-1.0, math.nan, math.inf])
def test_bad_init_wait_raises_value_error_naming_it(init_wait: float) -> None:
    with pytest.raises(ValueError, match="init_wait"):
        PeriodicThread("bad", 1.0, init_wait=init_wait, execute_fn=lambda: None)


def test_nothing_to_run_raises_type_error_naming_the_fix() -> None:
    with pytest.raises(TypeError, match=r"execute_fn=\.\.\. or subclass"):
        PeriodicThread("bare", 1.0)


def test_body_passed_positionally_is_refused_with_a_hint() -> None:
    # The third positional parameter is `level` (as in LMCache); the body goes by keyword.
    with pytest.raises(ValueError, match=r"level must be a ThreadLevel.*execute_fn=") as info:
        PeriodicThread("old-style", 1.0, lambda: None)  # type: ignore[arg-type]
    assert "'old-style'" in str(info.value)


def test_levels_are_lower_case_strings() -> None:
    assert [level.value for level in ThreadLevel] == ["critical", "high", "medium", "low"]


# -- lifecycle -------------------------------------------------------------------------------


def test_runs_on_a_daemon_thread_named_after_it(registry: PeriodicThreadRegistry) -> None:
    thread = make(registry, "named")
    os = os_thread("named")
    assert os is not None and os.daemon
    assert thread.is_running()


@pytest.mark.parametrize(("init_wait", "runs"), [(NEVER, 0), (0.0, 1)])
def test_stop_interrupts_a_long_sleep(
    registry: PeriodicThreadRegistry, init_wait: float, runs: int
) -> None:
    # The wait is 60 s (init_wait, or the interval after the immediate first cycle); a thread
    # that slept with time.sleep would still be alive after a 1 s join, so "not alive" shows
    # stop() returned within 1 s because the sleep was cut short.
    thread = make(registry, "sleeper", init_wait=init_wait)
    assert thread.wait_for_runs(runs, timeout=WAIT)
    os = os_thread("sleeper")
    assert os is not None
    thread.stop(timeout=1.0)
    assert not os.is_alive()
    assert not thread.is_running()
    assert thread.run_count == runs
    thread.stop(timeout=1.0)  # idempotent


def test_first_cycle_runs_at_start_then_every_interval(registry: PeriodicThreadRegistry) -> None:
    slow = make(registry, "slow", init_wait=0.0)
    assert slow.wait_for_runs(1, timeout=WAIT)  # no wake: the first cycle is immediate
    assert not slow.wait_for_runs(2, timeout=0.3)  # the next one is an interval (60 s) away
    fast = make(registry, "fast", init_wait=0.0, interval=0.01)
    assert fast.wait_for_runs(3, timeout=WAIT)  # later cycles follow the interval by themselves


def test_start_twice_and_restart_raise_runtime_error(registry: PeriodicThreadRegistry) -> None:
    thread = make(registry, "once")
    with pytest.raises(RuntimeError, match="already started"):
        thread.start()
    thread.stop()
    with pytest.raises(RuntimeError, match="cannot restart"):
        thread.start()


def test_stop_before_start_prevents_start() -> None:
    thread = PeriodicThread("never-started", NEVER, execute_fn=lambda: None)
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
    thread = PeriodicThread("early", NEVER, init_wait=NEVER, execute_fn=lambda: None)
    registry.register(thread)
    thread.wake()
    thread.start()
    # Had the early wake been kept, the first cycle would run at once instead of in 60 s.
    assert not thread.wait_for_runs(1, timeout=0.3)
    assert thread.run_count == 0


@pytest.mark.parametrize("init_wait", [NEVER, 0.0])
def test_wake_during_a_cycle_runs_exactly_one_more(
    registry: PeriodicThreadRegistry, init_wait: float
) -> None:
    entered = threading.Event()
    release = threading.Event()
    calls: list[int] = []

    def body() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            entered.set()
            assert release.wait(WAIT)

    thread = make(registry, "busy", body, init_wait=init_wait)
    if init_wait:
        thread.wake()  # otherwise the first cycle starts by itself
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


STATUS_KEYS = {
    "name",
    "level",
    "interval",
    "init_wait",
    "is_running",
    "is_active",
    "last_run_time",
    "last_run_ago",
    "total_runs",
    "failed_runs",
    "success_rate",
    "last_summary",
}


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
    as_dict = thread.to_dict()
    # The keys the admin API and the status page read, then get_status()'s on top.
    admin_keys = ["name", "level", "interval", "running", "active", "run_count"]
    admin_keys += ["failure_count", "last_summary"]
    assert {key: as_dict[key] for key in admin_keys} == {
        "name": "dicty",
        "level": "high",
        "interval": NEVER,
        "running": True,
        "active": True,
        "run_count": 0,
        "failure_count": 0,
        "last_summary": None,
    }
    assert set(as_dict) == set(admin_keys) | STATUS_KEYS
    assert as_dict["running"] is True and as_dict["active"] is True  # plain bools for JSON
    json.dumps(as_dict)
    thread.wake()
    assert thread.wait_for_runs(1, timeout=WAIT)
    as_dict = thread.to_dict()
    assert as_dict["run_count"] == as_dict["total_runs"] == 1
    assert as_dict["last_summary"] == summary.to_dict()


def test_get_status_has_the_lineage_keys(
    registry: PeriodicThreadRegistry, clock: FakeClock
) -> None:
    idle = PeriodicThread("idle", NEVER, ThreadLevel.LOW, 2.0, execute_fn=lambda: None)
    assert idle.get_status() == {
        "name": "idle",
        "level": "low",
        "interval": NEVER,
        "init_wait": 2.0,
        "is_running": False,
        "is_active": False,
        "last_run_time": None,
        "last_run_ago": None,
        "total_runs": 0,
        "failed_runs": 0,
        "success_rate": 1.0,
        "last_summary": None,
    }

    outcomes = [ThreadRunSummary(True, "first"), ThreadRunSummary(False, "second")]
    thread = make(registry, "status", lambda: outcomes.pop(0), clock=clock, init_wait=0.0)
    assert thread.wait_for_runs(1, timeout=WAIT)
    started_cycle_at = clock.now
    clock.advance(2.5)
    thread.wake()
    assert thread.wait_for_runs(2, timeout=WAIT)
    clock.advance(1.5)
    status = thread.get_status()
    assert set(status) == STATUS_KEYS
    assert status["is_running"] is True and status["is_active"] is True
    assert status["last_run_time"] == started_cycle_at + 2.5
    assert status["last_run_ago"] == 1.5
    assert (status["total_runs"], status["failed_runs"], status["success_rate"]) == (2, 1, 0.5)
    assert status["last_summary"]["message"] == "second"
    json.dumps(status)


# -- activity on a fake clock ----------------------------------------------------------------


def test_is_active_follows_the_fake_clock(
    registry: PeriodicThreadRegistry, clock: FakeClock
) -> None:
    thread = make(registry, "ticker", clock=clock, interval=10.0, init_wait=0.0)
    assert thread.wait_for_runs(1, timeout=WAIT)  # the immediate first cycle
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


def test_subclass_with_init_wait(registry: PeriodicThreadRegistry, clock: FakeClock) -> None:
    thread = Counter("counter", interval=10.0, init_wait=NEVER, clock=clock)
    registry.register(thread)
    assert not thread.is_active  # not started
    thread.start()
    assert thread.is_running and thread.is_active  # counted from start before the first cycle
    clock.advance(NEVER + 30.0)
    assert thread.is_active  # within init_wait + 3 intervals
    clock.advance(0.5)
    assert not thread.is_active
    assert (thread.calls, thread.total_runs) == (0, 0)  # init_wait (60 s) has not elapsed

    thread.wake()  # wake cuts init_wait short
    assert thread.wait_for_runs(1, timeout=WAIT)
    assert thread.is_active
    thread.wake()
    assert thread.wait_for_runs(2, timeout=WAIT)
    assert (thread.calls, thread.total_runs, thread.failed_runs) == (2, 2, 1)
    assert (thread.run_count, thread.failure_count) == (2, 1)
    summary = thread.last_summary
    assert summary is not None and summary.message == "call 2" and not summary.success
    assert thread.is_running  # a failed cycle does not stop it

    soon = Counter("soon", interval=NEVER, init_wait=0.01, clock=clock)
    registry.register(soon)
    soon.start()
    assert soon.wait_for_runs(1, timeout=WAIT)  # a short init_wait elapses by itself
    assert soon.calls == 1


def test_is_running_and_is_active_read_as_property_and_call(
    registry: PeriodicThreadRegistry,
) -> None:
    yes, no = True, False
    thread = PeriodicThread("dual", NEVER, execute_fn=lambda: None)
    registry.register(thread)
    before = thread.is_running
    assert not before and not thread.is_active
    assert thread.is_running() is False and thread.is_active() is False
    assert before == no and before != yes
    assert repr(before) == "False"

    thread.start()
    assert thread.is_running and thread.is_active
    assert thread.is_running() is True and thread.is_active() is True
    assert thread.is_running == yes and thread.is_running == thread.is_active
    assert hash(thread.is_running) == hash(True) and True in {thread.is_running}
    assert repr(thread.is_running) == "True"
    assert not before  # a snapshot: it does not change when the thread does
    with pytest.raises(AttributeError, match="immutable"):
        before._value = True

    thread.stop()
    assert not thread.is_running and not thread.is_active


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
    registry.register(PeriodicThread("twin", NEVER, execute_fn=lambda: None))
    with pytest.raises(ValueError, match="'twin'"):
        registry.register(PeriodicThread("twin", NEVER, execute_fn=lambda: None))
    with pytest.raises(ValueError, match="'twin'"):
        create_periodic_thread("twin", NEVER, lambda: None)
    assert len(registry) == 1


def test_get_unregister_contains_len(registry: PeriodicThreadRegistry) -> None:
    a = PeriodicThread("a", NEVER, execute_fn=lambda: None)
    b = PeriodicThread("b", NEVER, execute_fn=lambda: None)
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
    # The reaper waits init_wait (60 s) before its first cycle; the cleanup runs one at start.
    crit = make(registry, "reaper", level=ThreadLevel.CRITICAL, clock=clock)
    high = make(registry, "cleanup", level=ThreadLevel.HIGH, clock=clock, init_wait=0.0)
    make(registry, "stats", level=ThreadLevel.MEDIUM, clock=clock, init_wait=0.0)
    make(registry, "gc", level=ThreadLevel.LOW, clock=clock)
    # Registered but never started: not running, so it cannot stall.
    create_periodic_thread("idle", NEVER, lambda: None, ThreadLevel.CRITICAL, clock=clock)
    assert high.wait_for_runs(1, timeout=WAIT)
    assert registry.health() == {"healthy": True, "unhealthy": []}

    clock.advance(3 * NEVER + 1)  # the cleanup missed 3 intervals; the reaper has init_wait more
    health = registry.health()
    assert health["healthy"] is False and not registry.is_healthy()
    assert [entry["name"] for entry in health["unhealthy"]] == ["cleanup"]
    assert health["unhealthy"][0]["level"] == "high"
    assert "last cycle" in health["unhealthy"][0]["reason"]

    clock.advance(NEVER)  # now the reaper is past init_wait + 3 intervals; MEDIUM/LOW ignored
    by_name = {entry["name"]: entry for entry in registry.health()["unhealthy"]}
    assert set(by_name) == {"reaper", "cleanup"}
    assert by_name["reaper"]["level"] == "critical"
    assert by_name["reaper"]["seconds_since_last_run"] == 4 * NEVER + 1  # from start
    assert "never completed" in by_name["reaper"]["reason"]
    assert "init_wait" in by_name["reaper"]["reason"]

    crit.wake()
    high.wake()
    assert crit.wait_for_runs(1, timeout=WAIT) and high.wait_for_runs(2, timeout=WAIT)
    assert registry.is_healthy()

    clock.advance(3 * NEVER + 1)
    crit.stop()  # a stopped thread no longer counts, however stale
    assert [entry["name"] for entry in registry.health()["unhealthy"]] == ["cleanup"]


def test_running_and_active_counts(registry: PeriodicThreadRegistry, clock: FakeClock) -> None:
    ran = make(registry, "ran", clock=clock, init_wait=0.0)
    waiting = make(registry, "waiting", clock=clock)  # init_wait 60 s: no cycle yet
    create_periodic_thread("unstarted", NEVER, lambda: None, clock=clock)
    assert ran.wait_for_runs(1, timeout=WAIT)
    assert (registry.get_running_count(), registry.get_active_count()) == (2, 2)
    clock.advance(3 * NEVER + 1)  # "ran" missed 3 intervals; "waiting" still has init_wait
    assert (registry.get_running_count(), registry.get_active_count()) == (2, 1)
    waiting.stop()
    assert (registry.get_running_count(), registry.get_active_count()) == (1, 0)


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
    assert PeriodicThreadRegistry.get_instance() is registry  # an instance reset keeps it


def test_instance_reset_touches_only_that_registry(registry: PeriodicThreadRegistry) -> None:
    private = PeriodicThreadRegistry()
    mine = create_periodic_thread("mine", NEVER, lambda: None, registry=private, start=True)
    shared = make(registry, "shared")
    private.reset()
    assert len(private) == 0 and not mine.is_running
    assert registry.get("shared") is shared and shared.is_running


def test_class_reset_stops_and_drops_the_singleton(registry: PeriodicThreadRegistry) -> None:
    thread = make(registry, "old")
    os = os_thread("old")
    assert os is not None
    PeriodicThreadRegistry.reset()
    os.join(WAIT)
    assert not os.is_alive() and not thread.is_running
    assert len(registry) == 0  # the dropped registry was emptied too
    fresh = PeriodicThreadRegistry.get_instance()
    assert fresh is not registry and len(fresh) == 0
    again = create_periodic_thread("old", NEVER, lambda: None)  # no clash with the dropped one
    assert fresh.get("old") is again
    PeriodicThreadRegistry.reset()  # with no singleton yet made, a second reset is a no-op
    PeriodicThreadRegistry.reset()
    assert PeriodicThreadRegistry.get_instance() is not fresh


def test_unregister_all_returns_threads_without_stopping(
    registry: PeriodicThreadRegistry,
) -> None:
    threads = [make(registry, f"t{i}") for i in range(3)]
    assert registry.unregister_all() == threads
    assert len(registry) == 0 and registry.unregister_all() == []
    assert all(t.is_running for t in threads)
    for thread in threads:
        thread.stop()


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


def test_lineage_factory_signature_and_summary(registry: PeriodicThreadRegistry) -> None:
    # positional order of the lineage: (name, interval, execute_fn, level, init_wait, auto_register)
    loose = create_periodic_thread("loose", NEVER, lambda: None, ThreadLevel.LOW, NEVER, False)
    assert "loose" not in registry and loose.init_wait == NEVER
    crit = create_periodic_thread("crit", NEVER, lambda: None, ThreadLevel.CRITICAL, NEVER)
    assert "crit" in registry
    crit.start()
    try:
        assert registry.get_count_by_level(ThreadLevel.CRITICAL) == {
            "total": 1,
            "running": 1,
            "active": 1,
        }
        summary = registry.get_summary()
        assert summary["total_count"] == 1 and summary["running_count"] == 1
        assert summary["by_level"]["low"] == {"total": 0, "running": 0, "active": 0}
        assert [t["name"] for t in summary["threads"]] == ["crit"]
        json.dumps(summary)
    finally:
        crit.stop()


def test_start_returns_the_worker_and_an_irrecoverable_cycle_allows_a_restart() -> None:
    attempts: list[int] = []
    restarted = threading.Event()

    def execute() -> ThreadRunSummary:
        attempts.append(1)
        if len(attempts) == 1:
            raise IrrecoverableException("the first cycle gives up")
        restarted.set()
        return ThreadRunSummary(success=True)

    thread = PeriodicThread("irrecoverable", 10.0, ThreadLevel.LOW, execute_fn=execute)
    first = thread.start()
    first.join(5)
    assert not first.is_alive() and not thread.is_running
    assert thread.failure_count == 1
    second = thread.start()
    try:
        assert second is not first and restarted.wait(5)
        with pytest.raises(RuntimeError, match="already started"):
            thread.start()
    finally:
        thread.stop()
    with pytest.raises(RuntimeError, match="cannot restart"):
        thread.start()

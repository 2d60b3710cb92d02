"""The Mooncake tier's helpers: calls bounded by a deadline, the staging area, registered
ranges. No Mooncake needed: these are plain Python around its client."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
from testkit.waiting import wait_for

from kvtier.storage.tiers.mooncake_io import (
    STAGING_ALIGN,
    CallTimeout,
    Deadlines,
    Registered,
    Staging,
    address_of,
)


def test_a_call_on_time_returns_and_runs_after_once() -> None:
    calls = Deadlines(1.0, workers=2)
    after: list[str] = []
    assert calls.run(lambda: 42, lambda: after.append("done")) == 42
    assert after == ["done"]
    with pytest.raises(ZeroDivisionError):
        calls.run(lambda: 1 // 0, lambda: after.append("failed"))
    assert after == ["done", "failed"]
    calls.close()


def test_a_late_call_raises_and_gives_back_only_when_it_really_ends() -> None:
    calls = Deadlines(0.05, workers=2)
    release = threading.Event()
    after: list[float] = []
    t0 = time.monotonic()
    with pytest.raises(CallTimeout):
        calls.run(lambda: release.wait(5), lambda: after.append(time.monotonic()))
    assert time.monotonic() - t0 < 1 and after == [] and calls.late == 1
    # the deadline grows for calls that move bytes

    def slow() -> int:  # a call that takes 0.1 s
        time.sleep(0.1)  # the slow call under test, not a synchronization
        return 7

    assert calls.run(slow, extra_s=1.0) == 7
    release.set()
    assert wait_for(lambda: not calls.late, timeout=5, interval=0.01)
    assert calls.late == 0 and len(after) == 1  # given back once the call ended
    calls.close()


def test_when_every_thread_waits_on_a_late_call_new_calls_fail_at_once() -> None:
    calls = Deadlines(0.05, workers=2)
    release = threading.Event()
    for _ in range(2):
        with pytest.raises(CallTimeout):
            calls.run(lambda: release.wait(5))
    t0 = time.monotonic()
    with pytest.raises(CallTimeout, match="still unanswered"):
        calls.run(lambda: 1)
    assert time.monotonic() - t0 < 0.05
    release.set()
    calls.close()


def test_staging_hands_out_aligned_ranges_and_takes_them_back() -> None:
    stage = Staging(1 << 20)
    a = stage.take(100)
    b = stage.take(100)
    assert a is not None and b is not None and a != b
    assert a % STAGING_ALIGN == 0 and b % STAGING_ALIGN == 0
    assert stage.take(2 << 20) is None  # larger than the area
    stage.view(a, 3)[:] = b"abc"
    assert ctypes.string_at(stage.address + a, 3) == b"abc"  # the view is the registered memory
    stage.give([(a, 100), (b, 100)])
    assert stage.take(1 << 20) == 0  # all of it free again, coalesced


def test_registered_covers_only_whole_ranges_inside_one_registration() -> None:
    reg = Registered()
    reg.add(1000, 100)
    assert reg.covers(1000, 100) and reg.covers(1050, 10)
    assert not reg.covers(999, 10) and not reg.covers(1090, 20) and not reg.covers(5000, 1)


def test_address_of_reads_read_only_and_sliced_buffers() -> None:
    data = bytearray(b"0123456789")
    view = memoryview(data)
    assert address_of(view[4:]) == address_of(view) + 4
    frozen = b"xyz"
    assert ctypes.string_at(address_of(frozen), 3) == b"xyz"

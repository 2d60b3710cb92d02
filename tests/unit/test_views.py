"""server.observe.views.TierWatch: failing tiers become health, recent errors and few log lines."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvtier.server.observe.snapshots import L2Summary
from kvtier.server.observe.views import TierWatch
from kvtier.storage.tiers.base import Latency, TierStats


def tier(name: str = "redis", **fields: Any) -> TierStats:
    base: dict[str, Any] = dict(
        name=name, kind=name, url=f"{name}://x", healthy=True, last_error="", objects=0,
        used_bytes=0, capacity_bytes=0, hits=0, misses=0, corrupt=0, errors=0,
        layout_mismatches=0, size_mismatches=0, puts=0, bytes_written=0, bytes_read=0,
        read_latency=Latency(), write_latency=Latency(),
    )  # fmt: skip
    return TierStats(**{**base, **fields})


def summary(*tiers: TierStats) -> L2Summary:
    return L2Summary(tiers=list(tiers))


def test_errors_before_the_first_look_are_history() -> None:
    watch = TierWatch(window_s=30)
    assert watch.observe(summary(tier(errors=7)), now=0.0, wall=100.0) == []
    assert watch.annotate(summary(tier(errors=7)), now=1.0).failing == []


def test_growing_errors_fail_the_tier_for_the_window_and_log_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = TierWatch(window_s=30, log_every_s=30)
    watch.observe(summary(tier(errors=0)), now=0.0, wall=100.0)
    caplog.set_level(logging.WARNING, logger="kvtier.server.observe.views")
    records = []
    for i in range(1, 11):  # a failure at every check, every 2 s
        s = summary(tier(errors=i, last_error="Connection refused"))
        records += watch.observe(s, now=2.0 * i, wall=100.0 + 2 * i)
    assert [r.code for r in records] == ["L2_ERROR"] * 10
    assert "Connection refused" in records[-1].message and records[0].operation == "l2 redis"
    assert len([r for r in caplog.records if "failing" in r.getMessage()]) == 1
    assert watch.annotate(summary(tier(errors=10)), now=20.0 + 29.0).failing == ["redis"]
    # No new errors for longer than the window: healthy again, and the log says so once.
    assert watch.observe(summary(tier(errors=10)), now=20.0 + 31.0, wall=200.0) == []
    assert watch.annotate(summary(tier(errors=10)), now=20.0 + 31.0).failing == []
    assert len([r for r in caplog.records if "recovered" in r.getMessage()]) == 1


def test_a_tier_reporting_itself_unhealthy_fails_and_is_recorded_once() -> None:
    watch = TierWatch()
    watch.observe(summary(tier()), now=0.0, wall=0.0)
    down = summary(tier(healthy=False, last_error="cool-down after a timeout"))
    first = watch.observe(down, now=2.0, wall=2.0)
    assert len(first) == 1 and "cool-down after a timeout" in first[0].message
    assert watch.observe(down, now=4.0, wall=4.0) == []  # still down: nothing new to record
    assert watch.annotate(down, now=4.0).failing == ["redis"]


def test_corruption_is_recorded_but_does_not_fail_the_tier() -> None:
    watch = TierWatch()
    watch.observe(summary(tier("disk")), now=0.0, wall=0.0)
    records = watch.observe(summary(tier("disk", corrupt=2)), now=2.0, wall=2.0)
    assert [r.code for r in records] == ["L2_CORRUPT"] and "2 corrupt" in records[0].message
    assert watch.annotate(summary(tier("disk", corrupt=2)), now=2.0).failing == []

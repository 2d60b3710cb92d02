"""server.observe.views: TierWatch turns failing tiers into health, recent errors and few log
lines; AdminViews builds the status, health and session views of a real engine."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import ServerConfig
from kvtier.keys import compose
from kvtier.periodic import PeriodicThreadRegistry
from kvtier.server.app import build_engine
from kvtier.server.engine import Engine
from kvtier.server.observe.snapshots import L2Summary
from kvtier.server.views import AdminViews, TierWatch
from kvtier.storage.manager import TierManager
from kvtier.storage.tiers.base import Latency, TierStats
from kvtier.storage.tiers.disk import DiskTier


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


# -- the views of a real engine -------------------------------------------------------------------


class CountedDisk(DiskTier):
    """A real DiskTier that counts how often its stats are read."""

    reads = 0

    def stats(self) -> TierStats:
        self.reads += 1
        return super().stats()


@pytest.fixture
def disk(tmp_path: Path) -> CountedDisk:
    return CountedDisk(tmp_path / "l2", 0, name="disk")


@pytest.fixture
def engine(tmp_path: Path, disk: CountedDisk) -> Iterator[Engine]:
    config = ServerConfig(
        address=[f"ipc://{tmp_path}/kvtier.sock"],
        l1_size=1 << 20,
        chunk_size=4,
        arena_name=f"kvtier-views-test-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        prefault=False,
    )
    registry = PeriodicThreadRegistry()
    engine = build_engine(config, tiers=TierManager([disk]), registry=registry, start_threads=False)
    yield engine
    engine.close()


def test_a_status_reads_each_tiers_stats_once(engine: Engine, disk: CountedDisk) -> None:
    views = AdminViews(engine, registry=PeriodicThreadRegistry())
    disk.reads = 0
    status = views.status()
    assert disk.reads == 1 and [t.name for t in status.l2.tiers] == ["disk"]
    assert status.health == "ok" and status.l2.failing == []
    disk.reads = 0
    assert b"kvtier_l2_objects" in views.metrics.render()  # a scrape builds one status
    assert disk.reads == 1
    disk.reads = 0
    assert views.check_tiers().success and disk.reads == 1
    disk.reads = 0
    assert views.health().state == "ok" and disk.reads == 1


def test_a_session_as_the_admin_api_shows_it(engine: Engine) -> None:
    views = AdminViews(engine, registry=PeriodicThreadRegistry())
    session = engine.sessions.get_or_create(compose("", "", "r"))
    session.set_tokens(list(range(9)))
    session.get_hashes(0)
    info = views.get_session("r")  # a bare request id names the anonymous tenant's session
    assert info is not None
    assert (info.session_id, info.request_id, info.num_tokens) == (session.request_id, "r", 9)
    assert (info.num_chunks_hashed, info.pinned_chunks) == (2, 0)
    assert views.list_sessions(0, 10) == (1, [info])

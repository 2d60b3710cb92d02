"""Tests for kvtier.storage.observers: what the L1, the tier manager and the disk tier report."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import redis
from testkit.kv_servers import start_kv_server
from testkit.servers import free_port
from testkit.waiting import wait_for

from kvtier.keys import ChunkKey
from kvtier.storage.arena import PAGE_SIZE
from kvtier.storage.l1 import L1Store
from kvtier.storage.manager import TierManager
from kvtier.storage.observers import L1_TIER, Observers, Removal
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.disk import DiskTier
from kvtier.storage.tiers.redis import RedisTier

LAYOUT = "uint8[4096]"


class Record:
    """An observer that keeps every report, in order."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, str, tuple[ChunkKey, ...], str]] = []

    def stored(self, keys: Sequence[ChunkKey], tier: str) -> None:
        self.reports.append(("stored", tier, tuple(keys), ""))

    def removed(self, keys: Sequence[ChunkKey], tier: str, reason: Removal) -> None:
        self.reports.append(("removed", tier, tuple(keys), reason.value))

    def cleared(self, tier: str, model: str | None, cache_salt: str | None) -> None:
        self.reports.append(("cleared", tier, (), f"{model}/{cache_salt}"))

    def take(self) -> list[tuple[str, str, tuple[ChunkKey, ...], str]]:
        out, self.reports = self.reports, []
        return out


class Broken:
    """An observer that raises on every report."""

    def stored(self, keys: Sequence[ChunkKey], tier: str) -> None:
        raise RuntimeError("observer on fire")

    def removed(self, keys: Sequence[ChunkKey], tier: str, reason: Removal) -> None:
        raise RuntimeError("observer on fire")

    def cleared(self, tier: str, model: str | None, cache_salt: str | None) -> None:
        raise RuntimeError("observer on fire")


def key(i: int, *, world_size: int = 1, salt: str = "") -> ChunkKey:
    return ChunkKey("m", salt, world_size, hashlib.sha256(str(i).encode()).digest())


def store(l1: L1Store, k: ChunkKey) -> None:
    for rank in range(k.world_size):
        assert l1.reserve(k, rank, PAGE_SIZE, owner="w", lease_s=30) is not None
        l1.commit(k, rank, owner="w")


def test_l1_reports_complete_groups_evictions_and_clears() -> None:
    seen = Record()
    l1 = L1Store(3 * PAGE_SIZE, observer=Observers(seen))
    a, b = key(1, world_size=2), key(2)
    assert l1.reserve(a, 0, PAGE_SIZE, owner="w", lease_s=30) is not None
    l1.commit(a, 0, owner="w")
    assert seen.take() == []  # one rank of two: not stored yet
    assert l1.reserve(a, 1, PAGE_SIZE, owner="w", lease_s=30) is not None
    l1.commit(a, 1, owner="w")
    store(l1, b)
    assert seen.take() == [("stored", L1_TIER, (a,), ""), ("stored", L1_TIER, (b,), "")]
    store(l1, key(3))  # a (two pages, least recent) makes room
    assert seen.take() == [
        ("removed", L1_TIER, (a,), "evicted"),
        ("stored", L1_TIER, (key(3),), ""),
    ]
    l1.pin("h", [b], ranks=[0], lease_s=30)
    assert l1.clear() == 2
    # the pinned group is invisible at once, so it is reported with the idle one
    assert seen.take() == [("removed", L1_TIER, (b, key(3)), "cleared")]
    l1.unpin("h")
    assert seen.take() == []


def test_l1_keeps_working_when_an_observer_raises() -> None:
    seen = Record()
    l1 = L1Store(2 * PAGE_SIZE, observer=Observers(Broken(), seen))
    store(l1, key(1))
    assert l1.is_complete(key(1))
    assert seen.take() == [("stored", L1_TIER, (key(1),), "")]


def piece(i: int) -> memoryview:
    return memoryview(hashlib.sha256(str(i).encode()).digest() * (4096 // 32))


def object_size() -> int:
    return len(fmt.encode_header(key(0).shard(0).to_str(), LAYOUT, piece(0), aligned=True)) + 4096


def test_disk_tier_reports_groups_written_evicted_corrupt_cleared_and_survivors(
    tmp_path: Path,
) -> None:
    seen = Record()
    disk = DiskTier(tmp_path, 3 * object_size())
    tiers = TierManager([disk], observer=Observers(seen))
    tiers.start()
    try:
        two = key(1, world_size=2)
        tiers.submit(two.shard(0), piece(1), LAYOUT)
        assert tiers.flush()
        assert seen.take() == []  # one piece of two
        tiers.submit(two.shard(1), piece(2), LAYOUT)
        tiers.submit(key(2).shard(0), piece(3), LAYOUT)
        assert tiers.flush()
        assert seen.take() == [("stored", "disk", (two, key(2)), "")]
        tiers.submit(key(3).shard(0), piece(4), LAYOUT)  # the oldest piece makes room
        assert tiers.flush()
        assert seen.take() == [
            ("removed", "disk", (two,), "evicted"),
            ("stored", "disk", (key(3),), ""),
        ]
        # a damaged file is deleted on read, and reported
        path = disk._path(key(2).shard(0))[1]
        with open(path, "r+b") as f:
            f.seek(-1, 2)
            f.write(b"\xff")
        assert tiers.get_into(key(2).shard(0), memoryview(bytearray(4096)), LAYOUT) is None
        assert seen.take() == [("removed", "disk", (key(2),), "corrupt")]
    finally:
        tiers.close()
    # a new process over the same folder reports what survived, then a clear of it
    again = TierManager([DiskTier(tmp_path, 0)], observer=Observers(seen))
    again.start()
    try:
        # two's second piece is still there, but without its first the group is not stored
        assert seen.take() == [("stored", "disk", (key(3),), "")]
        assert again.clear(model="m") == 2
        assert seen.take() == [("removed", "disk", (two, key(3)), "cleared")]
    finally:
        again.close()


def reports_once(
    seen: Record, n: int, timeout: float = 10.0
) -> list[tuple[str, str, tuple[ChunkKey, ...], str]]:
    """The reports `seen` took, once there are `n` of them (or `timeout` has passed)."""
    wait_for(lambda: len(seen.reports) >= n, timeout, interval=0.05)
    return seen.take()


def test_redis_tier_reports_the_servers_expiries_and_its_corrupt_deletes() -> None:
    port = free_port()
    server = start_kv_server("redis", port, "--notify-keyspace-events", "Exe")
    seen = Record()
    tier = RedisTier(f"redis://127.0.0.1:{port}/0", prefix="obs", ttl=1)
    other = RedisTier(f"redis://127.0.0.1:{port}/0", prefix="other", ttl=1)
    tiers = TierManager([tier], observer=Observers(seen))
    tiers.start()
    try:
        assert tier.watch is not None and tier.watch.checked.wait(10)
        assert tier.stats().extra["removals_watched"] == 1
        tiers.submit(key(1).shard(0), piece(1), LAYOUT)
        other.put(key(2).shard(0), piece(2), LAYOUT)  # another prefix: not this tier's
        assert tiers.flush()
        assert reports_once(seen, 1) == [("stored", "redis", (key(1),), "")]
        assert reports_once(seen, 1) == [("removed", "redis", (key(1),), "expired")]
        name = tier.redis_key(key(3).shard(0)).encode()
        tier.put(key(3).shard(0), piece(3), LAYOUT)
        redis.Redis(port=port).setrange(name, 200, b"\xff\xfe")  # damage the stored object
        assert not tier.get_into(key(3).shard(0), memoryview(bytearray(4096)), LAYOUT)
        reports = reports_once(seen, 1)
        assert reports[0] == ("removed", "redis", (key(3),), "corrupt")
    finally:
        tiers.close()
        other.close()
        server.kill()
        server.wait()


def test_redis_tier_without_notifications_says_removals_are_unseen() -> None:
    port = free_port()
    server = start_kv_server("redis", port)
    tier = RedisTier(f"redis://127.0.0.1:{port}/0", prefix="obs", ttl=1)
    tiers = TierManager([tier], observer=Observers(Record()))
    tiers.start()
    try:
        assert tier.watch is not None and tier.watch.checked.wait(10)
        assert tier.stats().extra["removals_watched"] == 0
    finally:
        tiers.close()
        server.kill()
        server.wait()

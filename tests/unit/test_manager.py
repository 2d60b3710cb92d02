"""TierManager over real tiers: a DiskTier and the real Redis at 127.0.0.1:6379."""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from collections.abc import Collection, Iterator, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import redis
from typing_extensions import Buffer

from kvtier import protocol as p
from kvtier.config import ServerConfig
from kvtier.keys import ObjectKey
from kvtier.periodic import PeriodicThreadRegistry
from kvtier.server.app import build_engine
from kvtier.storage.manager import TierManager
from kvtier.storage.tiers.disk import DiskTier
from kvtier.storage.tiers.format import Hit
from kvtier.storage.tiers.redis import RedisTier

LAYOUT = "float16[8,64]"
SIZE = 1024


def key(i: int) -> ObjectKey:
    return ObjectKey("m", "s", 1, 0, hashlib.sha256(str(i).encode()).digest())


def payload(i: int) -> memoryview:
    return memoryview(hashlib.sha256(str(i).encode()).digest() * (SIZE // 32))


class GatedDisk(DiskTier):
    """A real DiskTier whose batch writes wait until the test opens the gate."""

    def __init__(self, path: Path, name: str = "gated") -> None:
        super().__init__(path, 0, name=name)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def put_many(
        self,
        items: Sequence[tuple[ObjectKey, Buffer, str]],
        *,
        unresumable: Collection[ObjectKey] = (),
    ) -> int:
        self.entered.set()
        assert self.gate.wait(10)
        return super().put_many(items, unresumable=unresumable)


class BatchedDisk(DiskTier):
    """A real DiskTier that records how many objects each batch write brought."""

    def __init__(self, path: Path, name: str) -> None:
        super().__init__(path, 0, name=name)
        self.batches: list[int] = []

    def put_many(
        self,
        items: Sequence[tuple[ObjectKey, Buffer, str]],
        *,
        unresumable: Collection[ObjectKey] = (),
    ) -> int:
        self.batches.append(len(items))
        return super().put_many(items, unresumable=unresumable)


class BrokenDisk(DiskTier):
    """A real DiskTier whose batch writes always raise."""

    def put_many(
        self,
        items: Sequence[tuple[ObjectKey, Buffer, str]],
        *,
        unresumable: Collection[ObjectKey] = (),
    ) -> int:
        raise OSError("disk on fire")


class AskedDisk(DiskTier):
    """A real DiskTier that records which keys contains_many was asked about."""

    asked: list[ObjectKey]

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        self.asked = list(keys)
        return super().contains_many(keys)

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[Hit]:
        self.asked = [k for k, _, _ in items]
        return super().get_many_into(items)


class BrokenReads(DiskTier):
    """A real DiskTier whose batch reads always raise."""

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[Hit]:
        raise OSError("disk on fire")


@pytest.fixture
def redis_tier() -> Iterator[RedisTier]:
    probe = redis.Redis(socket_connect_timeout=1)
    try:
        probe.ping()
    except redis.ConnectionError as exc:
        pytest.fail(
            f"no Redis at 127.0.0.1:6379 ({exc}); start it with: "
            'redis-server --daemonize yes --port 6379 --save "" --appendonly no',
            pytrace=False,
        )
    prefix = f"kvtier-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tier = RedisTier(prefix=prefix)
    yield tier
    names = list(probe.scan_iter(match=f"{prefix}:*"))
    if names:
        probe.delete(*names)
    tier.close()
    probe.close()


def test_write_through_to_disk_and_redis(tmp_path: Path, redis_tier: RedisTier) -> None:
    disk = BatchedDisk(tmp_path, name="disk")
    mgr = TierManager([disk, redis_tier], batch_size=4)
    done: list[int] = []
    mgr.start()
    for i in range(10):
        assert mgr.submit(key(i), payload(i), LAYOUT, on_done=partial(done.append, i))
    assert mgr.flush(10)
    assert sorted(done) == list(range(10))
    for tier in (disk, redis_tier):
        assert tier.contains_many([key(i) for i in range(10)]) == [True] * 10
        buf = memoryview(bytearray(SIZE))
        assert tier.get_into(key(7), buf, LAYOUT) and buf == payload(7)
    s = mgr.summary()
    assert (s.submitted, s.written, s.dropped, s.write_errors) == (10, 10, 0, 0)
    assert [(t.name, t.puts) for t in s.tiers] == [("disk", 10), ("redis", 10)]
    assert sum(disk.batches) == 10 and max(disk.batches) <= 4 and len(disk.batches) >= 3
    assert s.tiers[0].objects == 10 and s.queue_depth == 0
    assert mgr.clear(model="m") == 20
    mgr.close()


def test_drop_policy_counts_and_calls_on_done_once(tmp_path: Path) -> None:
    gated = GatedDisk(tmp_path)
    mgr = TierManager([gated], queue_size=2, batch_size=1, policy="drop")
    calls: dict[int, int] = {}

    def done(i: int) -> None:
        calls[i] = calls.get(i, 0) + 1

    mgr.start()
    assert mgr.submit(key(0), payload(0), LAYOUT, lambda: done(0))
    assert gated.entered.wait(10)  # the writer holds item 0; the queue is empty
    assert mgr.submit(key(1), payload(1), LAYOUT, lambda: done(1))
    assert mgr.submit(key(2), payload(2), LAYOUT, lambda: done(2))
    assert not mgr.submit(key(3), payload(3), LAYOUT, lambda: done(3))
    assert calls == {3: 1}  # a dropped object is released at once
    s = mgr.summary()
    assert (s.dropped, s.queue_depth, s.queue_capacity, s.policy) == (1, 2, 2, "drop")
    assert not mgr.flush(0.05)
    gated.gate.set()
    assert mgr.flush(10)
    assert calls == {0: 1, 1: 1, 2: 1, 3: 1}
    assert gated.contains_many([key(i) for i in range(4)]) == [True, True, True, False]
    mgr.close()
    assert calls == {0: 1, 1: 1, 2: 1, 3: 1}


def test_block_policy_waits_then_drops(tmp_path: Path) -> None:
    gated = GatedDisk(tmp_path)
    mgr = TierManager([gated], queue_size=1, batch_size=1, policy="block", block_timeout=0.05)
    mgr.start()
    assert mgr.submit(key(0), payload(0), LAYOUT)
    assert gated.entered.wait(10)
    assert mgr.submit(key(1), payload(1), LAYOUT)
    assert not mgr.submit(key(2), payload(2), LAYOUT)
    assert mgr.summary().dropped == 1
    gated.gate.set()
    mgr.close()
    assert mgr.summary().written == 2


def test_failing_tier_does_not_block_others_or_the_writer(tmp_path: Path) -> None:
    broken = BrokenDisk(tmp_path / "broken", 0, name="broken")
    good = DiskTier(tmp_path / "good", 0, name="good")
    mgr = TierManager([broken, good], batch_size=2)
    done: list[int] = []
    mgr.start()
    for i in range(5):
        mgr.submit(key(i), payload(i), LAYOUT, partial(done.append, i))
    assert mgr.flush(10)
    assert sorted(done) == list(range(5))
    assert good.contains_many([key(i) for i in range(5)]) == [True] * 5
    s = mgr.summary()
    assert s.write_errors == 5 and s.written == 5
    assert [(t.name, t.puts) for t in s.tiers] == [("broken", 0), ("good", 5)]
    mgr.close()


def test_read_path_goes_in_tier_order(tmp_path: Path) -> None:
    first = AskedDisk(tmp_path / "1", 0, name="first")
    second = AskedDisk(tmp_path / "2", 0, name="second")
    first.put(key(1), payload(1), LAYOUT)
    second.put(key(1), payload(100), LAYOUT)
    second.put(key(2), payload(2), LAYOUT)
    mgr = TierManager([first, second])
    buf = memoryview(bytearray(SIZE))
    assert mgr.get_into(key(1), buf, LAYOUT) == "first" and buf == payload(1)
    assert mgr.get_into(key(2), buf, LAYOUT) == "second" and buf == payload(2)
    assert mgr.get_into(key(3), buf, LAYOUT) is None
    assert mgr.get_into(key(1), buf, "other-layout") is None
    assert mgr.contains_many([key(1), key(2), key(3)]) == [True, True, False]
    assert first.asked == [key(1), key(2), key(3)]
    assert second.asked == [key(2), key(3)]
    mgr.close()


def test_batch_read_goes_in_tier_order_past_a_failing_tier(tmp_path: Path) -> None:
    broken = BrokenReads(tmp_path / "0", 0, name="broken")
    first = AskedDisk(tmp_path / "1", 0, name="first")
    second = AskedDisk(tmp_path / "2", 0, name="second")
    for tier in (broken, first):
        tier.put(key(1), payload(1), LAYOUT)
    second.put(key(1), payload(100), LAYOUT)
    second.put(key(2), payload(2), LAYOUT)
    second.put(key(4), payload(4), "other-layout")
    mgr = TierManager([broken, first, second])
    bufs = [memoryview(bytearray(SIZE)) for _ in range(4)]
    got = mgr.get_many_into([(key(i), bufs[i - 1], LAYOUT) for i in (1, 2, 3, 4)])
    assert [found and found.tier for found in got] == ["first", "second", None, None]
    assert all(found.resumable for found in got if found)
    assert bufs[0] == payload(1) and bufs[1] == payload(2)
    assert first.asked == [key(1), key(2), key(3), key(4)]
    assert second.asked == [key(2), key(3), key(4)]  # only what the earlier tiers lacked
    assert mgr.summary().read_errors == 1
    assert mgr.get_many_into([]) == []
    mgr.close()


def test_close_flushes_queued_work_and_rejects_later_submits(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 0)
    mgr = TierManager([disk])
    done: list[int] = []
    for i in range(3):  # queued before the writer starts
        assert mgr.submit(key(i), payload(i), LAYOUT, partial(done.append, i))
    mgr.start()
    mgr.close()
    assert sorted(done) == [0, 1, 2] and disk.stats().objects == 3
    assert not mgr.submit(key(9), payload(9), LAYOUT, lambda: done.append(9))
    assert done[-1] == 9 and mgr.summary().dropped == 1
    with pytest.raises(RuntimeError):
        mgr.start()


def test_close_without_start_releases_queued_objects(tmp_path: Path) -> None:
    mgr = TierManager([DiskTier(tmp_path, 0)])
    done: list[int] = []
    mgr.submit(key(0), payload(0), LAYOUT, lambda: done.append(0))
    mgr.close()
    assert done == [0] and mgr.summary().dropped == 1 and mgr.flush(0)


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 0)
    with pytest.raises(ValueError, match="queue_size"):
        TierManager([disk], queue_size=0)
    with pytest.raises(ValueError, match="policy"):
        TierManager([disk], policy="wait")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unique"):
        TierManager([disk, DiskTier(tmp_path / "b", 0)])


def test_queue_defaults_come_from_server_config(tmp_path: Path) -> None:
    config = ServerConfig()
    mgr = TierManager([DiskTier(tmp_path, 0)])
    assert (mgr.queue_size, mgr.policy) == (config.l2_queue_size, config.l2_queue_policy)
    mgr.close()


# -- the engine's writer --------------------------------------------------------------------------


def _engine_config(tmp_path: Path, l2: list[str]) -> ServerConfig:
    return ServerConfig(
        address=[f"ipc://{tmp_path}/kvtier.sock"],
        l1_size=1 << 20,
        l2=l2,
        chunk_size=16,
        arena_name=f"kvtier-manager-test-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        prefault=False,
    )


def test_an_engine_from_build_engine_writes_its_stores_through(tmp_path: Path) -> None:
    """build_engine opens the L2 tiers itself (no TierManager handed in): its writer runs, so
    committed groups reach the disk tier and are evictable again once written."""
    config = _engine_config(tmp_path, [f"disk://{tmp_path}/l2?size=16MiB"])
    engine = build_engine(config, registry=PeriodicThreadRegistry(), start_threads=False)
    try:
        hello = p.Hello(p.PROTOCOL_VERSION, "c1", host_id=p.local_host_id(), pid=os.getpid())
        assert isinstance(p.decode_reply(engine.call(b"me", p.encode(hello))[0]), p.HelloReply)
        register = p.Register("m", 1, 0, [64], "uint8")
        assert isinstance(p.decode_reply(engine.call(b"me", p.encode(register))[0]), p.Ok)
        tokens = np.arange(4 * 16, dtype="<u4").tobytes()
        store = p.StoreInline("r", tokens, "m", 1, 0, 0, 4 * 16, [64], "uint8", 4)
        frames = engine.call(b"me", p.encode(store), [bytes([i]) * 64 for i in range(4)])
        reply = p.decode_reply(frames[0])
        assert isinstance(reply, p.StoreReply) and reply.stored_chunks == 4
        assert engine.tiers.flush(timeout=10), "the L2 writer never wrote the queued stores"
        summary = engine.tiers.summary()
        assert (summary.written, summary.dropped, summary.tiers[0].objects) == (4, 0, 4)
    finally:
        engine.close()


def test_build_engine_refuses_tiers_whose_writer_cannot_run(tmp_path: Path) -> None:
    closed = TierManager([DiskTier(tmp_path / "l2", 0)])
    closed.close()
    config = _engine_config(tmp_path, ["none"])
    try:
        built = build_engine(config, tiers=closed, registry=PeriodicThreadRegistry())
    except RuntimeError as exc:
        assert "after close" in str(exc)
    else:
        built.close()
        pytest.fail("build_engine took a closed TierManager, whose writer can never run")
    assert not Path(f"/dev/shm/{config.arena_name}").exists()
    running = TierManager([])
    running.start()  # a server starts its tiers first: build_engine takes them as they run
    engine = build_engine(config, tiers=running, registry=PeriodicThreadRegistry())
    assert engine.tiers.running
    engine.close()
    assert not running.running

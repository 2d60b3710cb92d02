"""Hand-off objects against real servers: stored whatever the cache policy says, pinned for
their reader, never found by a prefix-cache lookup, freed when read or when their lease lapses,
counted in /metrics, and read across two servers that share a Redis tier."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import redis
from testkit.admin import admin_url, metric_samples, status, written
from testkit.servers import ServerProcess
from testkit.waiting import wait_for

from kvtier.client import Client

CS = 16
SHAPE = (2, 64)  # 256 bytes per chunk in float16


def chunks(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *SHAPE)).astype(np.float16)


def connect(server: ServerProcess) -> Client:
    c = Client(server.address, timeout=10)
    c.register(model="m", chunk_shape=SHAPE, dtype="float16")
    return c


def hand_off(c: Client, handoff: str, names: list[str], data: np.ndarray) -> None:
    with c.store_key_slots(
        names, model="m", chunk_shape=SHAPE, dtype="float16", handoff=handoff
    ) as slots:
        for i, view in slots.targets():
            view[:] = data[i].view(np.uint8).reshape(-1)


def handoff_chunks(server: ServerProcess) -> dict[str, float]:
    got = metric_samples(httpx.get(admin_url(server) + "/metrics", timeout=5).text)
    return {
        dict(labels)["event"]: value
        for (name, labels), value in got.items()
        if name == "kvtier_handoff_chunks_total"
    }


def test_handoff_is_pinned_read_once_and_freed(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    # The doorkeeper declines what one request stores: a hand-off is stored all the same.
    srv = server_factory(
        "--l1-size", "64KiB", "--chunk-size", str(CS), "--policy", "doorkeeper",
        "--l2", f"disk://{tmp_path}/l2?size=1MiB", "--reap-interval", "0.1",
    )  # fmt: skip
    names = [f"h1/{i}" for i in range(3)]
    data = chunks(1, 3)
    with connect(srv) as producer, connect(srv) as other, connect(srv) as decoder:
        hand_off(producer, "h1", names, data)
        assert handoff_chunks(srv)["stored"] == 3
        assert wait_for(lambda: written(srv, 3))  # admitted: written through to L2
        time.sleep(0.3)  # sweeps of the reaper: a local disk tier releases no pin
        assert handoff_chunks(srv)["released"] == 0
        # Others fill L1 several times over: the pinned hand-off stays.
        for k in range(12):
            other.put_keys([f"fill{k}/{i}" for i in range(4)], chunks(10 + k, 4), model="m")
        assert decoder.exists_keys(names, model="m") == 3
        out = np.zeros_like(data)
        assert decoder.get_keys(names, out, model="m") == 3
        assert out.tobytes() == data.tobytes()
        decoder.end_handoff("h1", names, model="m")
        assert handoff_chunks(srv)["read"] == 3
        # Gone from L1 and from the disk tier: a later read is a miss.
        assert decoder.exists_keys(names, model="m") == 0


def test_handoff_lapses_when_nobody_reads_it(
    server_factory: Callable[..., ServerProcess],
) -> None:
    srv = server_factory(
        "--l1-size", "64MiB", "--chunk-size", str(CS), "--handoff-lease", "1",
        "--reap-interval", "0.2",
    )  # fmt: skip
    names = [f"h2/{i}" for i in range(2)]
    with connect(srv) as producer, connect(srv) as reader:
        hand_off(producer, "h2", names, chunks(2, 2))
        assert reader.exists_keys(names, model="m") == 2
        # The producer lives and heartbeats: its hand-off lapses all the same.
        assert wait_for(lambda: handoff_chunks(srv).get("lapsed", 0) == 2, timeout=10)
        assert reader.exists_keys(names, model="m") == 0
        assert status(srv)["l1"]["used_bytes"] == 0


def test_handoff_in_a_shared_tier_lapses_unpinned(
    server_factory: Callable[..., ServerProcess], redis_url: str, redis_prefix: str
) -> None:
    """Released from L1 once Redis holds it, an unread hand-off still lapses at its lease's
    end: gone from L1 and from Redis."""
    srv = server_factory(
        "--chunk-size", str(CS), "--handoff-lease", "2", "--reap-interval", "0.2",
        "--l2", f"{redis_url}?prefix={redis_prefix}",
    )  # fmt: skip
    names = [f"h5/{i}" for i in range(2)]
    r = redis.Redis.from_url(redis_url)
    with connect(srv) as producer:
        hand_off(producer, "h5", names, chunks(5, 2))
        assert wait_for(lambda: handoff_chunks(srv).get("released") == 2)
        assert len(list(r.scan_iter(match=f"{redis_prefix}:*"))) == 2
        assert wait_for(lambda: handoff_chunks(srv).get("lapsed", 0) == 2, timeout=10)
        assert producer.exists_keys(names, model="m") == 0
    assert wait_for(lambda: not list(r.scan_iter(match=f"{redis_prefix}:*")), timeout=5)


def test_handoff_is_never_a_prefix_cache_hit(server: ServerProcess) -> None:
    """A hand-off's chunks are named from its id: a lookup of any prompt misses them."""
    with connect(server) as c:
        tokens = np.arange(3 * CS, dtype=np.uint32)
        hand_off(c, "h3", [f"h3/{i}" for i in range(3)], chunks(3, 3))
        assert c.lookup("r", tokens, model="m") == 0


def test_handoff_across_two_servers_sharing_redis(
    server_factory: Callable[..., ServerProcess], redis_url: str, redis_prefix: str
) -> None:
    tier = f"{redis_url}?prefix={redis_prefix}"
    node_a = server_factory("--chunk-size", str(CS), "--l1-size", "64KiB", "--l2", tier)
    node_b = server_factory("--chunk-size", str(CS), "--l2", tier)
    names = [f"h4/{i}" for i in range(3)]
    data = chunks(4, 3)
    with connect(node_a) as producer, connect(node_b) as decoder:
        hand_off(producer, "h4", names, data)
        assert wait_for(lambda: written(node_a, 3))
        # In the shared tier, the hand-off no longer holds A's L1: A's pins are released and
        # what A stores next evicts it.
        assert wait_for(lambda: handoff_chunks(node_a).get("released") == 3)
        assert status(node_a)["l1"]["pinned_groups"] == 0
        for k in range(6):  # 24 chunks of 4 KiB pages through a 64 KiB L1
            producer.put_keys([f"fill{k}/{i}" for i in range(4)], chunks(10 + k, 4), model="m")
            assert wait_for(lambda k=k: written(node_a, 3 + 4 * (k + 1)))
        assert producer.exists_keys(names[:1], model="m") == 1  # back from Redis into A's L1
        assert decoder.exists_keys(names, model="m") == 3  # loaded from Redis into B's L1
        out = np.zeros_like(data)
        assert decoder.get_keys(names, out, model="m") == 3
        assert out.tobytes() == data.tobytes()
        decoder.end_handoff("h4", names, model="m")
    r = redis.Redis.from_url(redis_url)

    def left() -> int:  # objects in Redis: the 24 fills stay, the hand-off's 3 go
        return len(list(r.scan_iter(match=f"{redis_prefix}:*")))

    assert wait_for(lambda: left() == 24, timeout=5), f"{left() - 24} read hand-off objects left"


def test_handoff_is_never_in_the_kv_events(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """A hand-off's chunks are no prefix-cache entries: neither their store (L1, then the disk
    tier) nor their end is published; the named chunks stored beside them are."""
    from .kv_follower import Follower

    tag = uuid.uuid4().hex[:8]
    pub, rep = f"ipc:///tmp/kvtier-ho-{tag}.pub", f"ipc:///tmp/kvtier-ho-{tag}.rep"
    srv = server_factory(
        "--chunk-size", str(CS), "--l2", f"disk://{tmp_path}/l2?size=1MiB",
        "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep,
    )  # fmt: skip
    follower = Follower(pub, rep)
    names = [f"h5/{i}" for i in range(3)]
    try:
        with connect(srv) as c:
            hand_off(c, "h5", names, chunks(5, 3))
            assert wait_for(lambda: written(srv, 3))  # in the disk tier too
            c.end_handoff("h5", names, model="m")
            c.put_keys(["after/0", "after/1"], chunks(6, 2), model="m")
            assert wait_for(lambda: written(srv, 5))

            def both_places() -> bool:
                follower.poll(0.1)
                cpu, disk = follower.hashes("CPU", "LOCAL"), follower.hashes("STORAGE", "LOCAL")
                return len(cpu) == 2 and len(disk) == 2

            assert wait_for(both_places, timeout=10), follower.held
        announced = {h for _, event in follower.stored for h in event.block_hashes}
        assert len(announced) == 2, f"hand-off chunks announced: {announced}"
    finally:
        follower.close()
        for path in (pub, rep):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path.removeprefix("ipc://"))


def test_producer_and_consumer_of_other_world_sizes_are_refused_at_registration(
    server: ServerProcess,
) -> None:
    """A hand-off consumer whose shards differ from a connected producer's (another TP size)
    is refused when it registers, naming both sizes; the same size, another model, and a
    worker in neither role are not."""
    from kvtier.errors import InvalidArgumentError

    def register(c: Client, model: str, world: int, role: str) -> None:
        c.register(model=model, world_size=world, chunk_shape=SHAPE, dtype="float16", role=role)

    with Client(server.address) as p, Client(server.address) as d, Client(server.address) as o:
        register(p, "m2", 2, "kv_producer")
        try:
            register(d, "m2", 1, "kv_consumer")
        except InvalidArgumentError as exc:
            assert "over 1 shards" in str(exc) and "uses 2" in str(exc), exc
        else:
            raise AssertionError("a consumer of another world size registered")
        register(d, "m2", 2, "kv_consumer")
        register(o, "m2", 1, "")  # a kv_both engine of another TP size shares only the cache
        register(o, "m3", 1, "kv_consumer")
        try:
            register(o, "m2", 1, "decoder")
        except InvalidArgumentError as exc:
            assert "role must be one of" in str(exc), exc
        else:
            raise AssertionError("an unknown role was accepted")
        assert d.exists_keys(["x/0"], model="m2") == 0  # the refusals left the client usable

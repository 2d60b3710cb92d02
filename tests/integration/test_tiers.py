"""L2 tiers behind a real server: disk restart, Redis shared by two servers, Redis outages,
corruption, all across separate processes (chunk names must be deterministic for any of it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import redis
from testkit.admin import status, written
from testkit.kv import CS, SHAPE, in_process, kv_for, retrieve_in_process, store_in_process
from testkit.servers import ServerProcess, free_port, start_redis
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.hashing import TokenHasher
from kvtier.keys import ObjectKey, compose


def test_disk_tier_serves_after_a_restart(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    disk = f"disk://{tmp_path}/l2?size=64MiB"
    tokens = list(range(8 * CS))
    first = server_factory("--chunk-size", str(CS), "--l1-size", "16MiB", "--l2", disk)
    assert in_process(store_in_process, first.address, tokens, 21) == 8 * CS
    assert wait_for(lambda: written(first, 8))
    assert first.stop() == 0
    second = server_factory("--chunk-size", str(CS), "--l1-size", "16MiB", "--l2", disk)
    assert status(second)["l1"]["groups"] == 0  # a new arena: nothing in L1
    hit, got, equal = in_process(retrieve_in_process, second.address, tokens, 21)
    assert (hit, got, equal) == (8 * CS, 8 * CS, True)
    st = status(second)
    assert st["l1"]["ready_groups"] == 8  # prefetched into L1 by the lookup
    assert st["l2"]["tiers"][0]["hits"] >= 8


def test_a_corrupted_disk_chunk_is_a_miss_deleted_and_counted(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    disk = f"disk://{tmp_path}/l2?size=64MiB"
    tokens = list(range(6 * CS))
    first = server_factory("--chunk-size", str(CS), "--l2", disk)
    assert in_process(store_in_process, first.address, tokens, 22) == 6 * CS
    assert wait_for(lambda: written(first, 6))
    first.stop()
    # flip one payload byte of chunk 3's file
    h3 = TokenHasher(CS).compute_chunk_hashes(tokens)[3]
    name = ObjectKey(compose("", "m"), compose("", ""), 1, 0, h3).to_str()
    path = next(p for p in (tmp_path / "l2").rglob("*") if p.name == name)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    second = server_factory("--chunk-size", str(CS), "--l2", disk)
    hit, got, equal = in_process(retrieve_in_process, second.address, tokens, 22)
    assert (hit, got, equal) == (3 * CS, 3 * CS, True)  # stops before the corrupted chunk
    assert status(second)["l2"]["tiers"][0]["corrupt"] == 1
    assert not path.exists()


def test_two_servers_share_one_redis(
    server_factory: Callable[..., ServerProcess], redis_url: str, redis_prefix: str
) -> None:
    tier = f"{redis_url}?prefix={redis_prefix}"
    a = server_factory("--chunk-size", str(CS), "--l2", tier)
    b = server_factory("--chunk-size", str(CS), "--l2", tier)
    tokens = list(range(5000, 5000 + 6 * CS))
    assert in_process(store_in_process, a.address, tokens, 23) == 6 * CS
    assert wait_for(lambda: written(a, 6))
    r = redis.Redis.from_url(redis_url)
    assert len(list(r.scan_iter(match=f"{redis_prefix}:*"))) == 6
    assert in_process(retrieve_in_process, b.address, tokens, 23) == (6 * CS, 6 * CS, True)


def test_server_keeps_serving_while_redis_is_down_and_recovers(
    server_factory: Callable[..., ServerProcess],
) -> None:
    port = free_port()
    redis_proc = start_redis(port)
    try:
        server = server_factory("--chunk-size", str(CS), "--l2", f"redis://127.0.0.1:{port}/0")
        with Client(server.address) as c:
            c.register(model="m", chunk_shape=SHAPE, dtype="float16")
            assert c.store("a", list(range(2 * CS)), kv_for(24, 2), model="m") == 2 * CS
            assert wait_for(lambda: written(server, 2))
            redis_proc.terminate()
            redis_proc.wait()
            # Redis is gone: stores and lookups keep working from L1
            tokens = list(range(100, 100 + 3 * CS))
            kv = kv_for(25, 3)
            assert c.store("b", tokens, kv, model="m") == 3 * CS
            assert c.lookup("b2", tokens, model="m") == 3 * CS
            assert c.lookup("miss", list(range(900, 900 + 2 * CS)), model="m") == 0
            out = np.zeros_like(kv)
            assert c.retrieve("b2", tokens, out, model="m") == 3 * CS
            assert np.array_equal(out, kv)
            assert wait_for(lambda: status(server)["l2"]["tiers"][0]["errors"] > 0)
            # Redis is back on the same port: the tier reconnects by itself
            redis_proc = start_redis(port)
            # past the tier's cool-down after the failures: healthy again, it writes once more
            assert wait_for(lambda: status(server)["l2"]["tiers"][0]["healthy"], timeout=20)
            tokens3 = list(range(400, 400 + 2 * CS))
            assert c.store("c", tokens3, kv_for(26, 2), model="m") == 2 * CS
            r = redis.Redis(port=port)
            assert wait_for(lambda: len(list(r.scan_iter(match="kvtier:*"))) == 2)
    finally:
        redis_proc.kill()
        redis_proc.wait()

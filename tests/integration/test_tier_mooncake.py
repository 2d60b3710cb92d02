"""The Mooncake tier behind real servers and a real mooncake_master: two kvtier servers on one
pool, the loss of the server whose segment holds the objects, a master killed and restarted,
and a pool too small for what is stored. The tier's contract (round trip, digests, clear,
stats) is in test_tier_contract.py."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from testkit.admin import admin_url, metric_samples, status, written
from testkit.kv import CS, kv_for
from testkit.mooncake_pool import MooncakeMaster
from testkit.servers import ServerProcess, free_port
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.storage.tiers import open_tier

pytestmark = pytest.mark.mooncake

BIG = (2, 2, CS, 8, 64)  # 64 KiB per chunk in float16


def _tier(server: ServerProcess) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = status(server)["l2"]["tiers"]
    return next(t for t in tiers if t["kind"] == "mooncake")


def _serve(factory: Callable[..., ServerProcess], url: str) -> ServerProcess:
    return factory("--chunk-size", str(CS), "--l1-size", "64MiB", "--l2", url)


def _store(server: ServerProcess, req: str, tokens: list[int], kv: np.ndarray) -> None:
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=kv.shape[1:], dtype="float16")
        assert c.store(req, tokens, kv, model="m") == len(tokens)


def _fetch(server: ServerProcess, req: str, tokens: list[int], kv: np.ndarray) -> int:
    """Look up and retrieve through `server`; the hit in tokens, after checking its bytes."""
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=kv.shape[1:], dtype="float16")
        hit = c.lookup(req, tokens, model="m")
        out = np.zeros_like(kv[: hit // CS])
        if hit:
            assert c.retrieve(req, tokens, out, model="m") == hit
        assert np.array_equal(out, kv[: hit // CS]), "bytes served that were never stored"
        return hit


def _prompt(n_chunks: int) -> list[int]:
    base = uuid.uuid4().int % 1_000_000 * 64
    return list(range(base, base + n_chunks * CS))


def test_a_handoff_crosses_two_servers_through_the_pool(
    server_factory: Callable[..., ServerProcess], private_mooncake: MooncakeMaster
) -> None:
    """Prefill on A, decode on B, one Mooncake pool: B reads the hand-off byte for byte, A's
    L1 pins are released once the pool holds it, and B's end deletes it from the pool."""
    a = _serve(server_factory, private_mooncake.url(segment="64MiB"))
    b = _serve(server_factory, private_mooncake.url(segment="0"))
    kv = kv_for(33, 3, BIG)
    names = [f"pd/{i}" for i in range(3)]

    def released() -> float:
        got = metric_samples(httpx.get(admin_url(a) + "/metrics", timeout=5).text)
        return got.get(("kvtier_handoff_chunks_total", (("event", "released"),)), 0.0)

    with Client(a.address) as producer, Client(b.address) as decoder:
        for c in (producer, decoder):
            c.register(model="m", chunk_shape=kv.shape[1:], dtype="float16")
        with producer.store_key_slots(
            names, model="m", chunk_shape=kv.shape[1:], dtype="float16", handoff="pd"
        ) as slots:
            for i, view in slots.targets():
                view[:] = kv[i].view(np.uint8).reshape(-1)
        assert wait_for(lambda: written(a, 3))
        assert wait_for(lambda: released() == 3)
        assert status(a)["l1"]["pinned_groups"] == 0
        assert decoder.exists_keys(names, model="m") == 3  # loaded from the pool into B's L1
        out = np.zeros_like(kv)
        assert decoder.get_keys(names, out, model="m") == 3
        assert out.tobytes() == kv.tobytes()
        decoder.end_handoff("pd", names, model="m")
    assert wait_for(lambda: private_mooncake.figures()["master_key_count"] == 0, timeout=5)


def test_two_servers_one_pool_what_one_stores_the_other_serves(
    server_factory: Callable[..., ServerProcess], private_mooncake: MooncakeMaster
) -> None:
    a = _serve(server_factory, private_mooncake.url(segment="64MiB"))
    b = _serve(server_factory, private_mooncake.url(segment="0"))
    tokens, kv = _prompt(12), kv_for(31, 12, BIG)
    _store(a, "w", tokens, kv)
    assert wait_for(lambda: written(a, 12))
    assert private_mooncake.figures()["master_key_count"] == 12
    assert _fetch(b, "r", tokens, kv) == 12 * CS
    st = _tier(b)
    assert st["hits"] == 12 and st["errors"] == 0 and st["corrupt"] == 0
    # the arena is registered: payloads moved in place, none through the staging buffer
    assert st["extra"]["staged"] == 0 and _tier(a)["extra"]["staged"] == 0
    # and the other way: b (no segment of its own) stores into a's, a serves it
    tokens2, kv2 = _prompt(5), kv_for(32, 5, BIG)
    _store(b, "w2", tokens2, kv2)
    assert wait_for(lambda: written(b, 5))
    assert _fetch(a, "r2", tokens2, kv2) == 5 * CS


def test_kill_9_of_the_segment_holder_is_a_miss_on_the_other(
    server_factory: Callable[..., ServerProcess], private_mooncake: MooncakeMaster
) -> None:
    holder = _serve(server_factory, private_mooncake.url(segment="64MiB"))
    reader = _serve(server_factory, private_mooncake.url(segment="0", timeout="0.5"))
    first, kv1 = _prompt(6), kv_for(33, 6, BIG)
    second, kv2 = _prompt(6), kv_for(34, 6, BIG)
    _store(holder, "w1", first, kv1)
    _store(holder, "w2", second, kv2)
    assert wait_for(lambda: written(holder, 12))
    assert _fetch(reader, "r1", first, kv1) == 6 * CS  # served while the holder lives
    holder.stop(signal.SIGKILL)
    t0 = time.monotonic()
    assert _fetch(reader, "r2", second, kv2) == 0  # its segment is gone: a miss, no error
    assert time.monotonic() - t0 < 5
    assert wait_for(lambda: private_mooncake.figures()["master_key_count"] == 0)
    assert _fetch(reader, "r3", second, kv2) == 0
    assert _fetch(reader, "r4", first, kv1) == 6 * CS  # still in the reader's own L1
    assert _tier(reader)["corrupt"] == 0


def test_master_killed_and_restarted_misses_then_hits_without_a_stall(
    server_factory: Callable[..., ServerProcess], private_mooncake: MooncakeMaster
) -> None:
    opts = {"timeout": "0.5", "cooldown": "0.5"}
    writer = _serve(server_factory, private_mooncake.url(segment="64MiB", **opts))
    reader = _serve(server_factory, private_mooncake.url(segment="0", **opts))
    before, kv0 = _prompt(4), kv_for(35, 4, BIG)
    _store(writer, "w0", before, kv0)
    assert wait_for(lambda: written(writer, 4))
    private_mooncake.kill()
    during, kv1 = _prompt(4), kv_for(36, 4, BIG)
    t0 = time.monotonic()
    _store(writer, "w1", during, kv1)  # L1 takes it; the write-through fails, counted
    assert _fetch(reader, "r0", before, kv0) == 0  # the pool is unreachable: a miss
    assert _fetch(reader, "r1", during, kv1) == 0
    assert time.monotonic() - t0 < 5, "a dead master stalled the clients"
    assert wait_for(lambda: written(writer, 8))
    assert wait_for(lambda: _tier(reader)["errors"] > 0 or _tier(reader)["extra"]["late"] > 0)
    private_mooncake.start()  # the same ports; every object of the old master is gone
    stored: list[tuple[list[int], np.ndarray]] = []

    def reached_the_master() -> bool:  # the clients re-register by themselves
        attempt = len(stored) + 1  # each attempt stores a new prompt
        stored.append((_prompt(4), kv_for(37 + attempt, 4, BIG)))
        _store(writer, f"w2-{attempt}", *stored[-1])
        assert wait_for(lambda: written(writer, 8 + 4 * attempt))
        return bool(private_mooncake.figures().get("master_key_count", 0) >= 4)

    if not wait_for(reached_the_master, timeout=30, interval=0.2):
        pytest.fail(f"no object reached the restarted master: {_tier(writer)}")
    after, kv2 = stored[-1]
    assert wait_for(lambda: _fetch(reader, f"r2-{time.monotonic()}", after, kv2) == 4 * CS)
    assert _tier(reader)["corrupt"] == 0


def test_a_stalled_master_costs_the_timeout_not_mooncakes_30_s(
    server_factory: Callable[..., ServerProcess], private_mooncake: MooncakeMaster
) -> None:
    opts = {"timeout": "0.5", "cooldown": "0.5"}
    writer = _serve(server_factory, private_mooncake.url(segment="64MiB", **opts))
    reader = _serve(server_factory, private_mooncake.url(segment="0", **opts))
    stored, kv0 = _prompt(4), kv_for(60, 4, BIG)
    _store(writer, "w0", stored, kv0)
    assert wait_for(lambda: written(writer, 4))
    private_mooncake.pause()  # takes connections, answers nothing (a call would wait 30 s)
    try:
        t0 = time.monotonic()
        assert _fetch(reader, "r0", stored, kv0) == 0  # the pool does not answer: a miss
        fresh, kv1 = _prompt(4), kv_for(61, 4, BIG)
        _store(writer, "w1", fresh, kv1)  # L1 takes it at once
        assert _fetch(writer, "r1", fresh, kv1) == 4 * CS  # served from the writer's L1
        assert time.monotonic() - t0 < 5, "a stalled master stalled the clients"
        assert wait_for(lambda: _tier(reader)["extra"]["late"] > 0)
    finally:
        private_mooncake.resume()
    # answered again: the cool-down ends and the pool serves what it holds
    assert wait_for(lambda: _fetch(reader, f"r2-{time.monotonic()}", stored, kv0) == 4 * CS, 40)
    assert _tier(reader)["corrupt"] == 0


def test_a_full_pool_keeps_storing_and_evicted_chunks_are_misses(
    server_factory: Callable[..., ServerProcess], private_mooncake: MooncakeMaster
) -> None:
    writer = _serve(server_factory, private_mooncake.url(segment="16MiB"))
    reader = _serve(server_factory, private_mooncake.url(segment="0"))
    huge = (2, 2, CS, 16, 128)  # 256 KiB per chunk: 4 prompts of 8 MiB into a 16 MiB pool
    prompts = [(_prompt(32), kv_for(40 + i, 32, huge)) for i in range(4)]
    for i, (tokens, kv) in enumerate(prompts):
        _store(writer, f"w{i}", tokens, kv)
    assert wait_for(lambda: written(writer, 128))
    st = _tier(writer)
    assert st["errors"] == 0 and st["puts"] + st["extra"]["pool_full"] == 128
    hits = [_fetch(reader, f"r{i}", tokens, kv) for i, (tokens, kv) in enumerate(prompts)]
    assert sum(hits) < 128 * CS  # what was evicted is a miss; what hits is byte-exact
    assert _tier(reader)["corrupt"] == 0
    assert private_mooncake.figures()["master_allocated_bytes"] <= 16 << 20
    # stores go on: the pool takes later puts and evicts (at times a new object at once, so
    # a later prompt may be served in part); what is served is byte-exact
    puts = _tier(writer)["puts"]
    served = []
    for attempt in range(5):
        later, kv = _prompt(4), kv_for(50 + attempt, 4, huge)
        _store(writer, f"w-later-{attempt}", later, kv)
        assert wait_for(lambda n=132 + 4 * attempt: written(writer, n))
        served.append(_fetch(reader, f"r-later-{attempt}", later, kv))
    assert _tier(writer)["puts"] > puts and any(served), f"{served}: {_tier(writer)}"
    assert _tier(reader)["corrupt"] == 0 and _tier(writer)["errors"] == 0


def test_bad_options_are_one_line_errors_naming_the_option(
    mooncake_master: MooncakeMaster,
) -> None:
    for url, message in [
        (mooncake_master.url(protocol="udp"), "protocol must be one of"),
        (mooncake_master.url(segment="lots"), "bad Mooncake tier URL option segment='lots'"),
        (mooncake_master.url(segment="1MiB"), "segment must be 0 or at least 16MiB"),
        (mooncake_master.url(buffer="1KiB"), "buffer at least 1MiB, got .*buffer=1024"),
        (mooncake_master.url(timeout="0"), "timeout must be > 0"),
        (mooncake_master.url(prefix="a/b"), "prefix must be letters"),
        (mooncake_master.url(colour="red"), r"unknown Mooncake tier URL options \['colour'\]"),
        ("mooncake://127.0.0.1:notaport/", "bad master port"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            open_tier(url)
        assert "\n" not in str(info.value)


def test_no_master_at_start_is_a_one_line_error_within_seconds() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"cannot join the Mooncake pool.*:{port}") as info:
        open_tier(f"mooncake://127.0.0.1:{port}/?host=127.0.0.1&segment=0")
    assert "\n" not in str(info.value) and time.monotonic() - t0 < 15

"""The server end to end: real server process, real client processes, real shared memory."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pwd
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from testkit.admin import status
from testkit.kv import CS, SHAPE, kv_for
from testkit.raw_peer import RawPeer
from testkit.servers import ServerProcess
from testkit.waiting import wait_for

from kvtier import protocol as p
from kvtier.client import Client
from kvtier.errors import (
    BadArrayError,
    ErrorCode,
    HashContractError,
    InvalidArgumentError,
    KVTierError,
    LayoutMismatchError,
    MisalignedRangeError,
    NoSpaceError,
    NotConnectedError,
    NotRegisteredError,
    UnknownSessionError,
)
from kvtier.hashing import TokenHasher

# -- processes: a scheduler and TP workers --------------------------------------------------------


def _worker(address: str, rank: int, tokens: list[int], store: bool, queue: Any) -> None:
    """A TP worker: registers its shard layout, stores or retrieves-and-checks its shard."""
    try:
        with Client(address, timeout=10) as c:
            c.register(model="m", world_size=2, worker_id=rank, chunk_shape=SHAPE, dtype="float16")
            n = len(tokens) // CS
            expected = kv_for(100 + rank, n)
            if store:
                queue.put(
                    ("stored", rank, c.store("req", tokens, expected, model="m", worker_id=rank))
                )
            else:
                out = np.zeros_like(expected)
                got = c.retrieve("req2", tokens, out, model="m", worker_id=rank)
                queue.put(("retrieved", rank, got, bool(np.array_equal(out, expected))))
    except Exception as exc:  # report to the parent instead of dying silently
        queue.put(("error", rank, repr(exc)))


def _run_workers(address: str, tokens: list[int], store: bool, ranks: list[int]) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(address, r, tokens, store, queue)) for r in ranks]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(30)
    return sorted(results, key=lambda r: r[1])


def test_tp2_round_trip_across_processes(server: ServerProcess) -> None:
    tokens = list(range(5 * CS + 3))  # 5 full chunks and a partial one (never stored)
    with Client(server.address) as scheduler:
        assert scheduler.lookup("req", tokens, model="m", world_size=2) == 0
        # rank 0 alone: its shards are ready but the chunk group is not complete -> no hit
        assert _run_workers(server.address, tokens, True, [0]) == [("stored", 0, 5 * CS)]
        assert scheduler.lookup("req", tokens, model="m", world_size=2) == 0
        assert _run_workers(server.address, tokens, True, [1]) == [("stored", 1, 5 * CS)]
        assert scheduler.lookup("req2", tokens, model="m", world_size=2) == 5 * CS
        # a world_size=1 view of the same model is a different name space
        assert scheduler.lookup("req3", tokens, model="m", world_size=1) == 0
        results = _run_workers(server.address, tokens, False, [0, 1])
        assert results == [("retrieved", 0, 5 * CS, True), ("retrieved", 1, 5 * CS, True)]
        # each rank retrieved: the lookup's pins are gone
        assert wait_for(lambda: status(server)["l1"]["pinned_groups"] == 0)


def test_inline_and_shared_memory_paths_agree(server: ServerProcess) -> None:
    tokens = np.arange(1000, 1000 + 4 * CS, dtype=np.int64)
    kv = kv_for(1, 4)
    with Client(server.address) as shm, Client(server.address, transfer="inline") as inline:
        assert shm.transfer == "shm" and inline.transfer == "inline"
        for c in (shm, inline):
            c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert inline.store("a", tokens, kv, model="m") == 4 * CS
        out = np.zeros_like(kv)
        assert shm.retrieve("b", tokens.astype("<u4").tobytes(), out, model="m") == 4 * CS
        assert np.array_equal(out, kv)
        kv2 = kv_for(2, 4)
        tokens2 = list(range(50_000, 50_000 + 4 * CS))
        assert shm.store("c", tokens2, kv2, model="m") == 4 * CS
        out2 = np.zeros_like(kv2)
        assert inline.retrieve("d", tokens2, out2, model="m") == 4 * CS
        assert np.array_equal(out2, kv2)


def test_store_is_idempotent_and_retrieve_stops_at_first_missing_chunk(
    server: ServerProcess,
) -> None:
    tokens = list(range(6 * CS))
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        kv = kv_for(3, 6)
        assert c.store("r", tokens, kv[:3], model="m") == 3 * CS
        assert c.store("r", tokens, kv[:3], model="m") == 3 * CS  # already there: no-op
        out = np.zeros_like(kv)
        assert c.retrieve("r", tokens, out, model="m") == 3 * CS
        assert np.array_equal(out[:3], kv[:3]) and not out[3:].any()
        assert c.store("r", tokens, kv[3:], model="m", start=3 * CS) == 3 * CS
        assert c.lookup("r", tokens, model="m") == 6 * CS


def test_an_explicit_range_may_use_the_leading_rows_of_a_larger_array(
    server: ServerProcess,
) -> None:
    tokens = list(range(5 * CS + 7))
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.lookup("r", tokens, model="m") == 0
        empty = np.zeros((0, *SHAPE), np.float16)
        assert c.retrieve("r", tokens, empty, model="m", end=0) == 0  # a miss: nothing to copy
        kv = kv_for(12, 5)
        assert c.store("r", tokens, kv, model="m", start=0) == 5 * CS
        hit = c.lookup("r2", tokens, model="m")
        out = np.zeros_like(kv)  # sized for the whole prompt
        assert c.retrieve("r2", tokens, out[:0], model="m", end=0) == 0
        assert c.retrieve("r2", tokens, out, model="m", start=0, end=hit - 2 * CS) == 3 * CS
        assert np.array_equal(out[:3], kv[:3]) and not out[3:].any()
        with pytest.raises(BadArrayError, match="chunks"):
            c.retrieve("r2", tokens, out[:2], model="m", end=3 * CS)  # too small: refused


def test_torch_tensors_round_trip(server: ServerProcess) -> None:
    import torch  # installed by `make test` (the transformers extra); never skipped

    tokens = list(range(3 * CS))
    with Client(server.address) as c:
        c.register(model="t", chunk_shape=SHAPE, dtype="bfloat16")
        kv = torch.randn(3, *SHAPE, dtype=torch.bfloat16)
        assert c.store("r", tokens, kv, model="t") == 3 * CS
        out = torch.zeros_like(kv)
        assert c.retrieve("r2", tokens, out, model="t") == 3 * CS
        assert torch.equal(out, kv)


def test_tenant_isolation_by_cache_salt(server: ServerProcess) -> None:
    tokens = list(range(4 * CS))
    kv = kv_for(4, 4)
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.store("a", tokens, kv, model="m", cache_salt="tenant-a")
        assert c.lookup("x", tokens, model="m", cache_salt="tenant-a") == 4 * CS
        assert c.lookup("y", tokens, model="m", cache_salt="tenant-b") == 0
        assert c.lookup("z", tokens, model="m") == 0
        out = np.zeros_like(kv)
        assert c.retrieve("y", tokens, out, model="m", cache_salt="tenant-b") == 0
        assert not out.any()


# -- eviction and pins ----------------------------------------------------------------------------

BIG = (64, 256)  # 64 KiB per chunk in float32


def test_eviction_is_lru_and_capacity_is_hard(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS))
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=BIG, dtype="float32")
        seqs = [list(range(i * 1000, i * 1000 + CS)) for i in range(40)]
        for i, tokens in enumerate(seqs[:12]):
            c.store(f"s{i}", tokens, np.full((1, *BIG), i, np.float32), model="m")
            c.end_session(f"s{i}")
        # touch sequence 0 so it becomes the most recently used
        assert c.lookup("t", seqs[0], model="m") == CS
        c.end_session("t")
        for i, tokens in enumerate(seqs[12:24], start=12):
            c.store(f"s{i}", tokens, np.full((1, *BIG), i, np.float32), model="m")
            c.end_session(f"s{i}")
        l1 = status(server)["l1"]
        assert l1["used_bytes"] <= l1["capacity_bytes"] == 1024 * 1024
        assert l1["evictions"] > 0
        hits = [c.lookup(f"h{i}", seqs[i], model="m") for i in range(24)]
        assert hits[0] == CS  # touched: survived
        assert hits[1] == 0  # least recently used: evicted first
        assert hits[23] == CS  # newest
        out = np.zeros((1, *BIG), np.float32)
        assert c.retrieve("h23", seqs[23], out, model="m") == CS
        assert (out == 23).all()


def test_eviction_prefers_the_tail_of_a_chain(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS))
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=BIG, dtype="float32")
        chain = list(range(10 * CS))
        c.store("chain", chain, np.zeros((10, *BIG), np.float32), model="m")
        c.end_session("chain")
        # 6 more chunks force 2+ evictions from a 16-chunk L1 holding 10 + 6 + extra
        for i in range(8):
            c.store(f"o{i}", list(range(10**6 + i * CS, 10**6 + (i + 1) * CS)),
                    np.zeros((1, *BIG), np.float32), model="m")  # fmt: skip
            c.end_session(f"o{i}")
        hit = c.lookup("chain2", chain, model="m")
        # the head of the chain survives; what was evicted came off its tail
        assert 0 < hit < 10 * CS


def test_pins_survive_eviction_pressure(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS))
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=BIG, dtype="float32")
        pinned_tokens = list(range(4 * CS))
        kv = np.random.default_rng(5).standard_normal((4, *BIG)).astype(np.float32)
        c.store("writer", pinned_tokens, kv, model="m")
        c.end_session("writer")
        assert c.lookup("reader", pinned_tokens, model="m") == 4 * CS  # pins 4 chunks
        refused = 0
        for i in range(40):  # far more than fits: everything unpinned gets evicted
            try:
                c.store(f"p{i}", list(range(10**6 + i * CS, 10**6 + (i + 1) * CS)),
                        np.zeros((1, *BIG), np.float32), model="m")  # fmt: skip
            except NoSpaceError:
                refused += 1
            c.end_session(f"p{i}")
        assert refused == 0  # 12 free slots keep cycling
        # a store larger than all unpinned room is refused with a typed error, not a crash
        with pytest.raises(NoSpaceError, match="l1-size"):
            c.store("huge", list(range(7 * 10**6, 7 * 10**6 + 14 * CS)),
                    np.zeros((14, *BIG), np.float32), model="m")  # fmt: skip
        out = np.zeros_like(kv)
        assert c.retrieve("reader", pinned_tokens, out, model="m") == 4 * CS
        assert np.array_equal(out, kv)
        # every rank (here: one) retrieved, so the pins are gone: the store now fits
        assert status(server)["l1"]["pinned_groups"] == 0
        assert c.store("huge", list(range(7 * 10**6, 7 * 10**6 + 14 * CS)),
                       np.zeros((14, *BIG), np.float32), model="m") == 14 * CS  # fmt: skip


def test_pins_are_released_by_release_end_session_and_expiry(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory(
        "--chunk-size", str(CS), "--l1-size", "16MiB", "--session-ttl", "1",
        "--session-cleanup-interval", "0.2",
    )  # fmt: skip
    tokens = list(range(3 * CS))
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.store("w", tokens, kv_for(6, 3), model="m")
        c.end_session("w")
        assert c.lookup("a", tokens, model="m") == 3 * CS
        assert status(server)["l1"]["pinned_groups"] == 3
        c.release("a")
        assert status(server)["l1"]["pinned_groups"] == 0
        assert c.lookup("b", tokens, model="m") == 3 * CS
        c.end_session("b")
        assert status(server)["l1"]["pinned_groups"] == 0
        assert c.lookup("abandoned", tokens, model="m") == 3 * CS
        assert wait_for(lambda: status(server)["l1"]["pinned_groups"] == 0, timeout=10)
        sessions = status(server)["sessions"]
        assert sessions["orphaned"] >= 1


# -- crashes --------------------------------------------------------------------------------------


def _die_mid_store(address: str, ready: Any) -> None:
    c = Client(address, timeout=10)
    c.register(model="m", chunk_shape=SHAPE, dtype="float16")
    tokens = np.arange(7000, 7000 + 4 * CS, dtype="<u4").tobytes()
    reply, _ = c.connection.call(
        p.Reserve("dying", tokens, "m", 1, 0, 0, 4 * CS, list(SHAPE), "float16", 4, "")
    )
    assert isinstance(reply, p.ReserveReply)
    arena = c.arena_bytes
    assert arena is not None
    arena[reply.offsets[0] : reply.offsets[0] + reply.chunk_nbytes // 2] = 7  # half a chunk
    ready.set()
    time.sleep(600)  # on purpose, not a synchronization: a worker that hangs until killed


def test_worker_killed_mid_store_leaves_nothing_visible(server: ServerProcess) -> None:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_die_mid_store, args=(server.address, ready))
    proc.start()
    assert ready.wait(30)
    assert status(server)["l1"]["staging_shards"] == 4
    os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]  # started: pid is set
    proc.join()
    tokens = list(range(7000, 7000 + 4 * CS))
    with Client(server.address) as c:
        assert c.lookup("x", tokens, model="m") == 0  # no partial chunk is visible
        # the server reclaims the dead client's staging slots once its heartbeats stop (3 s)
        assert wait_for(lambda: status(server)["l1"]["staging_shards"] == 0, timeout=20)
        assert status(server)["l1"]["used_bytes"] == 0
        kv = kv_for(7, 4)
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.store("y", tokens, kv, model="m") == 4 * CS
        out = np.zeros_like(kv)
        assert c.retrieve("z", tokens, out, model="m") == 4 * CS
        assert np.array_equal(out, kv)


def test_ctrl_c_stops_cleanly_and_a_stale_segment_does_not_block_a_restart(
    server_factory: Callable[..., ServerProcess],
) -> None:
    first = server_factory("--l1-size", "8MiB")
    line = next(ln for ln in first.log if ln.startswith("kvtier: L1 "))
    segment = line.split("/dev/shm/")[1].split(";")[0]
    assert os.stat(f"/dev/shm/{segment}").st_mode & 0o777 == 0o600
    assert first.stop(signal.SIGINT) == 0
    assert not os.path.exists(f"/dev/shm/{segment}")
    crashed = server_factory("--l1-size", "8MiB", address=first.address)
    crashed.stop(signal.SIGKILL)
    assert os.path.exists(f"/dev/shm/{segment}")  # left behind by the crash
    again = server_factory("--l1-size", "8MiB", address=first.address)
    with Client(again.address) as c:
        assert c.lookup("r", list(range(256)), model="m") == 0
    assert again.stop() == 0


def test_a_client_rejoins_a_restarted_server_by_itself(
    server_factory: Callable[..., ServerProcess],
) -> None:
    first = server_factory("--chunk-size", str(CS), "--l1-size", "8MiB")
    with Client(first.address, timeout=10) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.store("a", list(range(2 * CS)), kv_for(13, 2), model="m") == 2 * CS
        old_server = c.server.server_id
        assert first.stop() == 0
        second = server_factory("--chunk-size", str(CS), "--l1-size", "8MiB", address=first.address)
        # no register() again: the client re-joins, maps the new arena, replays its layout
        tokens = list(range(500, 500 + 3 * CS))
        kv = kv_for(14, 3)
        assert c.store("b", tokens, kv, model="m") == 3 * CS
        assert c.server.server_id != old_server
        assert c.lookup("b2", tokens, model="m") == 3 * CS
        out = np.zeros_like(kv)
        assert c.retrieve("b2", tokens, out, model="m") == 3 * CS
        assert np.array_equal(out, kv)
        assert status(second)["l1"]["ready_groups"] == 3  # the bytes are in the NEW arena


def test_a_dead_server_fails_fast_until_it_answers_again(
    server_factory: Callable[..., ServerProcess],
) -> None:
    first = server_factory("--chunk-size", str(CS), "--l1-size", "8MiB")
    tokens = list(range(3 * CS))
    with Client(first.address, timeout=1, heartbeat_interval=0.2) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        first.stop(signal.SIGKILL)  # a crash, not a clean stop
        with pytest.raises(NotConnectedError):
            c.lookup("r", tokens, model="m")  # a timeout (or already failing fast)
        with pytest.raises(NotConnectedError, match="failing fast"):
            c.lookup("r", tokens, model="m")
        server_factory("--chunk-size", str(CS), "--l1-size", "8MiB", address=first.address)

        def answers() -> bool:
            try:
                c.lookup("r", tokens, model="m")
            except NotConnectedError:
                return False
            return True

        assert wait_for(answers, timeout=20)  # a heartbeat got through; the client re-joined
        assert c.store("r", tokens, kv_for(15, 3), model="m") == 3 * CS


def test_tcp_address_serves_inline_clients(server_factory: Callable[..., ServerProcess]) -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as s:
        port = s.bind_to_random_port("tcp://127.0.0.1")
        s.unbind(s.getsockopt_string(zmq.LAST_ENDPOINT))
    server = server_factory("--chunk-size", str(CS), address=f"tcp://127.0.0.1:{port}")
    tokens = list(range(2 * CS))
    kv = kv_for(8, 2)
    with Client(server.address, transfer="inline") as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.store("r", tokens, kv, model="m") == 2 * CS
        out = np.zeros_like(kv)
        assert c.retrieve("r", tokens, out, model="m") == 2 * CS
        assert np.array_equal(out, kv)


# -- errors ---------------------------------------------------------------------------------------


def test_every_error_code_reaches_a_real_client(server: ServerProcess) -> None:
    raw = RawPeer(server.address)
    seen: set[int] = set()
    try:
        seen.add(raw.error(b"s", b"\xc1garbage"))
        seen.add(raw.error(b"s", msgspec.msgpack.encode(["Teleport", 1, 2])))
        seen.add(raw.error(b"s", p.encode(p.Lookup("r", b"", "m"))))  # before Hello
        seen.add(raw.error(b"s", p.encode(p.Hello(99, "raw"))))
        raw.hello()
        seen.add(raw.error(b"s", p.encode(p.Commit(424242))))
    finally:
        raw.close()
    assert seen == {
        ErrorCode.MALFORMED_FRAME,
        ErrorCode.UNKNOWN_REQUEST,
        ErrorCode.NOT_CONNECTED,
        ErrorCode.PROTOCOL_VERSION,
        ErrorCode.UNKNOWN_RESERVATION,
    }
    with pytest.raises(HashContractError, match="chunk_size"):
        Client(server.address, hasher=TokenHasher(chunk_size=32))
    Client(server.address, hasher=TokenHasher(chunk_size=CS)).close()  # same settings: fine
    tokens = list(range(4 * CS))
    kv = kv_for(9, 2)
    with Client(server.address) as c:
        with pytest.raises(NotRegisteredError, match="register"):
            c.store("r", tokens, kv, model="nobody")
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.store("keep", tokens[: 2 * CS], kv, model="m")
        with pytest.raises(LayoutMismatchError):
            c.register(model="m", chunk_shape=(2, 2, CS, 4, 16), dtype="float16")
        with pytest.raises(InvalidArgumentError):
            c.register(model="m2", world_size=2, worker_id=2, chunk_shape=SHAPE, dtype="float16")
        with pytest.raises(MisalignedRangeError, match="16"):
            c.store("r", tokens, kv, model="m", start=5)
        with pytest.raises(MisalignedRangeError, match="past"):
            c.store("r", tokens, kv_for(9, 6), model="m")  # 6 chunks but 4 chunks of tokens
        with pytest.raises(BadArrayError, match="float16"):
            c.store("r", tokens, kv.astype(np.float32), model="m")
        with pytest.raises(BadArrayError):
            c.store("r", tokens, kv_for(9, 2, (2, 2, CS, 4, 4)), model="m")
        with pytest.raises(BadArrayError, match="chunks"):
            c.store("r", tokens, kv, model="m", end=3 * CS)
        with pytest.raises(UnknownSessionError):
            c.end_session("never-was")
        with pytest.raises(NoSpaceError):
            big = np.zeros((1, 9000, 4096), np.float16)  # 72 MiB > the 64 MiB L1
            c.register(model="big", chunk_shape=big.shape[1:], dtype="float16")
            c.store("big", tokens[:CS], big, model="big")
        # nothing stored was lost or corrupted by all of that
        out = np.zeros_like(kv)
        assert c.retrieve("check", tokens, out, model="m") == 2 * CS
        assert np.array_equal(out, kv)
    with pytest.raises(NotConnectedError, match="running"):
        Client("ipc:///tmp/kvtier-nobody-listens.sock", timeout=0.5)


def test_fuzzed_frames_get_one_reply_each_and_leave_data_intact(server: ServerProcess) -> None:
    tokens = list(range(3 * CS))
    kv = kv_for(10, 3)
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.store("keep", tokens, kv, model="m")
    rng = random.Random(1234)
    valid = [
        p.encode(p.Lookup("f", bytes(range(64)), "m")),
        p.encode(p.Reserve("f", b"\x00" * 64, "m", 1, 0, 0, CS, list(SHAPE), "float16", 1)),
        p.encode(p.Retrieve("f", b"\x01" * 64, "m", 1, 0, 0, CS, list(SHAPE), "float16", 1)),
        p.encode(p.Commit(1)),
        p.encode(p.Register("m", 1, 0, list(SHAPE), "float16")),
        p.encode(p.Hello(p.PROTOCOL_VERSION, "fuzz")),
    ]

    def frame() -> list[bytes]:
        kind = rng.randrange(6)
        if kind == 0:  # random bytes
            return [b"seq", rng.randbytes(rng.randrange(0, 200))]
        if kind == 1:  # a truncated valid message
            msg = rng.choice(valid)
            return [b"seq", msg[: rng.randrange(0, len(msg))]]
        if kind == 2:  # a valid message with a flipped byte
            flipped = bytearray(rng.choice(valid))
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            return [b"seq", bytes(flipped)]
        if kind == 3:  # random msgpack structures, some with real tags
            tag = rng.choice(["Lookup", "Reserve", "Retrieve", "Hello", "Nope", 7])
            body = [tag, *[rng.choice([1, -1, "x", b"y", None, [1], {"a": 1}]) for _ in range(5)]]
            return [b"seq", msgspec.msgpack.encode(body)]
        if kind == 4:  # wrong frame counts
            return [rng.randbytes(3)] if rng.random() < 0.5 else [b"s", valid[0], b"p", b"q"]
        return [b"seq", rng.choice(valid)]  # valid, in any order

    peers = [RawPeer(server.address) for _ in range(4)]
    try:
        for peer in peers[:2]:
            peer.hello()
        sent = 0
        for i in range(3000):
            peer = peers[i % 4]
            peer.sock.send_multipart(frame())
            sent += 1
        replies = 0
        for peer in peers:
            while peer.sock.poll(2000):
                peer.sock.recv_multipart()
                replies += 1
        assert replies == sent  # exactly one reply per request
    finally:
        for peer in peers:
            peer.close()
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        out = np.zeros_like(kv)
        assert c.retrieve("after", tokens, out, model="m") == 3 * CS
        assert np.array_equal(out, kv)


def test_a_client_error_does_not_disturb_other_clients(server: ServerProcess) -> None:
    tokens = list(range(2 * CS))
    with Client(server.address) as good, Client(server.address) as bad:
        good.register(model="m", chunk_shape=SHAPE, dtype="float16")
        for _ in range(20):
            with pytest.raises(KVTierError):
                bad.store("x", tokens, np.zeros(3), model="m")
        assert good.store("g", tokens, kv_for(11, 2), model="m") == 2 * CS


# -- start-up failures ---------------------------------------------------------------------------


def _serve_argv(*args: str) -> list[str]:
    address = f"ipc:///tmp/kvtier-test-{os.getpid()}-{os.urandom(4).hex()}.sock"
    return [sys.executable, "-m", "kvtier.cli", "serve", "--address", address,
            "--admin-port", "-1", *args]  # fmt: skip


def _unwritable_folder(tmp_path: Path) -> tuple[Path, list[str]]:
    """An existing folder this process cannot write, and the argv prefix that runs a command
    where it is so: root writes everywhere, so as root the folder is a read-only bind mount in
    a mount namespace of the command's own (`unshare -m`); otherwise plain mode 0555."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return folder, []
    unshare = shutil.which("unshare")
    assert unshare, "unshare (util-linux) is needed to make a read-only folder for root"
    script = f'mount --bind -o ro "{folder}" "{folder}" && exec "$@"'
    return folder, [unshare, "-m", "sh", "-c", script, "sh"]


def _shm_free() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


START_FAILURES = [
    "l1-beyond-shm",
    "no-tokens-file",
    "bad-tokens-file",
    "uncreatable-folder",
    "unwritable-folder",
    "no-socket-folder",
    "no-handler-threads",
]


@pytest.mark.parametrize("case", START_FAILURES)
def test_a_start_up_failure_is_one_line_naming_the_option_and_exit_2(
    case: str, tmp_path: Path
) -> None:
    prefix: list[str] = []
    if case == "l1-beyond-shm":
        args, option = ["--l1-size", f"{_shm_free() // 2**30 + 8}GiB", "--l2", "none"], "--l1-size"
    elif case == "no-tokens-file":
        missing = tmp_path / "no-such-tokens"
        args, option = ["--auth-tokens-file", str(missing), "--l2", "none"], "--auth-tokens-file"
    elif case == "bad-tokens-file":
        bad = tmp_path / "tokens"
        bad.write_text("short tenant\n")
        args, option = ["--auth-tokens-file", str(bad), "--l2", "none"], "--auth-tokens-file"
    elif case == "uncreatable-folder":
        folder, prefix = _unwritable_folder(tmp_path)
        args, option = ["--l2", f"disk://{folder}/l2"], "--l2"
    elif case == "unwritable-folder":
        folder, prefix = _unwritable_folder(tmp_path)
        args, option = ["--l2", f"disk://{folder}"], "--l2"
    elif case == "no-handler-threads":  # 0 would start a server that never answers a request
        args, option = ["--handler-threads", "0", "--l2", "none"], "--handler-threads"
    else:
        args, option = ["--l2", "none"], "--address"
    argv = _serve_argv(*args)
    if case == "no-socket-folder":
        argv[argv.index("--address") + 1] = f"ipc://{tmp_path}/missing/kvtier.sock"
    out = subprocess.run(
        [*prefix, *argv], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    # A warning logged on the way (a dead server's segment removed) is not the failure's line.
    logged = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (INFO|WARNING) ")
    lines = [ln for ln in (out.stdout + out.stderr).strip().splitlines() if not logged.match(ln)]
    assert out.returncode == 2, (out.returncode, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kvtier serve: {option}"), lines
    assert "Traceback" not in lines[0] and "Errno" not in lines[0], lines
    if case.endswith("folder") and case != "no-socket-folder":
        assert str(tmp_path / "read-only") in lines[0]


def _own_segments() -> set[str]:
    prefix = f"kvtier-{os.getuid()}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def test_sigterm_while_the_arena_is_being_sized_leaves_nothing_in_dev_shm() -> None:
    """The signal lands while the segment is still `<name>.<pid>.<hex>.tmp` (polled for)."""
    size_gib = 2 if _shm_free() > 6 * 2**30 else 1
    argv = _serve_argv("--l1-size", f"{size_gib}GiB", "--l2", "none")
    from kvtier.storage.arena import default_arena_name

    name = default_arena_name(argv[argv.index("--address") + 1])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def temporary() -> bool:
        return any(n.startswith(name) and n.endswith(".tmp") for n in os.listdir("/dev/shm"))

    # a tight poll: the temporary segment exists only briefly
    seen = wait_for(lambda: temporary() or proc.poll() is not None, timeout=60, interval=0.002)
    seen = seen and proc.poll() is None
    if seen:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    left = [n for n in os.listdir("/dev/shm") if n.startswith(name)]
    for n in left:
        os.unlink(f"/dev/shm/{n}")
    assert seen, f"the temporary segment never appeared: {out}"
    assert left == [], out
    assert proc.returncode == 0, out
    assert "stopped by SIGTERM during start-up" in out


def test_a_start_removes_what_dead_servers_left_but_never_a_live_servers_segment(
    server_factory: Callable[..., ServerProcess],
) -> None:
    live = server_factory("--l1-size", "8MiB", "--chunk-size", str(CS))
    live_segment = next(n for n in _own_segments() if n.endswith(live_name(live)))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    prefix = f"/dev/shm/kvtier-{os.getuid()}-"
    stale = [f"{prefix}00deadbeef00", f"{prefix}00deadbeef01.{dead.pid}.0badc0de.tmp"]
    for path in stale:
        with open(path, "wb") as f:
            f.truncate(1 << 20)
    try:
        server_factory("--l1-size", "8MiB")
        assert [p for p in stale if os.path.exists(p)] == []
        assert live_segment in _own_segments()
        with Client(live.address) as c:  # the live server still serves from its arena
            c.register(model="m", chunk_shape=SHAPE, dtype="float16")
            tokens = list(range(CS * 2))
            c.store("r", tokens, kv_for(1, 2), model="m")
            out = np.zeros_like(kv_for(1, 2))
            assert c.retrieve("r2", tokens, out, model="m") == 2 * CS
            assert np.array_equal(out, kv_for(1, 2))
    finally:
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def live_name(server: ServerProcess) -> str:
    line = next(ln for ln in server.log if ln.startswith("kvtier: L1 "))
    return line.split("/dev/shm/")[1].split(";")[0]


def test_a_server_on_the_default_l2_writes_under_the_test_home_not_the_users() -> None:
    real_home = pwd.getpwuid(os.getuid()).pw_dir

    argv = _serve_argv("--l1-size", "8MiB")  # no --l2: the embedded default under ~
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = next(ln for ln in proc.stdout if ln.startswith("kvtier: L1 ") or "Error" in ln)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert "L2: disk://~/.cache/kvtier/" in line, line
    arena = line.split("/dev/shm/")[1].split(";")[0]
    assert os.path.isdir(os.path.join(os.environ["HOME"], ".cache", "kvtier", arena)), line
    assert not os.path.exists(os.path.join(real_home, ".cache", "kvtier", arena)), line


def test_a_segment_removed_during_start_is_named_as_such_not_as_a_permission_problem() -> None:
    """What Arena.create raises when another process unlinks its temporary segment before it
    is published (os.link then finds no file), as the start-up line says it."""
    import errno

    from kvtier.server.app import _arena_error

    path = "/dev/shm/kvtier-0-abc.123.0badc0de.tmp"
    gone = str(_arena_error(FileNotFoundError(errno.ENOENT, "No such file or directory", path), 1))
    assert "disappeared while this server was creating it" in gone and path in gone, gone
    assert "must be writable" not in gone
    denied = str(_arena_error(PermissionError(errno.EACCES, "Permission denied", path), 1))
    assert "must be writable by this user" in denied, denied

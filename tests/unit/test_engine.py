"""Engine in-process: real arena and L1, frames in and out, no sockets; a fake clock for leases."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from testkit.clock import FakeClock

from kvtier import protocol as p
from kvtier.config import ServerConfig
from kvtier.errors import ErrorCode
from kvtier.hashing import TokenHasher
from kvtier.periodic import PeriodicThreadRegistry
from kvtier.server.app import build_engine
from kvtier.server.engine import Engine

CS = 16
SHAPE = [2, 8]  # float32: 64 bytes per chunk
CLIENT = b"identity-1"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def engine(clock: FakeClock) -> Iterator[Engine]:
    config = ServerConfig(
        address=[f"ipc:///tmp/kvtier-unit-{os.getpid()}.sock"],
        l1_size=1 << 20,
        l2=["none"],
        chunk_size=CS,
        arena_name=f"kvtier-unit-{os.getpid()}-{uuid.uuid4().hex[:6]}",
        client_timeout=10,
        staging_lease=5,
    )
    eng = build_engine(config, clock=clock, registry=PeriodicThreadRegistry(), start_threads=False)
    yield eng
    eng.close()


def call(engine: Engine, msg: Any, payloads: list[bytes] | None = None, who: bytes = CLIENT) -> Any:
    frames = engine.call(who, p.encode(msg), payloads or [])
    reply = p.decode_reply(frames[0])
    return (reply, frames[1:]) if isinstance(msg, p.Retrieve) else reply


def connect(engine: Engine, who: bytes = CLIENT, client_id: str = "c1") -> None:
    engine.handshake.prove(who, os.getpid())  # what the transport proves for an ipc:// peer
    hello = p.Hello(p.PROTOCOL_VERSION, client_id, host_id=p.local_host_id(), pid=os.getpid())
    assert isinstance(call(engine, hello, who=who), p.HelloReply)
    assert isinstance(call(engine, p.Register("m", 1, 0, SHAPE, "float32"), who=who), p.Ok)


def tok(values: range | list[int]) -> bytes:
    return np.asarray(list(values), dtype="<u4").tobytes()


def store_inline(engine: Engine, rid: str, tokens: bytes, start: int, end: int) -> Any:
    n = (end - start) // CS
    payloads = [bytes([i + 1]) * 64 for i in range(n)]
    msg = p.StoreInline(rid, tokens, "m", 1, 0, start, end, SHAPE, "float32", n)
    return call(engine, msg, payloads)


def test_requests_before_hello_are_refused(engine: Engine) -> None:
    reply = call(engine, p.Lookup("r", tok(range(CS)), "m"))
    assert isinstance(reply, p.ErrorReply) and reply.code == ErrorCode.NOT_CONNECTED


def test_hash_contract_mismatch_names_the_setting(engine: Engine) -> None:
    other = TokenHasher(chunk_size=32)
    hello = p.Hello(p.PROTOCOL_VERSION, "c", other.contract(), dict(other.contract_info()))
    reply = call(engine, hello)
    assert isinstance(reply, p.ErrorReply) and reply.code == ErrorCode.HASH_CONTRACT
    assert "chunk_size: client 32, server 16" in reply.message


def test_lookup_after_a_diverging_prompt_uses_fresh_names(engine: Engine) -> None:
    connect(engine)
    a = tok(range(4 * CS))
    assert isinstance(store_inline(engine, "w", a, 0, 4 * CS), p.StoreReply)
    assert call(engine, p.Lookup("r", a, "m")).hit_tokens == 4 * CS
    # the same request now sends a prompt that differs inside chunk 2
    b = tok([*range(2 * CS), 999, *range(2 * CS + 1, 4 * CS)])
    assert call(engine, p.Lookup("r", b, "m")).hit_tokens == 2 * CS
    # a shorter range of the first prompt, then the full lookup again, in one session
    assert call(engine, p.Lookup("r2", a, "m")).hit_tokens == 4 * CS
    reply, frames = call(
        engine, p.Retrieve("r2", a, "m", 1, 0, 0, CS, SHAPE, "float32", 1, inline=True)
    )
    assert reply.num_chunks == 1 and frames[0] == b"\x01" * 64
    assert call(engine, p.Lookup("r2", a, "m")).hit_tokens == 4 * CS


def test_a_reservation_commits_once_and_only_for_its_owner(engine: Engine) -> None:
    connect(engine)
    connect(engine, b"identity-2", "c2")
    tokens = tok(range(2 * CS))
    reserved = call(engine, p.Reserve("r", tokens, "m", 1, 0, 0, 2 * CS, SHAPE, "float32", 2))
    assert isinstance(reserved, p.ReserveReply) and reserved.reservation_id
    stolen = call(engine, p.Commit(reserved.reservation_id), who=b"identity-2")
    assert isinstance(stolen, p.ErrorReply) and stolen.code == ErrorCode.UNKNOWN_RESERVATION
    assert call(engine, p.Commit(reserved.reservation_id)).stored_chunks == 2
    again = call(engine, p.Commit(reserved.reservation_id))
    assert again.code == ErrorCode.UNKNOWN_RESERVATION


def test_inline_frames_must_match_the_layout(engine: Engine) -> None:
    connect(engine)
    tokens = tok(range(2 * CS))
    msg = p.StoreInline("r", tokens, "m", 1, 0, 0, 2 * CS, SHAPE, "float32", 2)
    short = call(engine, msg, [b"x" * 64])
    assert short.code == ErrorCode.BAD_ARRAY and "1 frames carry 64 bytes" in short.message
    wrong = call(engine, msg, [b"x" * 64, b"x" * 63])
    assert wrong.code == ErrorCode.BAD_ARRAY and "carry 127 bytes" in wrong.message
    assert engine.l1.used_bytes == 0  # nothing was reserved for a refused store
    # a chunk may span frames: the same 128 bytes in three pieces is a store of two chunks
    pieces = call(engine, msg, [b"a" * 40, b"b" * 64, b"c" * 24])
    assert isinstance(pieces, p.StoreReply) and pieces.stored_chunks == 2


def test_a_silent_client_loses_its_staging_slots(engine: Engine, clock: FakeClock) -> None:
    connect(engine)
    tokens = tok(range(2 * CS))
    reserved = call(engine, p.Reserve("r", tokens, "m", 1, 0, 0, 2 * CS, SHAPE, "float32", 2))
    assert engine.l1.stats().staging_shards == 2
    clock.now += 11  # past --client-timeout without a heartbeat
    summary = engine.reap()
    assert summary.extra_info["dead_clients"] == 1
    # Its process (this one) is alive, so it may still write: the slots are fenced, not freed.
    stats = engine.l1.stats()
    assert stats.staging_shards == 0 and stats.fenced_slots == 2
    assert engine.l1.used_bytes == 8192
    assert call(engine, p.Heartbeat()).code == ErrorCode.NOT_CONNECTED  # it must say Hello again
    connect(engine)
    late = call(engine, p.Commit(reserved.reservation_id))
    assert late.code == ErrorCode.LEASE_EXPIRED  # the acknowledgement frees them
    assert engine.l1.used_bytes == 0 and engine.l1.stats().fenced_slots == 0


def test_expired_sessions_holding_pins_count_as_orphans(engine: Engine) -> None:
    connect(engine)
    tokens = tok(range(2 * CS))
    store_inline(engine, "w", tokens, 0, 2 * CS)
    call(engine, p.EndSession("w"))
    call(engine, p.Lookup("abandoned", tokens, "m"))
    call(engine, p.Lookup("finished", tokens, "m"))
    call(engine, p.EndSession("finished"))
    assert engine.l1.stats().pinned_groups == 2
    engine.sessions.clock = lambda: 10**12  # far past the ttl for the session manager only
    engine.sessions.cleanup_expired()
    assert engine.orphaned_sessions == 1 and engine.sessions.orphaned_count == 1
    assert engine.l1.stats().pinned_groups == 0

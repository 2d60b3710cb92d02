"""The KV events under attack: what subscribers and replay peers can make the server hold, the
replay window of each tenant, what the events say of salted chunks, and where they bind.

Real server processes with two tenants; real SUB and DEALER sockets that subscribe, ask for
replays and never read; resident memory from /proc.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq
from testkit.servers import ServerProcess, free_port, memory_of
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.server.observe.event_wire import END_SEQ, KVEventBatch

CS = 16
SHAPE = (1, CS, 1)
TOKENS = {"a" * 24: "alice", "m" * 24: "mallory"}
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def _server(
    factory: Callable[..., ServerProcess], tmp_path: Path, *args: str
) -> tuple[ServerProcess, int, int]:
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{t} {tenant}\n" for t, tenant in TOKENS.items()))
    events, replay = free_port(), free_port()
    server = factory(
        "--l1-size", "64MiB", "--no-prefault", "--chunk-size", str(CS),
        "--auth-tokens-file", str(tokens),
        "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
        *args,
    )  # fmt: skip
    return server, events, replay


def _store(c: Client, n: int, num_tokens: int, salt: str = "") -> None:
    tokens = list(range(n * 1_000_000, n * 1_000_000 + num_tokens))
    kv = np.zeros((num_tokens // CS, *SHAPE), np.float16)
    assert c.store(f"r{n}-{salt}", tokens, kv, model="m", cache_salt=salt) == num_tokens
    c.end_session(f"r{n}-{salt}")


def _replay(port: int, start: int = 0) -> list[tuple[bytes, int, KVEventBatch]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    out: list[Any] = []
    try:
        while True:
            assert sock.poll(10_000), "no replay answer"
            _, topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
    finally:
        ctx.destroy(linger=0)


def test_replay_is_bounded_in_bytes_per_tenant_and_unread_replays_hold_little(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """The replay buffer was bounded by batch count (about 6 MB per long prompt, 60 GB at the
    cap); all tenants shared one window, which one client shortened to about 10 s; and 200
    replay requests never read took the server from 293 to 2,299 MB, kept after they left."""
    server, _, replay = _server(server_factory, tmp_path, "--kv-events-buffer-bytes", "2MiB")
    alice, mallory = (Client(server.address, token=t, timeout=30) for t in TOKENS)
    try:
        for c in (alice, mallory):
            c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        _store(alice, 0, 4 * CS)  # alice's one prompt
        for n in range(1, 30):  # mallory's flood: 30 x 16k tokens, far past 2 MiB of batches
            _store(mallory, n, 16384)
        assert wait_for(lambda: len(_replay(replay)) > 0)
        batches = _replay(replay)
        topics = {topic for topic, _, _ in batches}
        assert any(b"alice" in t for t in topics), "mallory's flood evicted alice's window"
        held = sum(len(msgspec.msgpack.encode(b)) for _, _, b in batches)
        assert held <= 2 * (2 << 20), f"the replay holds {held} bytes"
        # replay peers that never read hold their queue only, and give it back when they go
        before = memory_of(server.proc.pid)
        ctx = zmq.Context()
        for _ in range(100):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 1)
            s.connect(f"tcp://127.0.0.1:{replay}")
            s.send_multipart((b"", (0).to_bytes(8, "big")))
        time.sleep(3)
        grown = memory_of(server.proc.pid) - before
        ctx.destroy(linger=0)
        assert grown < 96 << 20, f"RSS grew {grown >> 20} MiB"
        assert len(_replay(replay)) == len(batches)  # replays still answered
        # malformed requests are ignored, and logged once per interval, not once each
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect(f"tcp://127.0.0.1:{replay}")
        for _ in range(500):
            s.send_multipart((b"", b"bad"))
        time.sleep(1)
        ctx.destroy(linger=0)
        assert server.output.count("malformed replay request") <= 2
    finally:
        alice.close()
        mallory.close()
    assert server.proc.poll() is None


def test_subscriptions_cost_nothing_and_salted_chunks_are_told_apart(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """30,000 event subscriptions left 1,726 MB after the subscriber closed; events gave
    salted and unsalted copies of a prompt the same block hashes and marked no extra key."""
    server, events, _ = _server(server_factory, tmp_path)
    before = memory_of(server.proc.pid)
    ctx = zmq.Context()
    try:
        greedy = ctx.socket(zmq.SUB)
        greedy.setsockopt(zmq.LINGER, 0)
        greedy.connect(f"tcp://127.0.0.1:{events}")
        for i in range(30_000):
            greedy.setsockopt(zmq.SUBSCRIBE, os.urandom(1024) + str(i).encode())
        sub = ctx.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{events}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(3)
        grown = memory_of(server.proc.pid) - before  # 30 MB of subscriptions went through
        assert grown < 96 << 20, f"RSS grew {grown >> 20} MiB"
        with Client(server.address, token="a" * 24) as c:
            c.register(model="m", chunk_shape=SHAPE, dtype="float16")
            _store(c, 7, 2 * CS)
            _store(c, 7, 2 * CS, salt="s1")
            tokens = list(range(7_000_000, 7_000_000 + CS))
            kv = np.zeros((1, *SHAPE), np.float16)
            assert c.store("x", tokens, kv, model="m", extra_key=b"lora-1") == CS
        stored: list[Any] = []
        while len(stored) < 3 and sub.poll(5000):
            _, _, payload = sub.recv_multipart()
            stored += [e for e in DECODER.decode(payload).events if hasattr(e, "token_ids")]
        plain, salted, extra = stored[:3]
        assert plain.token_ids == salted.token_ids
        assert not set(plain.block_hashes) & set(salted.block_hashes)
        assert salted.extra_keys[0] == ("s1",) and plain.extra_keys == [None, None]
        assert extra.extra_keys == [(b"lora-1".hex(),)]
    finally:
        ctx.destroy(linger=0)


def test_a_loopback_events_endpoint_binds(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """`tcp://127.0.0.1` connected out instead of binding (a local process that bound the
    port got every tenant's events) and `tcp://[::1]` was refused."""
    port = free_port()
    squatter = zmq.Context().socket(zmq.PULL)
    try:
        _server(server_factory, tmp_path)  # binds its own ports: a squatter-free start
        server = server_factory(
            "--l1-size", "1MiB", "--kv-events-endpoint", f"tcp://127.0.0.1:{port}"
        )
        assert f"tcp://127.0.0.1:{port}" in server.output
        # bound by the server: nobody else can bind it
        try:
            squatter.bind(f"tcp://127.0.0.1:{port}")
            raise AssertionError("the events port was free for another process to bind")
        except zmq.ZMQError:
            pass
        v6 = free_port()
        server_factory("--l1-size", "1MiB", "--kv-events-endpoint", f"tcp://[::1]:{v6}")
    finally:
        squatter.close(linger=0)

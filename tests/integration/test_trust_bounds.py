"""Issue 10, findings 3 and 4: every count and size is bounded before the server does work.

Real server processes; hostile requests are sent through a real client's socket (or a bare
DEALER), and an honest client checks afterwards that nothing leaked or froze.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq
from testkit.admin import status
from testkit.kv import CS, prompt
from testkit.servers import ServerProcess, memory_of
from testkit.trust import SHAPE, kv_for, register, verify
from testkit.waiting import wait_for

from kvtier import protocol as p
from kvtier.client import Client
from kvtier.errors import BadArrayError, InvalidArgumentError, KVTierError, MisalignedRangeError


def _range(world_size: int = 1, worker_id: int = 0, **over: object) -> p.Reserve:
    fields: dict[str, object] = {
        "request_id": "evil",
        "tokens": np.asarray(prompt(1), dtype="<u4").tobytes(),
        "model": "m",
        "world_size": world_size,
        "worker_id": worker_id,
        "start": 0,
        "end": CS,
        "chunk_shape": list(SHAPE),
        "dtype": "float16",
        "num_chunks": 1,
        **over,
    }
    return p.Reserve(**fields)  # type: ignore[arg-type]


def test_huge_counts_are_refused_before_any_work_and_leak_nothing(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Finding 3: a store with world_size=2**34 leaked its slot (64 filled L1 for good); a
    lookup with world_size=2**31 froze the server for 44 s."""
    server = server_factory("--l1-size", "64KiB", "--chunk-size", str(CS))
    with Client(server.address) as c:
        register(c)
        for _ in range(64):
            with pytest.raises(InvalidArgumentError, match="max-world-size"):
                c.connection.call(_range(world_size=2**34, worker_id=2**33))
        assert status(server)["l1"]["used_bytes"] == 0
        t0 = time.monotonic()
        with pytest.raises(InvalidArgumentError, match="world_size"):
            c.lookup("evil", prompt(1), model="m", world_size=2**31)
        with pytest.raises(InvalidArgumentError, match="world_size"):
            c.register(model="m2", world_size=2**31, chunk_shape=SHAPE, dtype="float16")
        assert time.monotonic() - t0 < 2.0
        hostile: list[tuple[p.Reserve, type[KVTierError]]] = [
            (_range(worker_id=5), InvalidArgumentError),
            (_range(end=2**40), MisalignedRangeError),
            (_range(start=-CS), MisalignedRangeError),
            (_range(num_chunks=2**40), BadArrayError),
            (_range(chunk_shape=[2**31, 2**31, 2**31]), BadArrayError),
            (_range(chunk_shape=[1] * 40), BadArrayError),
            (_range(chunk_shape=[0]), BadArrayError),
            (_range(model="m" * 100_000), InvalidArgumentError),
            (_range(cache_salt="s" * 100_000), InvalidArgumentError),
            (_range(tokens=b"\0" * (4 << 21)), InvalidArgumentError),
        ]
        for msg, error in hostile:
            with pytest.raises(error):
                c.connection.call(msg)
        # nothing leaked: every slot of the 64 KiB L1 is still there for honest stores
        for n in range(4):
            assert c.store(f"ok{n}", prompt(n), kv_for(n), model="m") == CS
        assert all(verify(c, n, n, f"v{n}") == 1 for n in range(4))


def test_a_frame_above_the_maximum_is_refused_before_it_is_read(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Finding 4: three 1 GB frames raised the server's RSS to 3.7 GB. With --max-frame-bytes
    ZMQ drops the sender instead of buffering the frame; honest clients are not disturbed."""
    server = server_factory(
        "--l1-size", "1MiB", "--chunk-size", str(CS), "--max-frame-bytes", "1MiB"
    )
    before = memory_of(server.proc.pid)
    ctx = zmq.Context()
    try:
        for _ in range(3):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.address)
            big = bytes(64 << 20)
            sock.send_multipart([b"seq", p.encode(p.Heartbeat()), big])
            assert not sock.poll(1500)  # no reply: the frame was never taken in
            sock.close()
    finally:
        ctx.destroy(linger=0)
    grown = memory_of(server.proc.pid) - before
    assert grown < 48 << 20, f"RSS grew by {grown} bytes"
    with Client(server.address) as c:
        register(c)
        assert c.store("ok", prompt(1), kv_for(1), model="m") == CS


def test_sessions_and_their_tokens_are_bounded_longest_idle_first(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Finding 4: 4,000 lookups of 64k-token prompts held 1.2 GB for the session TTL. Sessions
    and the tokens they hold are bounded; the longest-idle go first, and are counted."""
    server = server_factory(
        "--l1-size", "1MiB", "--chunk-size", str(CS),
        "--max-sessions", "50", "--max-session-tokens", "200000",
    )  # fmt: skip
    with Client(server.address) as c:
        c.lookup("keep", prompt(0, 4), model="m")
        for i in range(200):
            c.lookup(f"s{i}", prompt(i + 1, 4), model="m")
            if i % 20 == 0:
                c.lookup("keep", prompt(0, 4), model="m")  # used often: never the longest idle
        sessions = status(server)["sessions"]
        assert sessions["active"] <= 50 and sessions["shed"] >= 150
        c.end_session("keep")  # still there
        for i in range(20):
            c.lookup(f"long{i}", list(range(i, i + 30_000)), model="m")
        sessions = status(server)["sessions"]
        assert sessions["tokens"] <= 200_000
        assert sessions["shed"] >= 150 + 10
    assert wait_for(lambda: "Traceback" not in server.output)

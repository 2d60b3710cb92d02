"""No connection, subscriber or tenant can crash the server or take its memory.

Real server processes under a lowered descriptor limit, real idle tcp connections by the
thousand, real subscribers and replay peers that never read; an honest engine checks afterwards
that it stores, looks up and reads back its bytes, and the server's resident memory is read
from /proc.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest
import zmq
from testkit.kv import CS, prompt
from testkit.servers import ServerProcess, free_port, memory_of
from testkit.trust import SHAPE, kv_for, register, verify
from testkit.waiting import wait_for

from kvtier import protocol as p
from kvtier.client import Client
from kvtier.errors import ErrorCode, NoSpaceError, NotRegisteredError
from kvtier.server.transport import MAX_SEQ_BYTES

SERVER_NOFILE = 1024
FLOOD = 3000  # idle connections per port: far past the server's whole descriptor limit


@pytest.fixture
def many_descriptors() -> Iterator[None]:
    """This test process opens thousands of connections: its soft limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4 * FLOOD + 256:
        pytest.fail(
            f"this test opens {4 * FLOOD} connections; raise the hard descriptor limit "
            f"(ulimit -Hn {hard}) to at least {4 * FLOOD + 256}",
            pytrace=False,
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _idle_connections(port: int, n: int) -> list[socket.socket]:
    """`n` tcp connections to `port` on loopback that never send a byte."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        out.append(s)
    return out


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_tcp_connections_to_every_port_cannot_exhaust_the_engines_descriptors(
    server_factory: Callable[..., ServerProcess], many_descriptors: None
) -> None:
    """Idle connections to the admin port (or the KV events or replay port) used up the
    server's descriptors, and the next engine to connect over ipc made libzmq abort the server
    (SIGABRT): 4,296 connections at a 4,096 limit. Each socket's connections are capped from a
    descriptor budget that keeps a reserve for the engines."""
    events, replay, data = free_port(), free_port(), free_port()
    server = server_factory(
        "--l1-size", "1MiB", "--chunk-size", str(CS),
        "--address", f"tcp://127.0.0.1:{data}",
        "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
        nofile=SERVER_NOFILE,
    )  # fmt: skip
    assert server.admin_url is not None
    admin = int(server.admin_url.rsplit(":", 1)[1])
    flood: list[socket.socket] = []
    try:
        for port in (admin, events, replay, data):
            flood += _idle_connections(port, FLOOD)
        # every connection is accepted (or shut at once): the tcp data address may take what
        # the limit leaves beside the reserve (a quarter of it), never the reserve itself
        time.sleep(2)
        assert _open_fds(server.proc.pid) < SERVER_NOFILE - 256
        with Client(server.address, timeout=10) as c:
            register(c)
            for n in range(4):
                assert c.store(f"s{n}", prompt(n), kv_for(n), model="m") == CS
            assert all(verify(c, n, n, f"v{n}") == 1 for n in range(4))
        assert server.proc.poll() is None, server.output[-3000:]
    finally:
        for s in flood:
            s.close()
    # the admin API serves again once the flood is gone
    assert wait_for(lambda: _health(server.admin_url) == 200, timeout=15)
    assert server.proc.poll() is None


def _health(url: str | None) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes `sock` (or resets it) within `timeout` s, sending nothing."""
    sock.settimeout(timeout)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_an_admin_connection_without_a_request_is_closed(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """A connection that never sends its request's headers does not hold a slot for good."""
    server = server_factory(
        "--l1-size", "1MiB", "--chunk-size", str(CS), "--max-admin-connections", "4"
    )  # fmt: skip
    assert server.admin_url is not None
    port = int(server.admin_url.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        # the cap is full of idle connections: a client that asks at once is still served,
        # the oldest idle connection gives way
        assert _health(server.admin_url) == 200
        assert _closed_by_server(held[0], 5)
        # the idle ones are closed within the idle timeout
        assert all(_closed_by_server(s, 20) for s in held[1:])
        assert _health(server.admin_url) == 200
    finally:
        for s in held:
            s.close()
    with Client(server.address) as c:
        register(c)
        assert c.store("ok", prompt(1), np.asarray(kv_for(1)), model="m") == CS


def test_echoed_sequence_frames_are_bounded_before_a_hello(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """A peer that never says Hello made the server hold the sequence frames its replies echo
    (up to 1,024 per connection): 40 connections x 32 MiB kept 1,346 MB resident. A sequence
    frame longer than MAX_SEQ_BYTES is answered MALFORMED_FRAME with its first bytes only."""
    server = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS))
    before = memory_of(server.proc.pid)
    ctx = zmq.Context()
    try:
        socks = []
        for _ in range(4):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(server.address)
            for _ in range(16):  # 4 x 16 x 4 MiB = 256 MiB echoed before
                s.send_multipart([b"s" * (4 << 20), p.encode(p.Heartbeat())])
            socks.append(s)
        reply = socks[0].recv_multipart()
        assert reply[0] == b"s" * MAX_SEQ_BYTES
        answer = p.decode_reply(reply[1])
        assert isinstance(answer, p.ErrorReply) and answer.code == ErrorCode.MALFORMED_FRAME
        assert wait_for(lambda: "Traceback" not in server.output)
        time.sleep(1)
        grown = memory_of(server.proc.pid) - before
        assert grown < 48 << 20, f"RSS grew {grown >> 20} MiB"
    finally:
        ctx.destroy(linger=0)
    with Client(server.address) as c:
        register(c)
        assert c.store("ok", prompt(1), kv_for(1), model="m") == CS


def test_a_chunk_bigger_than_a_frame_travels_inline_in_pieces(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """The frame bound no longer follows the L1, so a chunk larger than one frame (here 6 MiB,
    over tcp where bytes go inline) travels as several frames and reads back byte for byte."""
    data = free_port()
    server = server_factory(
        "--l1-size", "64MiB", "--no-prefault", "--chunk-size", str(CS),
        address=f"tcp://127.0.0.1:{data}",
    )  # fmt: skip
    shape = (3 << 20) // (2 * CS), CS, 1  # float16: 6 MiB per chunk
    kv = np.random.default_rng(3).standard_normal((2, *shape)).astype(np.float16)
    with Client(server.address, timeout=30) as c:
        assert c.transfer == "inline"
        c.register(model="big", chunk_shape=shape, dtype="float16")
        assert c.store("big", prompt(5, 2), kv, model="big") == 2 * CS
        out = np.zeros_like(kv)
        assert c.retrieve("big2", prompt(5, 2), out, model="big") == 2 * CS
        assert np.array_equal(out, kv)


def test_registrations_are_bounded_and_expire_once_no_client_holds_them(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Model registrations were never released and each cost more (231 us to 1,433 us by
    40,000). Each client holds at most --max-registrations-per-client; a layout no connected
    client registered is forgotten --layout-ttl seconds after its last use."""
    server = server_factory(
        "--l1-size", "1MiB", "--chunk-size", str(CS), "--max-registrations-per-client", "3",
        "--layout-ttl", "1", "--reap-interval", "0.2",
    )  # fmt: skip
    with Client(server.address) as c:
        for i in range(3):
            c.register(model=f"m{i}", chunk_shape=SHAPE, dtype="float16")
        c.register(model="m0", chunk_shape=SHAPE, dtype="float16")  # again: no new entry
        with pytest.raises(NoSpaceError, match="max-registrations-per-client"):
            c.register(model="m3", chunk_shape=SHAPE, dtype="float16")
        assert c.store("a", prompt(1), kv_for(1), model="m1") == CS
    # the client is gone: its layouts live --layout-ttl seconds after their last use
    with Client(server.address) as other:
        raw = np.asarray(prompt(2), dtype="<u4").tobytes()
        reserve = p.Reserve("b", raw, "m1", 1, 0, 0, CS, list(SHAPE), "float16", 1)

        time.sleep(2)  # a use restarts the time to live: none meanwhile
        with pytest.raises(NotRegisteredError):
            other.connection.call(reserve)

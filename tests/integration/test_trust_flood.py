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
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest
from testkit.kv import CS, prompt
from testkit.servers import ServerProcess, free_port
from testkit.trust import kv_for, register, verify
from testkit.waiting import wait_for

from kvtier.client import Client

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
        # every connection is accepted (or refused at once); none of them may take the reserve
        assert wait_for(lambda: _open_fds(server.proc.pid) < SERVER_NOFILE - 256, timeout=10)
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
    assert "Too many open files" not in server.output


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
        # the cap is full: one more connection is closed at once, unanswered
        extra = socket.create_connection(("127.0.0.1", port))
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert _closed_by_server(extra, 5)
        extra.close()
        # the idle ones are closed within the idle timeout: the API answers again
        assert all(_closed_by_server(s, 20) for s in held)
        assert _health(server.admin_url) == 200
    finally:
        for s in held:
            s.close()
    with Client(server.address) as c:
        register(c)
        assert c.store("ok", prompt(1), np.asarray(kv_for(1)), model="m") == CS

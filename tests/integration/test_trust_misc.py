"""Issue 10, findings 6, 7, 11, 14, 15 and 16, each reproduced with a real server process."""

from __future__ import annotations

import gc
import os
import signal
import socket
import stat
from collections.abc import Callable

import httpx
import numpy as np
import pytest
from testkit.admin import changes, status
from testkit.kv import CS, prompt
from testkit.servers import REDIS_URL, ServerProcess, free_port, start_server
from testkit.trust import SHAPE, kv_for, register, verify
from testkit.waiting import wait_for

from kvtier import protocol as p
from kvtier.client import Client
from kvtier.errors import BadArrayError, ErrorCode, KVTierError, NotConnectedError
from kvtier.storage.arena import default_arena_name


def test_the_ipc_socket_is_private_whatever_the_umask(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Finding 6: under umask 000 the socket file was 0777 (user `nobody` connected)."""
    old = os.umask(0)
    try:
        server = server_factory("--l1-size", "1MiB")
    finally:
        os.umask(old)
    path = server.address.removeprefix("ipc://")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_credentials_are_redacted_in_output_status_and_errors(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Finding 6: /status showed the Redis password of an L2 URL."""
    url = REDIS_URL.replace("redis://", "redis://:hunter2-secret@")
    server = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS), "--l2", url)
    with Client(server.address) as c:  # some traffic, so tier errors (wrong password) surface
        register(c)
        c.store("r", prompt(1), kv_for(1), model="m")
        c.lookup("r2", prompt(2), model="m")
    text = httpx.get(server.admin_url + "/status", timeout=5).text  # type: ignore[operator]
    assert "hunter2-secret" not in text and ":***@" in text
    assert "hunter2-secret" not in server.output


def test_clear_removes_held_chunks_from_view_at_once(server: ServerProcess) -> None:
    """Finding 7: POST /clear answered {"cleared": 4} but groups held by a lookup stayed, and
    kept being served after the hold ended."""
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        tokens = prompt(1, 4)
        assert c.store("w", tokens, kv_for(1, 4), model="m") == 4 * CS
        assert c.lookup("holder", tokens, model="m") == 4 * CS  # pins all four
        reply = httpx.post(
            server.admin_url + "/clear",  # type: ignore[operator]
            json={},
            headers=changes(server),
            timeout=5,
        )
        assert reply.json() == {"cleared": 4}
        assert c.lookup("other", tokens, model="m") == 0
        out = np.zeros_like(kv_for(1, 4))
        assert c.retrieve("holder", tokens, out, model="m") == 0  # not served to the holder
        c.end_session("holder")
        assert c.lookup("after", tokens, model="m") == 0  # nor after the hold ended
        assert wait_for(lambda: status(server)["l1"]["used_bytes"] == 0)


def test_non_native_byte_order_is_refused(server: ServerProcess) -> None:
    """Finding 11: a big-endian float16 array was accepted and read back byte-swapped."""
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        kv = kv_for(2, 1, SHAPE)
        with pytest.raises(BadArrayError, match="byte order"):
            c.store("r", prompt(2), kv.astype(">f2"), model="m")
        assert c.lookup("r", prompt(2), model="m") == 0
        out = np.zeros(kv.shape, ">f2")
        with pytest.raises(BadArrayError, match="byte order"):
            c.retrieve("r", prompt(2), out, model="m")


def test_bad_client_input_raises_kvtiers_typed_errors(server: ServerProcess) -> None:
    """Finding 14: ValueError, TypeError, OverflowError or UnicodeEncodeError escaped the
    client; deeply nested msgpack got an internal error and a logged traceback."""
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        kv = kv_for(3, 1, SHAPE)
        bad_calls: list[Callable[[], object]] = [
            lambda: c.lookup("r", [-1] * CS, model="m"),
            lambda: c.lookup("r", [2**40] * CS, model="m"),
            lambda: c.lookup("r", "not tokens", model="m"),  # type: ignore[arg-type]
            lambda: c.lookup("r", [1.5] * CS, model="m"),  # type: ignore[list-item]
            lambda: c.lookup("\ud800", prompt(3), model="m"),
            lambda: c.lookup("r", prompt(3), model="m", world_size=2**70),
            lambda: c.store("r", prompt(3), kv, model="m", start=2**70),
            lambda: c.store("r", prompt(3), kv, model="\udcff"),
            lambda: c.register(model="m", chunk_shape=("a",), dtype="float16"),  # type: ignore[arg-type]
            lambda: c.store("r", prompt(3), [1, 2, 3], model="m"),
            lambda: Client(server.address, transfer="carrier-pigeon"),  # type: ignore[arg-type]
        ]
        for i, call in enumerate(bad_calls):
            with pytest.raises(KVTierError):
                try:
                    call()
                except KVTierError:
                    raise
                except Exception as exc:  # pragma: no cover - the failure being reported
                    pytest.fail(f"bad call {i} raised {type(exc).__name__}: {exc}")
        assert c.store("ok", prompt(3), kv, model="m") == CS  # the client still works
    deep = b"\x92\xa6Lookup" + b"\x91" * 100_000 + b"\x01"
    hello = p.encode(p.Hello(p.PROTOCOL_VERSION, "raw"))
    import zmq

    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        for header in (hello, deep, b"\x96\xa5Hello" + b"\x81\xa1a" * 100_000 + b"\x01"):
            sock.send_multipart([b"s", header])
            assert sock.poll(5000)
            reply = p.decode_reply(sock.recv_multipart()[1])
            if header is not hello:
                assert isinstance(reply, p.ErrorReply) and reply.code == ErrorCode.MALFORMED_FRAME
    assert "Traceback" not in server.output


def _stored(c: Client, n: int) -> bool:
    """Store prompt n; False while the client still fails fast after a server restart."""
    try:
        return c.store(f"s{n}", prompt(n), kv_for(n), model="m") == CS
    except NotConnectedError:
        return False


def _mappings(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if name in line)


def test_a_long_lived_client_drops_old_arena_mappings_across_restarts(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Finding 15: a long-lived client kept every old arena mapping (a whole L1 of /dev/shm per
    server restart)."""
    first = server_factory("--l1-size", "4MiB", "--chunk-size", str(CS))
    name = default_arena_name(first.address)
    with Client(first.address, timeout=10) as c:
        register(c)
        current = first
        for n in range(3):
            assert wait_for(lambda n=n: _stored(c, n), timeout=20)  # once it has re-joined
            assert verify(c, n, n, f"v{n}") == 1
            current.stop(signal.SIGKILL if n % 2 else signal.SIGINT)
            current = server_factory(
                "--l1-size", "4MiB", "--chunk-size", str(CS), address=first.address
            )
        assert wait_for(lambda: _stored(c, 9), timeout=20)  # re-joins the 4th server
        gc.collect()
        assert _mappings(name) == 1


def test_a_server_that_fails_at_start_leaves_no_segment(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Finding 16: `--session-ttl -5` left the L1 segment in /dev/shm; so does any failure
    after the arena exists (here: the data port is taken)."""
    address = f"ipc:///tmp/kvtier-trust-{os.getpid()}-{free_port()}.sock"
    with pytest.raises(RuntimeError, match="session-ttl"):
        start_server("--session-ttl", "-5", address=address)
    assert not os.path.exists(f"/dev/shm/{default_arena_name(address)}")
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        tcp = f"tcp://127.0.0.1:{port}"
        with pytest.raises(RuntimeError, match="cannot listen"):
            start_server("--l1-size", "1MiB", address=tcp)
        assert not os.path.exists(f"/dev/shm/{default_arena_name(tcp)}")

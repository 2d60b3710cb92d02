"""What one peer on the data port (or the admin port) can do to the server and to other clients.

Real `kvtier serve` processes; the hostile peer is a bare ZMQ DEALER that sends what it likes (or
a real Client that lies), while an honest client checks that it is still served.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zmq
from testkit.admin import changes, status
from testkit.kv import CS, prompt
from testkit.servers import REDIS_URL, ServerProcess, free_port, memory_of
from testkit.trust import SPAWN, kv_for, register, reserve, verify
from testkit.waiting import wait_for

from kvtier import protocol as p
from kvtier.client import Client
from kvtier.errors import ErrorCode, InvalidArgumentError

#: a generous bound on how long anything here may take to be answered (never a tight timing)
PROMPT_S = 2.0


class Raw:
    """A bare DEALER socket: frames as the test writes them, replies as they come."""

    def __init__(self, address: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.seq = 0

    def send(self, msg: Any, payloads: tuple[bytes, ...] = ()) -> bytes:
        self.seq += 1
        seq = self.seq.to_bytes(8, "little")
        header = msg if isinstance(msg, bytes | memoryview) else p.encode(msg)
        self.sock.send_multipart([seq, header, *payloads], copy=False)
        return seq

    def recv(self, timeout: float) -> p.Reply | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        frames = self.sock.recv_multipart()
        return p.decode_reply(frames[1])

    def call(self, msg: Any, payloads: tuple[bytes, ...] = (), timeout: float = 30) -> Any:
        self.send(msg, payloads)
        return self.recv(timeout)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@contextlib.contextmanager
def raw(address: str) -> Iterator[Raw]:
    r = Raw(address)
    try:
        yield r
    finally:
        r.close()


def hello(client_id: str = "evil", **fields: Any) -> p.Hello:
    return p.Hello(p.PROTOCOL_VERSION, client_id, **fields)


def code(reply: Any) -> ErrorCode | None:
    return ErrorCode(reply.code) if isinstance(reply, p.ErrorReply) else None


class Watchdog:
    """An honest client heartbeating and looking up, plus /health polled, on threads: the
    longest any of them waited is what a hostile request cost everyone else."""

    def __init__(self, server: ServerProcess, **client: Any) -> None:
        self.server = server
        self.client = Client(server.address, **client)
        self.worst = {"heartbeat": 0.0, "lookup": 0.0, "health": 0.0}
        self.rounds = dict.fromkeys(self.worst, 0)
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._beat, daemon=True),
            threading.Thread(target=self._health, daemon=True),
        ]

    def _time(self, what: str, fn: Callable[[], object]) -> None:
        t0 = time.monotonic()
        try:
            fn()
        except Exception as exc:  # recorded: the test fails on it
            self.failures.append(f"{what}: {exc!r}")
        self.worst[what] = max(self.worst[what], time.monotonic() - t0)
        self.rounds[what] += 1

    def _beat(self) -> None:
        while not self._stop.wait(0.05):
            self._time("heartbeat", lambda: self.client.connection.call(p.Heartbeat()))
            self._time("lookup", lambda: self.client.lookup("honest", prompt(7), model="m"))

    def _health(self) -> None:
        url = f"{self.server.admin_url}/health"
        while not self._stop.wait(0.05):
            self._time("health", lambda: httpx.get(url, timeout=60).raise_for_status())

    def __enter__(self) -> Watchdog:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        self.client.close()

    def check(self) -> None:
        before = dict(self.rounds)  # one more round of each after the hostile requests
        wait_for(lambda: all(self.rounds[w] > n for w, n in before.items()), timeout=PROMPT_S)
        assert not self.failures, self.failures
        assert max(self.worst.values()) < PROMPT_S, self.worst


# -- 1. one message must not freeze the server ---------------------------------------------------


def test_a_long_contract_or_poll_id_is_refused_at_once_while_others_are_served(
    server: ServerProcess,
) -> None:
    """A Hello whose contract held 40 KB froze every client and /health for 11 s (1 MB: more
    than 5 minutes): the message quoting it went through a quadratic redaction regex. A
    LookupPoll with a 40 KB request id did the same after a Hello."""
    with Watchdog(server) as dog, raw(server.address) as evil:
        t0 = time.monotonic()
        reply = evil.call(hello(contract="a" * 40_000, contract_info={"chunk_size": 1}))
        assert code(reply) == ErrorCode.INVALID_ARGUMENT and "contract" in reply.message
        assert isinstance(evil.call(hello()), p.HelloReply)
        reply = evil.call(p.LookupPoll("a" * 40_000))
        assert code(reply) == ErrorCode.INVALID_ARGUMENT and "request_id" in reply.message
        reply = evil.call(hello("a" * 40_000))
        assert code(reply) == ErrorCode.INVALID_ARGUMENT and "client_id" in reply.message
        reply = evil.call(hello(contract_info={"k" * 40_000: "v", "x": "a" * 40_000}))
        assert code(reply) == ErrorCode.INVALID_ARGUMENT
        assert time.monotonic() - t0 < PROMPT_S
        # a megabyte before any Hello (another socket) is not even read
        with raw(server.address) as stranger:
            reply = stranger.call(hello(contract="a" * (1 << 20)))
            assert code(reply) == ErrorCode.NOT_CONNECTED
        dog.check()
    errors = status(server)["recent_errors"]
    assert errors and all(len(e["message"]) < 5000 for e in errors)


# -- 2. what a flood of Hellos can make the server hold ------------------------------------------


def _open_fds(pid: int) -> list[str]:
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
    return out


def test_a_flood_of_hellos_holds_bounded_descriptors_and_never_ends_the_server(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """20,500 Hellos naming a live pid kept 20,500 pidfds; libzmq then found no descriptor for
    an ipc:// connection and aborted the process ("Too many open files"). Under a lowered
    RLIMIT_NOFILE: a tcp flood opens no pidfd, the client ids of the flooding tenant are
    bounded (NO_SPACE), and another tenant's new ipc client is still served."""
    path, tokens = _tokens_file(tmp_path, 2)
    port = free_port()
    server = server_factory(
        "--l1-size", "1MiB", "--chunk-size", str(CS), "--auth-tokens-file", path,
        "--address", f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    pid = server.proc.pid
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (256, 256))
    with raw(server.address) as probe:
        host_id = probe.call(
            hello("probe", token=tokens[0], host_id=p.local_host_id())
        ).host_id  # any tenant can read it
    replies = []
    with raw(f"tcp://127.0.0.1:{port}") as evil:
        for batch in range(0, 2000, 50):  # pipelined, 50 at a time
            for i in range(batch, batch + 50):
                evil.send(hello(f"tcp-{i}", host_id=host_id, pid=os.getpid(), token=tokens[0]))
            replies += [evil.recv(30) for _ in range(50)]
    assert all(r is not None for r in replies)
    # --max-clients-per-tenant (1024): 1023, and the probe's
    assert sum(isinstance(r, p.HelloReply) for r in replies) == 1023
    assert {code(r) for r in replies if not isinstance(r, p.HelloReply)} == {ErrorCode.NO_SPACE}
    # the probe's (ipc: proven) is the only one; no tcp pid is trusted
    assert sum("pidfd" in f for f in _open_fds(pid)) == 1
    assert server.proc.poll() is None
    # a new ipc connection (libzmq needs a descriptor for it) of another tenant
    with Client(server.address, token=tokens[1]) as honest:
        assert honest.transfer == "shm"
        register(honest)
        assert honest.store("w", prompt(1), kv_for(1), model="m") == CS
        assert verify(honest, 1, 1) == 1
    assert httpx.get(f"{server.admin_url}/health", timeout=10).status_code == 200
    assert len(_open_fds(pid)) < 200


def test_clients_of_one_process_share_one_pidfd(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory("--l1-size", "1MiB")
    pid = server.proc.pid
    before = sum("pidfd" in f for f in _open_fds(pid))
    replies = []
    with raw(server.address) as flood:
        for batch in range(0, 1000, 50):
            for i in range(batch, batch + 50):
                flood.send(hello(f"ipc-{i}", host_id=p.local_host_id(), pid=os.getpid()))
            replies += [flood.recv(30) for _ in range(50)]
    assert all(isinstance(r, p.HelloReply) for r in replies)
    assert sum("pidfd" in f for f in _open_fds(pid)) - before == 1


# -- 3. a pid the server cannot prove gets no arena slots ---------------------------------------


def test_a_tcp_client_that_names_a_pid_gets_no_arena_slots(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """A tcp tenant copied host_id from a HelloReply, named pid 1, and was granted arena slots
    it could never touch (and that no process exit would ever free)."""
    port = free_port()
    server = server_factory(
        "--l1-size", "1MiB", "--chunk-size", str(CS), "--address", f"tcp://127.0.0.1:{port}"
    )
    tcp = f"tcp://127.0.0.1:{port}"
    with raw(server.address) as probe:
        host_id = probe.call(hello("probe", host_id=p.local_host_id())).host_id
        assert host_id == p.local_host_id()  # over ipc the process is proven: the arena's
    with raw(tcp) as evil:
        reply = evil.call(hello(host_id=host_id, pid=1))
        assert isinstance(reply, p.HelloReply) and reply.host_id != p.local_host_id()
        assert isinstance(evil.call(p.Register("m", 1, 0, [8, 2, CS, 4, 8], "float16")), p.Ok)
        raw_tokens = np.asarray(prompt(1), dtype="<u4").tobytes()
        res = p.Reserve("r", raw_tokens, "m", 1, 0, 0, CS, [8, 2, CS, 4, 8], "float16", 1)
        reply = evil.call(res)
        assert code(reply) == ErrorCode.INVALID_ARGUMENT and "inline" in reply.message
    assert status(server)["l1"]["used_bytes"] == 0
    with Client(tcp) as honest:  # a real client over tcp moves its bytes inline
        assert honest.transfer == "inline"
        register(honest)
        assert honest.store("w", prompt(2), kv_for(2), model="m") == CS
        assert verify(honest, 2, 2) == 1
        with pytest.raises(InvalidArgumentError, match="inline"):
            reserve(honest, "r2", prompt(3))


# -- 4. huge tokens, many credentials -----------------------------------------------------------


def _tokens_file(tmp_path: Path, n: int) -> tuple[str, list[str]]:
    tokens = [f"tenant-{i:03d}-token-0123456789abcdef" for i in range(n)]
    path = tmp_path / "tokens"
    path.write_text("".join(f"{t} tenant{i}\n" for i, t in enumerate(tokens)))
    return str(path), tokens


def test_a_huge_token_costs_nothing_however_many_credentials(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """A 200 MB token stalled every client 1.8 s with 2 credentials, 49.9 s with 64: it was
    decoded, then compared with each of them."""
    path, tokens = _tokens_file(tmp_path, 64)
    server = server_factory(
        "--l1-size", "256MiB", "--no-prefault", "--chunk-size", str(CS),
        "--auth-tokens-file", path,
    )  # fmt: skip
    with Watchdog(server, token=tokens[5]) as dog, raw(server.address) as evil:
        big = p.encode(hello(token="x" * (200 << 20)))
        t0 = time.monotonic()
        # past the frame bound (a header's, never the arena's): ZMQ drops the peer unread
        assert evil.call(big, timeout=5) is None
        assert time.monotonic() - t0 < 10  # 200 MB over loopback, and nothing else
        assert code(evil.call(hello(token="x" * 60_000))) == ErrorCode.INVALID_ARGUMENT
        assert code(evil.call(hello(token=tokens[7] + "x"))) == ErrorCode.UNAUTHORIZED
        assert isinstance(evil.call(hello(token=tokens[63])), p.HelloReply)
        assert time.monotonic() - t0 < 10  # 200 MB over loopback, and nothing else
        dog.check()
    assert "x" * 40 not in str(status(server, tokens[0]))  # no token quoted back


# -- 5. a client id acts only for the connection and process that made it ------------------------


def _victim(address: str, client_id: str, queue: Any, go: Any) -> None:
    """Reserve one slot under `client_id`, report it, wait until told (the parent SIGSTOPs us
    meanwhile), then write the slot late and commit."""
    try:
        with Client(address, timeout=10, client_id=client_id) as c:
            register(c)
            reply = reserve(c, "v", prompt(0))
            queue.put(("reserved", reply.offsets[0]))
            go.wait(60)
            arena = c.arena_bytes
            assert arena is not None
            offset = reply.offsets[0]
            arena[offset : offset + reply.chunk_nbytes] = 0xAA
            try:
                c.connection.call(p.Commit(reply.reservation_id))
                queue.put(("committed", None))
            except Exception as exc:
                queue.put(("refused", type(exc).__name__))
    except Exception as exc:
        queue.put(("error", repr(exc)))


def test_another_process_cannot_end_a_swept_clients_quarantine(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Another tenant sent Hello and Goodbye with a swept client's id: the quarantine of its
    slot ended, the slot was reused, and the paused client's late write was then served."""
    server = server_factory(
        "--l1-size", "64KiB", "--chunk-size", str(CS), "--staging-lease", "2",
        "--reap-interval", "0.2", "--client-timeout", "2",
    )  # fmt: skip
    queue, go = SPAWN.Queue(), SPAWN.Event()
    victim_id = "victim-" + os.urandom(8).hex()
    a = SPAWN.Process(target=_victim, args=(server.address, victim_id, queue, go))
    a.start()
    try:
        assert queue.get(timeout=60)[0] == "reserved"
        os.kill(a.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        assert wait_for(lambda: status(server)["fencing"]["fenced_slots"] == 1, timeout=20)
        assert wait_for(lambda: status(server)["clients"] == [], timeout=20)
        with raw(server.address) as evil:
            reply = evil.call(hello(victim_id, host_id=p.local_host_id(), pid=a.pid))
            assert code(reply) == ErrorCode.UNAUTHORIZED and "client id" in reply.message
            assert code(evil.call(p.Goodbye())) == ErrorCode.NOT_CONNECTED
        assert status(server)["fencing"]["fenced_slots"] == 1  # still quarantined
        with Client(server.address) as b:
            register(b)
            for n in range(1, 5):
                with contextlib.suppress(Exception):
                    b.store(f"b{n}", prompt(n), kv_for(n), model="m")
            present = [n for n in range(1, 5) if b.lookup(f"p{n}", prompt(n), model="m")]
            assert len(present) == 3  # the quarantined slot was not handed out
            os.kill(a.pid, signal.SIGCONT)  # type: ignore[arg-type]
            go.set()
            assert queue.get(timeout=60) == ("refused", "LeaseExpiredError")
            for n in present:
                assert verify(b, n, n, f"v{n}") == 1  # no late bytes in anyone's chunk
    finally:
        if a.is_alive():
            os.kill(a.pid, signal.SIGCONT)  # type: ignore[arg-type]
            a.kill()
        a.join(10)


def test_a_live_clients_id_cannot_be_joined_from_another_process(server: ServerProcess) -> None:
    """A second socket may join a client id only from the process that made it (a Client opens
    one per thread); another process's Hello is refused and its Goodbye acts on nothing."""
    with Client(server.address) as victim:
        register(victim)
        assert _hello_from_child(server.address, victim.client_id) == int(ErrorCode.UNAUTHORIZED)
        assert status(server)["clients"] != []
        assert victim.store("w", prompt(1), kv_for(1), model="m") == CS  # unaffected


def _hello_from_child(address: str, client_id: str) -> int:
    """Another process says Hello, then Goodbye, under `client_id`; the Hello's error code."""
    script = (
        "import sys, zmq; from kvtier import protocol as p\n"
        "ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.connect(sys.argv[1])\n"
        "s.send_multipart([b'1', p.encode(p.Hello(p.PROTOCOL_VERSION, sys.argv[2]))])\n"
        "assert s.poll(10000); r = p.decode_reply(s.recv_multipart()[1])\n"
        "s.send_multipart([b'2', p.encode(p.Goodbye())]); s.poll(10000)\n"
        "print(getattr(r, 'code', 0))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, address, client_id],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return int(out.stdout.strip())


# -- 6. memory before authentication ------------------------------------------------------------


def test_big_frames_before_a_hello_are_dropped_unread(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """Twelve 200 MB frames from a peer that never said Hello took the server to 2.3 GB. The
    frame bound is a header's (or a piece of inline KV's), whatever the L1's size: ZMQ drops
    the peer before it reads such a frame."""
    path, tokens = _tokens_file(tmp_path, 2)
    server = server_factory(
        "--l1-size", "256MiB", "--no-prefault", "--auth-tokens-file", path,
    )  # fmt: skip
    before = memory_of(server.proc.pid, "VmHWM")
    big = p.encode(hello(token="y" * (200 << 20)))
    with raw(server.address) as evil:
        for _ in range(12):
            evil.send(big)
        assert evil.recv(5) is None
        # a request of more than 64 KiB within the frame bound is refused unread
        evil.send(p.encode(hello(token="y" * (1 << 20))))
        assert code(evil.recv(30)) == ErrorCode.NOT_CONNECTED
    grown = memory_of(server.proc.pid, "VmHWM") - before
    assert grown < 64 << 20, f"peak RSS grew {grown >> 20} MiB"
    with Client(server.address, token=tokens[0]) as honest:
        honest.connection.call(p.Heartbeat())


# -- 7. admin request bodies ---------------------------------------------------------------------


def _http(admin_url: str, request: bytes, body: Iterator[bytes]) -> bytes:
    """Send a raw HTTP request (headers, then `body` chunks until the server stops taking
    them), return what the server answered."""
    host, port = admin_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        with contextlib.suppress(OSError):
            for chunk in body:
                s.sendall(chunk)
        answer = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in answer:
                got = s.recv(65536)
                if not got:
                    break
                answer += got
        return answer


def test_admin_bodies_are_bounded_and_deep_json_is_a_bad_request(server: ServerProcess) -> None:
    """POST /login read any body (400 MB took the server to 1.7 GB); nested JSON gave a 500."""
    assert server.admin_url is not None
    t0 = time.monotonic()
    declared = (
        b"POST /login HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 400000000\r\n\r\n"
    )
    answer = _http(server.admin_url, declared, iter([b"{" + b" " * 65536] * 4))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    chunked = (
        b"POST /login HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
    answer = _http(server.admin_url, chunked, iter([piece] * 64))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert time.monotonic() - t0 < 10
    deep = b"[" * 20000 + b"]" * 20000
    for path, headers in (("/login", {}), ("/clear", changes(server))):
        reply = httpx.post(server.admin_url + path, content=deep, headers=headers, timeout=10)
        assert reply.status_code == 400 and "nested" in reply.json()["error"]
    assert httpx.get(server.admin_url + "/health", timeout=5).status_code == 200


# -- 8. a Redis password with odd characters ----------------------------------------------------


def test_a_password_with_an_at_sign_is_redacted_in_status_and_log(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """A Redis password holding "@" (and here "/", which urllib itself does not take as part of
    the password) showed partly in /status and the log: redaction hid only up to its first
    "@"."""
    url = REDIS_URL.replace("redis://", "redis://:zq:Xq7v@9Zkw/Ab3@")
    server = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS), "--l2", url)
    with Client(server.address) as c:  # traffic, so the tier's errors surface
        register(c)
        with contextlib.suppress(Exception):
            c.store("r", prompt(1), kv_for(1), model="m")
        c.lookup("r2", prompt(2), model="m")
    text = httpx.get(server.admin_url + "/status", timeout=5).text  # type: ignore[operator]
    server.stop()
    assert ":***@" in text
    for secret in ("Xq7v", "9Zkw/", "/Ab3", "Ab3@"):
        assert secret not in text, secret
        assert secret not in server.output, secret


# -- 9. DNS rebinding ---------------------------------------------------------------------------


def test_open_admin_reads_answer_only_loopback_host_names(server: ServerProcess) -> None:
    assert server.admin_url is not None
    port = server.admin_url.rsplit(":", 1)[1]
    base = f"http://127.0.0.1:{port}"
    for host in ("evil.example", f"evil.example:{port}", "10.0.0.1", "[::2]"):
        reply = httpx.get(base + "/sessions", headers={"Host": host}, timeout=5)
        assert reply.status_code == 403, host
        assert "loopback" in reply.json()["error"]
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", "127.1.2.3", "[::1]"):
        assert httpx.get(base + "/sessions", headers={"Host": host}, timeout=5).status_code == 200
    assert httpx.get(base + "/health", headers={"Host": "evil.example"}, timeout=5).is_success


# -- 10. a short admin token off loopback --------------------------------------------------------


def test_a_short_admin_token_off_loopback_is_refused_at_start() -> None:
    argv = [
        sys.executable, "-m", "kvtier.cli", "serve", "--address",
        f"ipc:///tmp/kvtier-wire-{os.getpid()}.sock", "--l1-size", "1MiB", "--l2", "none",
        "--admin-host", "0.0.0.0", "--admin-port", str(free_port()), "--admin-token", "x",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=15)
        pytest.fail("the server started with a one-character --admin-token on 0.0.0.0")
    assert proc.returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--admin-token" in lines[0] and "16" in lines[0]


# -- 11. stopping while replies are in flight ---------------------------------------------------


def test_stopping_while_replies_are_in_flight_is_clean(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory("--l1-size", "4MiB", "--chunk-size", str(CS), "--handler-threads", "4")
    with Client(server.address, transfer="inline") as c:
        register(c)
        c.store("w", prompt(1, 8), kv_for(1, 8), model="m")
    stop = threading.Event()
    calls = [0] * 6

    def hammer(i: int) -> None:
        # a short timeout: once the server is gone, the call in flight ends in seconds
        with (
            contextlib.suppress(Exception),
            Client(server.address, transfer="inline", timeout=2) as c,
        ):
            register(c)
            out = np.zeros_like(kv_for(1, 8))
            while not stop.is_set():
                c.retrieve("r", prompt(1, 8), out, model="m")  # answered by handler threads
                calls[i] += 1

    threads = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    # SIGTERM lands while every hammering thread keeps the server busy
    assert wait_for(lambda: min(calls) >= 5, timeout=30), calls
    assert server.stop(signal.SIGTERM) == 0
    stop.set()
    for t in threads:
        t.join(30)
    assert "Traceback" not in server.output and "Bad file descriptor" not in server.output


def test_replies_from_other_threads_never_write_a_closed_wake_up_descriptor(
    tmp_path: Path,
) -> None:
    """The outbox's eventfd could be written after close() had closed it: EBADF in a handler
    thread, or 8 bytes into whatever file reused the descriptor number. A real Transport on a
    real socket; replies from many threads race its close."""
    from kvtier.config import ServerConfig
    from kvtier.periodic import PeriodicThreadRegistry
    from kvtier.server.app import build_engine
    from kvtier.server.transport import Transport

    address = f"ipc://{tmp_path}/wake.sock"
    config = ServerConfig(
        address=[address], l1_size=1 << 20, l2=["none"], arena_name=f"kvtier-wake-{os.getpid()}"
    )
    engine = build_engine(config, registry=PeriodicThreadRegistry(), start_threads=False)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for _ in range(20):
            transport = Transport(engine, [address])
            respond = transport._responder(b"peer", b"seq")
            errors: list[BaseException] = []
            stop = threading.Event()

            def reply(
                respond: Callable[[list[Any]], None] = respond,
                stop: threading.Event = stop,
                errors: list[BaseException] = errors,
            ) -> None:
                try:
                    while not stop.is_set():
                        respond([b"reply"])
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=reply) for _ in range(8)]
            for t in threads:
                t.start()
            time.sleep(0.01)  # on purpose: close while the repliers are mid-flight
            transport.close()
            r, w = os.pipe()  # likely takes the closed eventfd's number
            time.sleep(0.01)  # on purpose: give a stale reply the chance to write into it
            stop.set()
            for t in threads:
                t.join(10)
            os.set_blocking(r, False)
            try:
                leaked = os.read(r, 64)
            except BlockingIOError:
                leaked = b""
            os.close(r)
            os.close(w)
            assert not errors, errors[:3]
            assert leaked == b""
    finally:
        sys.setswitchinterval(old)
        engine.close()

"""RESP on the wire for the Redis tiers: bulk values straight between sockets and caller buffers.

redis-py (with hiredis) copies a multi-MiB value two to three times per verb and was measured
4-6x slower than the socket; so GET, SET, EXISTS and DEL of objects go over each node's own
connection pool in hand-packed RESP (`Wire`): a SET sends the header and the caller's payload
as separate pieces of one bulk string (no join), and a GET receives the payload straight into
the caller's buffer. redis-py still makes and authenticates the connections (`Node`) and runs
every other command.

A Redis Cluster answers a command for a slot the node does not serve with a `MOVED` or `ASK`
error reply; `Wire` returns it as a `Redirect` value (the reply was read whole, the connection
stays usable) so the cluster tier can follow it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import redis
from typing_extensions import Buffer

_WIRE_BUF = 64 << 10  # reply-line buffer of `Wire`
_COALESCE = 64 << 10  # pieces smaller than this are joined before sending (fewer syscalls)
_T = TypeVar("_T")


def command(*args: bytes) -> bytes:
    """One RESP command of small arguments."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
    return b"".join(out)


def set_parts(name: bytes, header: bytes, payload: memoryview, ttl: int | None) -> list[Buffer]:
    """The RESP pieces of `SET name header+payload [EX ttl]`, the payload not copied."""
    n = len(header) + len(payload)
    argc = 3 if ttl is None else 5
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (argc, len(name), name, n, header)
    if ttl is None:
        return [head, payload, b"\r\n"]
    t = str(ttl).encode()
    return [head, payload, b"\r\n$2\r\nEX\r\n$%d\r\n%b\r\n" % (len(t), t)]


class Redirect(NamedTuple):
    """A cluster's `MOVED slot host:port` or `ASK slot host:port` reply."""

    ask: bool
    slot: int
    address: str  # "host:port"


def _redirect(text: str) -> Redirect | None:
    kind, _, rest = text.partition(" ")
    if kind not in ("MOVED", "ASK"):
        return None
    slot, _, address = rest.partition(" ")
    try:
        return Redirect(kind == "ASK", int(slot), address.strip())
    except ValueError:
        return None


class Wire:
    """RESP replies read straight from a pooled connection's socket into the caller's buffers.

    Only the tiers' own bulk pools use it, so the connection's redis-py parser never holds
    buffered data.
    """

    __slots__ = ("_buf", "_end", "_pos", "_sock")

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(_WIRE_BUF)
        self._pos = 0
        self._end = 0

    def send(self, parts: Sequence[Buffer]) -> None:
        """Send `parts` in order; runs of small pieces go out as one joined buffer."""
        small: list[Buffer] = []
        nsmall = 0
        for part in parts:
            n = memoryview(part).nbytes
            if n < _COALESCE:
                small.append(part)
                nsmall += n
                if nsmall < _COALESCE:
                    continue
            if small:
                self._sock.sendall(b"".join(small))
                small, nsmall = [], 0
            if n >= _COALESCE:
                self._sock.sendall(part)
        if small:
            self._sock.sendall(b"".join(small))

    def _fill(self) -> None:
        if self._pos == self._end:
            self._pos = self._end = 0
        elif self._end == len(self._buf):  # a line longer than the buffer: make room
            self._buf = self._buf[self._pos : self._end] + bytearray(len(self._buf))
            self._end -= self._pos
            self._pos = 0
        got = self._sock.recv_into(memoryview(self._buf)[self._end :])
        if not got:
            raise redis.ConnectionError("connection closed by the server")
        self._end += got

    def line(self) -> bytes:
        """The next reply line without its CRLF."""
        while True:
            i = self._buf.find(b"\r\n", self._pos, self._end)
            if i >= 0:
                out = bytes(self._buf[self._pos : i])
                self._pos = i + 2
                return out
            self._fill()

    def read_into(self, dest: memoryview) -> None:
        """Fill `dest` from the bytes already buffered, then straight from the socket."""
        have = min(self._end - self._pos, len(dest))
        dest[:have] = self._buf[self._pos : self._pos + have]
        self._pos += have
        while have < len(dest):
            got = self._sock.recv_into(dest[have:])
            if not got:
                raise redis.ConnectionError("connection closed by the server")
            have += got

    def crlf(self) -> None:
        end = bytearray(2)
        self.read_into(memoryview(end))
        if end != b"\r\n":
            raise redis.ConnectionError("malformed Redis reply: bulk string without CRLF")

    @staticmethod
    def _error(line: bytes) -> Redirect:
        text = line[1:].decode(errors="replace")
        moved = _redirect(text)
        if moved is None:
            raise redis.ResponseError(text)
        return moved

    def simple(self) -> bytes | Redirect:
        """A status or integer reply, or a redirect; another error reply raises ResponseError
        (after which the connection is still in step)."""
        line = self.line()
        if line[:1] == b"-":
            return self._error(line)
        if line[:1] not in (b"+", b":"):
            raise redis.ConnectionError(f"unexpected Redis reply {line[:40]!r}")
        return line[1:]

    def bulk_len(self) -> int | Redirect:
        """The length of the next bulk reply (-1 for nil), or a redirect."""
        line = self.line()
        if line[:1] == b"-":
            return self._error(line)
        if line[:1] == b"_":  # RESP3 null
            return -1
        if line[:1] != b"$":
            raise redis.ConnectionError(f"unexpected Redis reply {line[:40]!r}")
        return int(line[1:])

    @property
    def drained(self) -> bool:
        return self._pos == self._end


class Node:
    """One Redis server ("host:port"): a bulk connection pool for `Wire`, and a cool-down.

    After a connection failure the node is skipped for `cooldown` seconds, so a dead server
    does not stall every request; afterwards the pool reconnects by itself.
    """

    def __init__(self, address: str, pool: redis.ConnectionPool, cooldown: float) -> None:
        self.address = address
        self.pool = pool
        self.cooldown = cooldown
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def mark_down(self) -> bool:
        """Start a cool-down; True when the node was up until now (worth one warning)."""
        now = time.monotonic()
        with self._lock:
            was_up = now >= self._down_until
            self._down_until = now + self.cooldown
        return was_up

    def run(self, op: Callable[[Wire], _T]) -> _T:
        """Run `op` on a pooled connection; socket failures become redis errors.

        A pooled connection that died (e.g. a restarted server) is retried once on a new one.
        After any failure the connection is dropped, since replies may be left unread.
        """
        for attempt in (0, 1):
            # connects; raises redis.ConnectionError (Any: redis-py leaves disconnect untyped).
            # get_connection() without a command name needs redis-py >= 5.3 (pinned).
            conn: Any = self.pool.get_connection()
            try:
                sock: socket.socket | None = getattr(conn, "_sock", None)
                if sock is None:
                    raise redis.ConnectionError("redis-py returned an unconnected connection")
                wire = Wire(sock)
                result = op(wire)
                if not wire.drained:
                    raise redis.ConnectionError("unexpected extra bytes after a Redis reply")
            except TimeoutError as exc:  # socket.timeout
                conn.disconnect()
                raise redis.TimeoutError(f"Redis read/write timed out: {exc}") from exc
            except (OSError, redis.ConnectionError) as exc:
                conn.disconnect()
                if attempt:
                    if isinstance(exc, redis.ConnectionError):
                        raise
                    raise redis.ConnectionError(f"Redis connection failed: {exc}") from exc
                continue
            except BaseException:
                conn.disconnect()
                raise
            finally:
                self.pool.release(conn)
            return result
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.pool.disconnect()

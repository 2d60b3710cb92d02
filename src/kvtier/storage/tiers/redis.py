"""The Redis/Valkey L2 tier, shared by several machines: one value per object, pipelined batches.

Key names are `f"{prefix}:{{{model_hex}.{salt_hex}}}:{world_size}.{worker_id}.{chunk_hash_hex}"`.
The `{...}` part is a Redis Cluster hash tag: every chunk of one model + cache salt lands in one
slot, so a batch for one request never crosses slots and `clear(model=..., cache_salt=...)`
scans one pattern. The trade-off: one model+salt cannot spread over several cluster nodes, so a
single very hot model concentrates on one shard (memory and bandwidth).

The value is the shared object header (see `format`) followed by the payload. GET and SET of
values go over the tier's own connection pool in hand-packed RESP (`_Wire`): a put sends the
header and the caller's payload as separate pieces of one bulk string (no join), and a get
receives the payload straight into the caller's buffer (no intermediate bytes object). redis-py
with hiredis copies a multi-MiB value two to three times per verb and was 4-6x slower than this.
Every other verb goes through redis-py.

When Redis is unreachable every verb counts `errors` and behaves as a miss / no-op, then skips
Redis for `cooldown` seconds (counted as `skipped`) so a dead server does not stall every
request; afterwards the connection pool reconnects by itself.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from typing_extensions import Buffer

from kvtier.config import redact_url
from kvtier.keys import ObjectKey
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.base import TierStats

logger = logging.getLogger(__name__)

_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}
_OPTIONS = {"prefix", "ttl", "connect_timeout", "timeout", "cooldown", "max_connections"}
_COUNTERS = (
    "hits",
    "misses",
    "corrupt",
    "errors",
    "skipped",
    "layout_mismatches",
    "size_mismatches",
    "puts",
    "bytes_written",
    "bytes_read",
)
_CLEAR_BATCH = 512
_WIRE_BUF = 64 << 10  # reply-line buffer of `_Wire`
_COALESCE = 64 << 10  # pieces smaller than this are joined before sending (fewer syscalls)
_T = TypeVar("_T")
GET_PIPELINE_BYTES = 1 << 20  # see get_many_into


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _byte_view(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class _Wire:
    """RESP replies read straight from a pooled connection's socket into the caller's buffers.

    redis-py (with hiredis) copies a multi-MiB value several times on both sides (measured 4-6x
    slower than the socket); this reader copies bulk replies straight into their destination.
    Only the tier's own bulk pool uses it, so the connection's parser never holds buffered data.
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

    def simple(self) -> bytes:
        """A status or integer reply; a Redis error reply raises ResponseError."""
        line = self.line()
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        if line[:1] not in (b"+", b":"):
            raise redis.ConnectionError(f"unexpected Redis reply {line[:40]!r}")
        return line[1:]

    def bulk_len(self) -> int:
        """The length of the next bulk reply, -1 for a nil one."""
        line = self.line()
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        if line[:1] == b"_":  # RESP3 null
            return -1
        if line[:1] != b"$":
            raise redis.ConnectionError(f"unexpected Redis reply {line[:40]!r}")
        return int(line[1:])

    @property
    def drained(self) -> bool:
        return self._pos == self._end


class RedisTier:
    """An L2 tier in the Redis or Valkey server at `url`, under key prefix `prefix`."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "kvtier",
        ttl: int | None = None,
        connect_timeout: float = 0.5,
        timeout: float = 1.0,
        cooldown: float = 1.0,
        max_connections: int = 16,
        name: str = "redis",
    ) -> None:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() not in _SCHEMES:
            raise ValueError(f"not a Redis/Valkey URL: {url!r} (schemes: {sorted(_SCHEMES)})")
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix must be non-empty and free of braces, got {prefix!r}")
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be a positive number of seconds or None, got {ttl}")
        if min(connect_timeout, timeout) <= 0 or cooldown < 0:
            raise ValueError(
                f"connect_timeout and timeout must be > 0 and cooldown >= 0, got "
                f"{connect_timeout}, {timeout}, {cooldown}"
            )
        self.name = name
        self.prefix = prefix
        self.ttl = ttl
        self.cooldown = cooldown
        self.url = f"{_SCHEMES[scheme.lower()]}://{rest}"
        self._pool = redis.ConnectionPool.from_url(
            self.url,
            socket_connect_timeout=connect_timeout,
            socket_timeout=timeout,
            max_connections=max_connections,
            # one immediate retry replaces a pooled connection that died with a restarted server
            retry=Retry(NoBackoff(), 1),
        )
        self._r = redis.Redis(connection_pool=self._pool)
        # GET and SET of values only, read by `_Wire`: its connections' parsers stay empty
        self._bulk_pool = redis.ConnectionPool.from_url(
            self.url,
            socket_connect_timeout=connect_timeout,
            socket_timeout=timeout,
            max_connections=max_connections,
        )
        self._lock = threading.Lock()
        self._n: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._down_until = 0.0

    @classmethod
    def from_url(cls, url: str) -> RedisTier:
        """A tier from "redis://host:port/db?prefix=kvtier&ttl=3600" (also rediss://, valkey://).

        Options: prefix, ttl (seconds), connect_timeout and timeout (seconds, socket timeouts),
        cooldown (seconds Redis is skipped after a failure), max_connections.
        """
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        unknown = set(query) - _OPTIONS
        if unknown:
            raise ValueError(f"unknown Redis tier URL options {sorted(unknown)} in {url!r}")
        kwargs: dict[str, Any] = {}
        try:
            if "prefix" in query:
                kwargs["prefix"] = query["prefix"]
            if query.get("ttl"):
                kwargs["ttl"] = int(query["ttl"])
            for opt in ("connect_timeout", "timeout", "cooldown"):
                if opt in query:
                    kwargs[opt] = float(query[opt])
            if "max_connections" in query:
                kwargs["max_connections"] = int(query["max_connections"])
        except ValueError as exc:
            raise ValueError(f"bad Redis tier URL option in {url!r}: {exc}") from None
        base = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode({}), ""))
        return cls(base, **kwargs)

    # -- naming and failure handling -----------------------------------------------------------

    def redis_key(self, key: ObjectKey) -> str:
        """The Redis key name of `key`."""
        return (
            f"{self.prefix}:{{{key.model.encode().hex()}.{key.cache_salt.encode().hex()}}}:"
            f"{key.world_size}.{key.worker_id}.{key.chunk_hash.hex()}"
        )

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] += n

    def _available(self) -> bool:
        """False while in the cool-down after a connection failure (counted as `skipped`)."""
        if time.monotonic() >= self._down_until:
            return True
        self._count("skipped")
        return False

    def _failed(self, what: str, exc: redis.RedisError) -> None:
        self._count("errors")
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
            was_up = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self.cooldown
            if was_up:
                logger.warning(
                    "redis tier %s unreachable on %s: %s", redact_url(self.url), what, exc
                )
        else:
            logger.warning("redis tier %s failed on %s: %s", redact_url(self.url), what, exc)

    # -- raw GET / SET ------------------------------------------------------------------------

    def _on_wire(self, op: Callable[[_Wire], _T]) -> _T:
        """Run `op` on a bulk-pool connection; socket failures become redis errors.

        A pooled connection that died (e.g. a restarted server) is retried once on a new one.
        After any failure the connection is dropped, since replies may be left unread.
        """
        for attempt in (0, 1):
            # connects; raises redis.ConnectionError (Any: redis-py leaves disconnect untyped)
            conn: Any = self._bulk_pool.get_connection()
            try:
                sock: socket.socket | None = getattr(conn, "_sock", None)
                if sock is None:
                    raise redis.ConnectionError("redis-py returned an unconnected connection")
                wire = _Wire(sock)
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
                self._bulk_pool.release(conn)
            return result
        raise AssertionError("unreachable")

    def _set_parts(self, key: ObjectKey, data: Buffer, layout: str) -> tuple[list[Buffer], int]:
        """The RESP pieces of `SET name header+payload [EX ttl]` and the value's length."""
        view = _byte_view(data)
        header = fmt.encode_header(key.to_str(), layout, view)
        name = self.redis_key(key).encode()
        n = len(header) + len(view)
        argc = 3 if self.ttl is None else 5
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (argc, len(name), name, n, header)
        if self.ttl is None:
            tail = b"\r\n"
        else:
            ttl = str(self.ttl).encode()
            tail = b"\r\n$2\r\nEX\r\n$%d\r\n%b\r\n" % (len(ttl), ttl)
        return [head, view, tail], n

    def _get_command(self, key: ObjectKey) -> bytes:
        name = self.redis_key(key).encode()
        return b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(name), name)

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: ObjectKey, data: Buffer, layout: str) -> None:
        """SET the object (with EX ttl when configured); a Redis failure is counted, not raised."""
        if not self._available():
            return
        parts, n = self._set_parts(key, data, layout)

        def op(wire: _Wire) -> None:
            wire.send(parts)
            wire.simple()

        try:
            self._on_wire(op)
        except redis.RedisError as exc:
            self._failed("put", exc)
            return
        with self._lock:
            self._n["puts"] += 1
            self._n["bytes_written"] += n

    def put_many(self, items: Sequence[tuple[ObjectKey, Buffer, str]]) -> int:
        """SET all objects in one pipeline; returns how many Redis accepted."""
        if not items or not self._available():
            return 0
        parts: list[Buffer] = []
        nbytes = 0
        for key, data, layout in items:
            item_parts, n = self._set_parts(key, data, layout)
            parts += item_parts
            nbytes += n

        def op(wire: _Wire) -> list[redis.ResponseError | None]:
            wire.send(parts)
            replies: list[redis.ResponseError | None] = []
            for _ in items:
                try:
                    wire.simple()
                    replies.append(None)
                except redis.ResponseError as exc:  # the reply was read whole: go on
                    replies.append(exc)
            return replies

        try:
            replies = self._on_wire(op)
        except redis.RedisError as exc:
            self._failed("put_many", exc)
            return 0
        written = sum(1 for r in replies if r is None)
        if written < len(items):
            self._failed("put_many", next(r for r in replies if r is not None))
        with self._lock:
            self._n["puts"] += written
            self._n["bytes_written"] += nbytes if written == len(items) else 0
        return written

    # -- reads ---------------------------------------------------------------------------------

    def _receive(
        self, wire: _Wire, key: ObjectKey, out: memoryview, layout: str
    ) -> fmt.Verdict | None:
        """Read one GET reply, its payload straight into `out`; None for a nil reply."""
        n = wire.bulk_len()
        if n < 0:
            return None
        text = key.to_str()
        hsize = fmt.header_size(text, layout)
        if n == hsize + len(out):
            head = bytearray(hsize)
            wire.read_into(memoryview(head))
            wire.read_into(out)
            wire.crlf()
            header = fmt.decode_header(head)
            if header is None:  # maybe a longer header of another layout: look past `head`
                header = fmt.decode_header(bytes(head) + bytes(out[: 2 * fmt.MAX_TEXT]))
        else:  # cannot be a hit; read it whole to tell a mismatch from corruption
            value = bytearray(n)
            wire.read_into(memoryview(value))
            wire.crlf()
            header = fmt.decode_header(value)
        verdict = fmt.judge(header, text, layout, len(out), n)
        if verdict is fmt.Verdict.OK:
            assert header is not None and header.size == hsize
            if fmt.digest(out) != header.digest:
                verdict = fmt.Verdict.CORRUPT
        return verdict

    def _settle(self, key: ObjectKey, verdict: fmt.Verdict | None, nbytes: int) -> bool:
        """Count a read's outcome and delete a corrupt object; True for a hit."""
        if verdict is fmt.Verdict.OK:
            with self._lock:
                self._n["hits"] += 1
                self._n["bytes_read"] += nbytes
            return True
        self._count("misses")
        if verdict is None:
            return False
        if verdict is fmt.Verdict.LAYOUT_MISMATCH:
            self._count("layout_mismatches")
        elif verdict is fmt.Verdict.SIZE_MISMATCH:
            self._count("size_mismatches")
        else:
            self._count("corrupt")
            logger.warning("redis tier: deleting corrupt object %s", self.redis_key(key))
            try:
                self._r.delete(self.redis_key(key))
            except redis.RedisError as exc:
                self._failed("delete corrupt", exc)
        return False

    def get_into(self, key: ObjectKey, out: memoryview, layout: str) -> bool:
        """GET the object, its payload straight into `out`, and check it."""
        return self._get_group([(key, out, layout)])[0]

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[bool]:
        """GET the objects in pipelines of at most `GET_PIPELINE_BYTES`, each payload straight
        into its buffer, then check them.

        Large values go one GET at a time: Redis answers a pipeline of several multi-MiB values
        by queueing all of them, measured 2x slower than fetching them one by one.
        """
        results: list[bool] = []
        group: list[tuple[ObjectKey, memoryview, str]] = []
        nbytes = 0
        for item in items:
            size = memoryview(item[1]).nbytes
            if group and nbytes + size > GET_PIPELINE_BYTES:
                results += self._get_group(group)
                group, nbytes = [], 0
            group.append(item)
            nbytes += size
        if group:
            results += self._get_group(group)
        return results

    def _get_group(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[bool]:
        if not self._available():
            self._count("misses", len(items))
            return [False] * len(items)
        jobs = [(key, _byte_view(out), layout) for key, out, layout in items]
        commands = [self._get_command(key) for key, _, _ in jobs]

        def op(wire: _Wire) -> list[fmt.Verdict | None]:
            wire.send(commands)
            return [self._receive(wire, key, out, layout) for key, out, layout in jobs]

        try:
            verdicts = self._on_wire(op)
        except redis.RedisError as exc:
            self._failed("get" if len(items) == 1 else "get_many", exc)
            self._count("misses", len(items))
            return [False] * len(items)
        return [
            self._settle(key, verdict, len(out))
            for (key, out, _), verdict in zip(jobs, verdicts, strict=True)
        ]

    # -- index verbs ---------------------------------------------------------------------------

    def contains(self, key: ObjectKey) -> bool:
        """EXISTS; False while Redis is unreachable."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """EXISTS for each key in one pipeline; all False while Redis is unreachable."""
        if not keys:
            return []
        if not self._available():
            return [False] * len(keys)
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.redis_key(key))
        try:
            return [bool(n) for n in pipe.execute()]
        except redis.RedisError as exc:
            self._failed("contains", exc)
            return [False] * len(keys)

    def delete(self, key: ObjectKey) -> bool:
        """DEL; False when absent or when Redis is unreachable."""
        if not self._available():
            return False
        try:
            return bool(self._r.delete(self.redis_key(key)))
        except redis.RedisError as exc:
            self._failed("delete", exc)
            return False

    def clear(self, *, model: str | None = None, cache_salt: str | None = None) -> int:
        """UNLINK this prefix's keys matching the filters, found by SCAN (never FLUSHDB)."""
        m = "*" if model is None else model.encode().hex()
        s = "*" if cache_salt is None else cache_salt.encode().hex()
        # hex has no '.', so "{m.s}" pins each filter to its own side of the dot
        pattern = f"{_glob_escape(self.prefix)}:{{{m}.{s}}}:*"
        removed = 0
        if not self._available():
            return 0
        try:
            batch: list[bytes] = []
            for name in self._r.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= _CLEAR_BATCH:
                    removed += int(self._r.unlink(*batch))
                    batch.clear()
            if batch:
                removed += int(self._r.unlink(*batch))
        except redis.RedisError as exc:
            self._failed("clear", exc)
        return removed

    def stats(self) -> TierStats:
        """Counters of this process, plus the server's used_memory as used_bytes, its
        maxmemory as capacity_bytes and the db's key count (all prefixes) as objects."""
        with self._lock:
            out: TierStats = dict(self._n)
        out.update(
            used_bytes=0, capacity_bytes=0, objects=0, url=redact_url(self.url), prefix=self.prefix
        )
        out["ttl"] = self.ttl or 0
        if time.monotonic() >= self._down_until:
            try:
                info = self._r.info("memory")
                out["used_bytes"] = int(info.get("used_memory", 0))
                out["capacity_bytes"] = int(info.get("maxmemory", 0))
                out["objects"] = int(self._r.dbsize())
            except redis.RedisError as exc:
                self._failed("stats", exc)
        return out

    def close(self) -> None:
        """Close every pooled connection."""
        self._pool.disconnect()
        self._bulk_pool.disconnect()

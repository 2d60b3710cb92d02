"""The Redis/Valkey L2 tier, shared by several machines: one value per object, pipelined batches.

Key names are `f"{prefix}:{{{model_hex}.{salt_hex}}}:{world_size}.{worker_id}.{chunk_hash_hex}"`.
The `{...}` part is a Redis Cluster hash tag: every chunk of one model + cache salt lands in one
slot, so a batch for one request never crosses slots and `clear(model=..., cache_salt=...)`
scans one pattern. The trade-off: one model+salt cannot spread over several cluster nodes, so a
single very hot model concentrates on one shard (memory and bandwidth).

The value is the shared object header (see `format`) followed by the payload. A put joins them
into one buffer (one copy); a get copies the payload into the caller's buffer (one copy).

When Redis is unreachable every verb counts `errors` and behaves as a miss / no-op, then skips
Redis for `cooldown` seconds (counted as `skipped`) so a dead server does not stall every
request; afterwards the connection pool reconnects by itself.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from typing_extensions import Buffer

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
GET_PIPELINE_BYTES = 1 << 20  # see get_many_into


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _byte_view(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


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
                logger.warning("redis tier %s unreachable on %s: %s", self.url, what, exc)
        else:
            logger.warning("redis tier %s failed on %s: %s", self.url, what, exc)

    # -- writes --------------------------------------------------------------------------------

    def _value(self, key: ObjectKey, data: Buffer, layout: str) -> bytes:
        view = _byte_view(data)
        return b"".join((fmt.encode_header(key.to_str(), layout, view), view))

    def put(self, key: ObjectKey, data: Buffer, layout: str) -> None:
        """SET the object (with EX ttl when configured); a Redis failure is counted, not raised."""
        if not self._available():
            return
        value = self._value(key, data, layout)
        try:
            self._r.set(self.redis_key(key), value, ex=self.ttl)
        except redis.RedisError as exc:
            self._failed("put", exc)
            return
        with self._lock:
            self._n["puts"] += 1
            self._n["bytes_written"] += len(value)

    def put_many(self, items: Sequence[tuple[ObjectKey, Buffer, str]]) -> int:
        """SET all objects in one pipeline; returns how many Redis accepted."""
        if not items or not self._available():
            return 0
        pipe = self._r.pipeline(transaction=False)
        nbytes = 0
        for key, data, layout in items:
            value = self._value(key, data, layout)
            nbytes += len(value)
            pipe.set(self.redis_key(key), value, ex=self.ttl)
        try:
            results = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            self._failed("put_many", exc)
            return 0
        written = sum(1 for r in results if r is True)
        if written < len(items):
            err = next((r for r in results if isinstance(r, redis.RedisError)), None)
            self._failed("put_many", err or redis.RedisError("SET not acknowledged"))
        with self._lock:
            self._n["puts"] += written
            self._n["bytes_written"] += nbytes if written == len(items) else 0
        return written

    # -- reads ---------------------------------------------------------------------------------

    def _deliver(self, key: ObjectKey, value: Any, out: memoryview, layout: str) -> bool:
        """Check `value` against the request and copy its payload into `out`; count the outcome."""
        if value is None:
            self._count("misses")
            return False
        out = _byte_view(out)
        text = key.to_str()
        raw = memoryview(value)
        header = fmt.decode_header(raw)
        verdict = fmt.judge(header, text, layout, len(out), len(raw))
        if verdict is fmt.Verdict.OK:
            assert header is not None
            payload = raw[header.size :]
            if fmt.digest(payload) == header.digest:
                out[:] = payload
                with self._lock:
                    self._n["hits"] += 1
                    self._n["bytes_read"] += len(out)
                return True
            verdict = fmt.Verdict.CORRUPT
        self._count("misses")
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
        """GET the object and copy its checked payload into `out`."""
        if not self._available():
            self._count("misses")
            return False
        try:
            value = self._r.get(self.redis_key(key))
        except redis.RedisError as exc:
            self._failed("get", exc)
            self._count("misses")
            return False
        return self._deliver(key, value, out, layout)

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[bool]:
        """GET the objects in pipelines of at most `GET_PIPELINE_BYTES`, then check and copy each.

        Large values go one GET at a time: redis-py parses a pipeline reply of several
        multi-MiB values much slower than the same values fetched one by one (measured 2x).
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

    def _get_group(self, items: list[tuple[ObjectKey, memoryview, str]]) -> list[bool]:
        if len(items) == 1:
            return [self.get_into(*items[0])]
        if not self._available():
            self._count("misses", len(items))
            return [False] * len(items)
        pipe = self._r.pipeline(transaction=False)
        for key, _, _ in items:
            pipe.get(self.redis_key(key))
        try:
            values = pipe.execute()
        except redis.RedisError as exc:
            self._failed("get_many", exc)
            self._count("misses", len(items))
            return [False] * len(items)
        return [
            self._deliver(key, value, out, layout)
            for (key, out, layout), value in zip(items, values, strict=True)
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
        out.update(used_bytes=0, capacity_bytes=0, objects=0, url=self.url, prefix=self.prefix)
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

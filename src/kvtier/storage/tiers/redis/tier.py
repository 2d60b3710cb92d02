"""`RedisTier`: the L2 tier in one Redis or Valkey server."""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.keys import ObjectKey
from kvtier.redaction import redact
from kvtier.storage.observers import StorageObserver
from kvtier.storage.tiers.base import TierStats
from kvtier.storage.tiers.options import parse_url
from kvtier.storage.tiers.redis.clearing import glob_escape, scan_unlink
from kvtier.storage.tiers.redis.options import OPTIONS, check_options
from kvtier.storage.tiers.redis.verbs import RespTier
from kvtier.storage.tiers.redis_watch import KeyEventWatch
from kvtier.storage.tiers.resp import Node

_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}


class RedisTier(RespTier):
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
        codec: str = "none",
    ) -> None:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() not in _SCHEMES:
            raise ValueError(
                f"not a Redis/Valkey URL: {redact(url)!r} (schemes: {sorted(_SCHEMES)})"
            )
        check_options(prefix, ttl, connect_timeout, timeout, cooldown)
        self._init_common(name, prefix, ttl, codec)
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
        # object verbs only, read by `Wire`: its connections' parsers stay empty
        bulk = redis.ConnectionPool.from_url(
            self.url,
            socket_connect_timeout=connect_timeout,
            socket_timeout=timeout,
            max_connections=max_connections,
        )
        kw = bulk.connection_kwargs
        self._node = Node(f"{kw.get('host', '')}:{kw.get('port', '')}", bulk, cooldown)
        self._db = int(kw.get("db", 0) or 0)
        self._connect_timeout = connect_timeout
        self._watch: KeyEventWatch | None = None

    @property
    def watch(self) -> KeyEventWatch | None:
        """The follower of the server's own removals (None until `observe`)."""
        return self._watch

    def observe(self, observer: StorageObserver) -> None:
        """Report corrupt deletes, and the server's expiries and evictions of this prefix's
        objects (see `redis_watch`), to `observer` from now on."""
        super().observe(observer)
        if self._watch is None:
            self._watch = KeyEventWatch(
                self.url,
                self._db,
                self.name,
                self.object_key,
                observer,
                connect_timeout=self._connect_timeout,
            )

    def object_key(self, name: bytes) -> ObjectKey | None:
        """The object a key name of this tier names (`redis_key`'s inverse); None for others."""
        head = f"{self.prefix}:{{".encode()
        if not name.startswith(head):
            return None
        try:
            tag, _, rest = name[len(head) :].decode("ascii").partition("}:")
            model, _, salt = tag.partition(".")
            world_size, worker_id, chunk_hash = rest.split(".")
            return ObjectKey(
                bytes.fromhex(model).decode(),
                bytes.fromhex(salt).decode(),
                int(world_size),
                int(worker_id),
                bytes.fromhex(chunk_hash),
            )
        except (UnicodeDecodeError, ValueError):
            return None

    @classmethod
    def from_url(cls, url: str) -> RedisTier:
        """A tier from "redis://host:port/db?prefix=kvtier&ttl=3600" (also rediss://, valkey://).

        Options: prefix, ttl (seconds), connect_timeout and timeout (seconds, socket timeouts),
        cooldown (seconds a failed server is skipped), max_connections, codec (none, zstd,
        fp8: how new objects are stored, see `codecs`).
        """
        parts, kwargs = parse_url(url, OPTIONS, tier="Redis")
        return cls(parts._replace(query="", fragment="").geturl(), **kwargs)

    def redis_key(self, key: ObjectKey) -> str:
        """The Redis key name of `key`."""
        return (
            f"{self.prefix}:{{{key.model.encode().hex()}.{key.cache_salt.encode().hex()}}}:"
            f"{key.world_size}.{key.worker_id}.{key.chunk_hash.hex()}"
        )

    def _route(self, name: bytes) -> Node | None:
        """The node that serves `name` (None when none is known)."""
        return self._node

    def clear_pattern(self, model: str | None, cache_salt: str | None) -> str:
        """The SCAN MATCH pattern of this prefix's keys of `model` and `cache_salt`."""
        m = "*" if model is None else model.encode().hex()
        s = "*" if cache_salt is None else cache_salt.encode().hex()
        # hex has no '.', so "{m.s}" pins each filter to its own side of the dot
        return f"{glob_escape(self.prefix)}:{{{m}.{s}}}:*"

    def clear(self, *, model: str | None = None, cache_salt: str | None = None) -> int:
        """UNLINK this prefix's keys matching the filters, found by SCAN (never FLUSHDB)."""
        if not self._node.available:
            self._counters.add("skipped")
            return 0
        pattern = self.clear_pattern(model, cache_salt)
        try:
            return scan_unlink(self._r, pattern, one_by_one=False)
        except redis.RedisError as exc:
            self._failed("clear", self._node, exc)
            return 0

    def stats(self) -> TierStats:
        """Counters of this process, plus the server's key count, used_memory and maxmemory."""
        figures = (0, 0, 0)
        if self._node.available:
            try:
                figures = self.server_figures(self._r)
            except redis.RedisError as exc:
                self._failed("stats", self._node, exc)
        return self._counters.snapshot(
            name=self.name,
            kind=self.kind,
            url=redact(self.url),
            objects=figures[0],
            used_bytes=figures[1],
            capacity_bytes=figures[2],
            healthy=self._node.available,
            extra={
                "ttl": self.ttl or 0,
                "removals_watched": int(self._watch is not None and self._watch.watching),
            },
            codec=self._codec.stats(),
        )

    def close(self) -> None:
        """Close every pooled connection and the fan-out and watch threads."""
        if self._watch is not None:
            self._watch.close()
        self._shutdown()
        self._pool.disconnect()
        self._node.close()

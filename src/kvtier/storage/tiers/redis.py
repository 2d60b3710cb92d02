"""The Redis/Valkey L2 tier, shared by several machines: one value per object, pipelined batches.

Key names are `f"{prefix}:{{{model_hex}.{salt_hex}}}:{world_size}.{worker_id}.{chunk_hash_hex}"`.
The `{...}` part is a Redis Cluster hash tag: on a single server it only groups names; the
cluster tier (`redis_cluster`) lays keys out differently, so that one model spreads over every
node. The value is the shared object header (see `format`) followed by the payload.

GET, SET, EXISTS and DEL of objects go over the node's own pool in hand-packed RESP (`resp.Wire`,
no copies of values); SCAN, UNLINK and INFO go through redis-py. The batch engine here
(`_batch`) groups names by node and follows cluster redirects; on a single server there is one
node and a redirect is an error.

Removals the tier makes itself (a corrupt object deleted on read) are reported to the observer
the tier manager hands it; the server's own (TTL expiry, maxmemory eviction) are followed through
its keyspace notifications by `redis_watch` (single server only: a cluster's are not followed).

When Redis is unreachable every verb counts `errors` and behaves as a miss / no-op, then skips
the node for `cooldown` seconds (counted as `skipped`) so a dead server does not stall every
request; afterwards the connection pool reconnects by itself.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from typing_extensions import Buffer

from kvtier.keys import ObjectKey
from kvtier.redaction import redact
from kvtier.storage.observers import NO_OBSERVER, Removal, StorageObserver
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.accounting import TierCounters
from kvtier.storage.tiers.base import TierStats
from kvtier.storage.tiers.codecs import TierCodec, parse_codec
from kvtier.storage.tiers.options import PARSERS, parse_url
from kvtier.storage.tiers.redis_watch import KeyEventWatch
from kvtier.storage.tiers.resp import Node, Redirect, Wire, command, set_parts

logger = logging.getLogger(__name__)

_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss"}
#: URL query options of both Redis tiers -> parser
OPTIONS = {
    "prefix": PARSERS["str"],
    "ttl": PARSERS["optional_int"],
    "connect_timeout": PARSERS["seconds"],
    "timeout": PARSERS["seconds"],
    "cooldown": PARSERS["seconds"],
    "max_connections": PARSERS["int"],
    "codec": parse_codec,
}
_EXTRA = ("skipped", "redirects", "refreshes")
_CLEAR_BATCH = 512
_ASKING = command(b"ASKING")
GET_PIPELINE_BYTES = 1 << 20  # see get_many_into
_R = TypeVar("_R")


def glob_escape(text: str) -> str:
    """`text` with SCAN MATCH's special characters escaped."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def check_options(
    prefix: str, ttl: int | None, connect_timeout: float, timeout: float, cooldown: float
) -> None:
    """Raise ValueError for option values neither Redis tier accepts."""
    if not prefix or "{" in prefix or "}" in prefix:
        raise ValueError(f"prefix must be non-empty and free of braces, got {prefix!r}")
    if ttl is not None and ttl <= 0:
        raise ValueError(f"ttl must be a positive number of seconds or None, got {ttl}")
    if min(connect_timeout, timeout) <= 0 or cooldown < 0:
        raise ValueError(
            f"connect_timeout and timeout must be > 0 and cooldown >= 0, got "
            f"{connect_timeout}, {timeout}, {cooldown}"
        )


def scan_unlink(client: redis.Redis, pattern: str, *, one_by_one: bool) -> int:
    """UNLINK the keys of `client`'s server matching `pattern`, found by SCAN (never FLUSHDB).

    `one_by_one` sends one UNLINK per key (pipelined): a cluster refuses multi-key commands
    across slots.
    """
    removed = 0
    batch: list[bytes] = []

    def flush() -> int:
        if not one_by_one:
            return int(client.unlink(*batch))
        pipe = client.pipeline(transaction=False)
        for name in batch:
            pipe.unlink(name)
        return sum(int(n) for n in pipe.execute())

    for name in client.scan_iter(match=pattern, count=1000):
        batch.append(name)
        if len(batch) >= _CLEAR_BATCH:
            removed += flush()
            batch.clear()
    if batch:
        removed += flush()
    return removed


class RespTier:
    """What both Redis tiers share: object verbs over `resp.Wire`, batched per node, with
    cluster redirects followed. Subclasses name keys, route names to nodes, clear and report.
    """

    kind = "redis"
    shared = True  # every server with the URL reads it
    name: str
    prefix: str
    ttl: int | None
    _counters: TierCounters
    _executor: ThreadPoolExecutor | None
    _observer: StorageObserver
    _codec: TierCodec

    def _init_common(self, name: str, prefix: str, ttl: int | None, codec: str) -> None:
        self.name = name
        self.prefix = prefix
        self.ttl = ttl
        self._codec = TierCodec(codec)
        self._counters = TierCounters(logger, _EXTRA)
        self._executor = None
        self._observer = NO_OBSERVER

    def observe(self, observer: StorageObserver) -> None:
        """Report the corrupt objects this tier deletes to `observer` from now on."""
        self._observer = observer

    def redis_key(self, key: ObjectKey) -> str:
        """The Redis key name of `key`."""
        raise NotImplementedError

    def _route(self, name: bytes) -> Node | None:
        """The node that serves `name` (None when none is known)."""
        raise NotImplementedError

    def _follow(self, redirect: Redirect) -> Node | None:
        """The node a redirect points to (None: not followed, counted as an error)."""
        self._counters.failed("redirect", f"unexpected {redirect} from a single Redis server")
        return None

    def _node_failed(self, node: Node) -> None:
        """A node failed on the connection, or was skipped in its cool-down (the cluster tier
        refreshes its topology)."""

    # -- the batch engine -----------------------------------------------------------------------

    def _failed(self, what: str, node: Node, exc: redis.RedisError) -> None:
        if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
            node.mark_down()
            self._counters.failed(what, f"{self.kind} node {node.address} unreachable: {exc}")
            self._node_failed(node)
        else:
            self._counters.failed(what, f"{self.kind} node {node.address} failed: {exc}")

    def _fan_out(self, calls: list[Callable[[], None]]) -> None:
        """Run per-node calls, concurrently when there are several (one thread per node)."""
        if len(calls) == 1:
            calls[0]()
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(16, thread_name_prefix=f"kvtier-{self.name}")
        for future in [self._executor.submit(c) for c in calls]:
            future.result()

    def _batch(
        self,
        what: str,
        names: Sequence[bytes],
        send: Callable[[int], list[Buffer]],
        read: Callable[[Wire, int], _R | Redirect],
        sizes: Sequence[int] | None = None,
    ) -> list[_R | None]:
        """Send `send(i)` for every name to the node serving it, pipelined per node (in groups of
        at most GET_PIPELINE_BYTES of `sizes` when given), and read `read(wire, i)` back.

        MOVED and ASK replies are followed (twice at most); an item whose node is down, in its
        cool-down, or answered an error gets None (errors and skips are counted).
        """
        results: list[_R | None] = [None] * len(names)
        pending = list(range(len(names)))
        asking: dict[int, Node] = {}
        for _ in range(3):
            groups: dict[str, tuple[Node, list[int]]] = {}
            for i in pending:
                node = asking.get(i) or self._route(names[i])
                if node is None:
                    continue
                if not node.available:
                    self._counters.add("skipped")
                    self._node_failed(node)
                    continue
                groups.setdefault(node.address, (node, []))[1].append(i)
            redirects: list[tuple[int, Redirect]] = []
            self._fan_out(
                [
                    functools.partial(
                        self._on_node,
                        what,
                        node,
                        idxs,
                        asking,
                        send,
                        read,
                        results,
                        redirects,
                        sizes,
                    )
                    for node, idxs in groups.values()
                ]
            )
            if not redirects:
                break
            self._counters.add("redirects", len(redirects))
            pending, asking = [], {}
            for i, redirect in redirects:
                target = self._follow(redirect)
                if target is not None:
                    pending.append(i)
                    if redirect.ask:
                        asking[i] = target
        return results

    def _on_node(
        self,
        what: str,
        node: Node,
        idxs: list[int],
        asking: dict[int, Node],
        send: Callable[[int], list[Buffer]],
        read: Callable[[Wire, int], _R | Redirect],
        results: list[_R | None],
        redirects: list[tuple[int, Redirect]],
        sizes: Sequence[int] | None,
    ) -> None:
        """`_batch`'s pipelines on one node, one after another; fills `results` and
        `redirects`. A connection failure ends the node's share of the batch."""
        for part in self._split(idxs, sizes):
            if not self._pipeline(what, node, part, asking, send, read, results, redirects):
                return

    def _pipeline(
        self,
        what: str,
        node: Node,
        part: list[int],
        asking: dict[int, Node],
        send: Callable[[int], list[Buffer]],
        read: Callable[[Wire, int], _R | Redirect],
        results: list[_R | None],
        redirects: list[tuple[int, Redirect]],
    ) -> bool:

        def op(wire: Wire) -> list[_R | Redirect | redis.ResponseError]:
            pieces: list[Buffer] = []
            for i in part:
                if i in asking:
                    pieces.append(_ASKING)
                pieces += send(i)
            wire.send(pieces)
            got: list[_R | Redirect | redis.ResponseError] = []
            for i in part:
                try:
                    if i in asking:
                        wire.simple()
                    got.append(read(wire, i))
                except redis.ResponseError as exc:  # the reply was read whole: go on
                    got.append(exc)
            return got

        try:
            replies = node.run(op)
        except redis.RedisError as exc:
            self._failed(what, node, exc)
            return False
        for i, reply in zip(part, replies, strict=True):
            if isinstance(reply, Redirect):
                redirects.append((i, reply))
            elif isinstance(reply, redis.ResponseError):
                self._failed(what, node, reply)
            else:
                results[i] = reply
        return True

    @staticmethod
    def _split(idxs: list[int], sizes: Sequence[int] | None) -> list[list[int]]:
        if sizes is None:
            return [idxs]
        parts: list[list[int]] = []
        part: list[int] = []
        nbytes = 0
        for i in idxs:
            if part and nbytes + sizes[i] > GET_PIPELINE_BYTES:
                parts.append(part)
                part, nbytes = [], 0
            part.append(i)
            nbytes += sizes[i]
        if part:
            parts.append(part)
        return parts

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: ObjectKey, data: Buffer, layout: str, *, resumable: bool = True) -> None:
        """SET the object (with EX ttl when configured); a Redis failure is counted, not raised."""
        self.put_many([(key, data, layout)], unresumable=() if resumable else (key,))

    def put_many(
        self,
        items: Sequence[tuple[ObjectKey, Buffer, str]],
        *,
        unresumable: Collection[ObjectKey] = (),
    ) -> int:
        """SET all objects, one pipeline per node; returns how many Redis accepted."""
        if not items:
            return 0
        names = [self.redis_key(key).encode() for key, _, _ in items]
        prepared = [self._codec.prepare(fmt.byte_view(data), layout) for _, data, layout in items]
        views = [p.payload for p in prepared]
        headers = [
            self._codec.header(key.to_str(), layout, p, resumable=key not in unresumable)
            for (key, _, layout), p in zip(items, prepared, strict=True)
        ]

        def send(i: int) -> list[Buffer]:
            return set_parts(names[i], headers[i], views[i], self.ttl)

        def read(wire: Wire, i: int) -> bool | Redirect:
            reply = wire.simple()
            return reply if isinstance(reply, Redirect) else True

        with self._counters.timed("write", len(items)):
            done = self._batch("put", names, send, read)
        written = [i for i, ok in enumerate(done) if ok]
        self._counters.wrote(len(written), sum(len(headers[i]) + len(views[i]) for i in written))
        return len(written)

    # -- reads ---------------------------------------------------------------------------------

    def _receive(
        self, wire: Wire, key: ObjectKey, out: memoryview, layout: str
    ) -> fmt.Verdict | Redirect | None:
        """Read one GET reply, its payload straight into `out` (a coded object's decoded into
        it); None for a nil reply."""
        n = wire.bulk_len()
        if isinstance(n, Redirect):
            return n
        if n < 0:
            return None
        text = key.to_str()
        hsize = fmt.header_size(text, layout)
        payload_digest: bytes | None = None
        if n == hsize + len(out):
            head = bytearray(hsize)
            wire.read_into(memoryview(head))
            payload_digest = fmt.read_hashed(out, lambda block, _: wire.read_into(block))
            wire.crlf()
            header = fmt.decode_split_header(head, out)
        else:  # not plain: read it whole to decode it or tell a mismatch from corruption
            value = bytearray(n)
            wire.read_into(memoryview(value))
            wire.crlf()
            return self._codec.read_whole(memoryview(value), text, layout, out)
        return fmt.verify(header, text, layout, out, n, payload_digest)

    def get_into(self, key: ObjectKey, out: memoryview, layout: str) -> fmt.Hit:
        """GET the object, its payload straight into `out`, and check it."""
        return self.get_many_into([(key, out, layout)])[0]

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[fmt.Hit]:
        """GET the objects, per node in pipelines of at most `GET_PIPELINE_BYTES`, each payload
        straight into its buffer, then check them.

        Large values go one GET at a time: Redis answers a pipeline of several multi-MiB values
        by queueing all of them, measured 2x slower than fetching them one by one.
        """
        if not items:
            return []
        jobs = [(key, fmt.byte_view(out), layout) for key, out, layout in items]
        names = [self.redis_key(key).encode() for key, _, _ in jobs]

        def send(i: int) -> list[Buffer]:
            return [command(b"GET", names[i])]

        def read(wire: Wire, i: int) -> fmt.Verdict | Redirect | None:
            key, out, layout = jobs[i]
            return self._receive(wire, key, out, layout)

        with self._counters.timed("read", len(jobs)):
            verdicts = self._batch("get", names, send, read, [len(out) for _, out, _ in jobs])
        hits = []
        for (key, out, _), verdict in zip(jobs, verdicts, strict=True):
            hits.append(self._counters.settle(verdict, len(out)))
            if verdict is fmt.Verdict.CORRUPT:
                self._counters.warn("corrupt", f"{self.kind} tier: deleting corrupt {key}")
                self._delete_names([self.redis_key(key).encode()])
                self._observer.removed((key.chunk,), self.name, Removal.CORRUPT)
        return hits

    # -- index verbs ---------------------------------------------------------------------------

    def _int_replies(self, what: str, verb: bytes, names: Sequence[bytes]) -> list[int]:
        def send(i: int) -> list[Buffer]:
            return [command(verb, names[i])]

        def read(wire: Wire, i: int) -> int | Redirect:
            reply = wire.simple()
            return reply if isinstance(reply, Redirect) else int(reply)

        return [r or 0 for r in self._batch(what, names, send, read)]

    def _delete_names(self, names: Sequence[bytes]) -> int:
        return sum(self._int_replies("delete", b"DEL", names))

    def contains(self, key: ObjectKey) -> bool:
        """EXISTS; False while Redis is unreachable."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """EXISTS for each key, one pipeline per node; False where the node is unreachable."""
        names = [self.redis_key(key).encode() for key in keys]
        return [bool(n) for n in self._int_replies("contains", b"EXISTS", names)]

    def delete(self, key: ObjectKey) -> bool:
        """DEL; False when absent or when Redis is unreachable."""
        return bool(self._delete_names([self.redis_key(key).encode()]))

    @staticmethod
    def server_figures(client: redis.Redis) -> tuple[int, int, int]:
        """(objects, used_bytes, capacity_bytes) of one server: its db's key count (all
        prefixes), used_memory and maxmemory."""
        info: dict[str, Any] = client.info("memory")
        return (
            int(client.dbsize()),
            int(info.get("used_memory", 0)),
            int(info.get("maxmemory", 0)),
        )

    def _shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


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

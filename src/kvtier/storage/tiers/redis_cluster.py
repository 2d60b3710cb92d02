"""The Redis/Valkey Cluster L2 tier: one model's chunks spread over every slot and master.

Key names are `f"{prefix}:{model_hex}.{salt_hex}:{{{chunk_hash_hex}}}:{world_size}.{worker_id}"`:
the hash tag is the chunk hash, so the chunks of one model + salt spread evenly over the 16384
slots (and so over all masters), while the ranks of one chunk share a slot. Model and salt stay
in the name, so `clear(model=..., cache_salt=...)` is a SCAN MATCH on every master. The
single-server tier's `{model.salt}` tag would put a whole model on one node.

Topology comes from redis-py's `RedisCluster` (seed nodes from the URL, the rest discovered); the
object verbs go per node through `RespTier`'s batch engine, pipelined per node and to several
nodes at once. The tier follows the cluster by itself:

- `MOVED slot host:port`: the slot's owner is updated at once and the command sent there; a full
  topology refresh follows (at most one per `refresh_interval`).
- `ASK slot host:port` (a slot being migrated): the command goes to the target after `ASKING`.
- a master that fails: its node is skipped for `cooldown` seconds (its slots are misses, counted
  as `skipped`, never errors to clients), and the topology is refreshed until the cluster has
  promoted a replica; then its slots are served by the new master.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from kvtier.keys import ObjectKey
from kvtier.redaction import redact
from kvtier.storage.tiers.base import TierStats
from kvtier.storage.tiers.options import PARSERS, parse_url
from kvtier.storage.tiers.redis.clearing import glob_escape, scan_unlink
from kvtier.storage.tiers.redis.options import OPTIONS as REDIS_OPTIONS
from kvtier.storage.tiers.redis.options import check_options
from kvtier.storage.tiers.redis.verbs import RespTier
from kvtier.storage.tiers.resp import Node, Redirect

logger = logging.getLogger(__name__)

SLOTS = 16384
_SCHEMES = {
    "redis+cluster": False,
    "valkey+cluster": False,
    "rediss+cluster": True,
    "valkeys+cluster": True,
}
#: URL query options -> parser (the Redis tier's, plus how often the topology may be refreshed)
OPTIONS = {**REDIS_OPTIONS, "refresh_interval": PARSERS["seconds"]}


def parse_seeds(netloc: str) -> tuple[str | None, str | None, list[tuple[str, int]]]:
    """(username, password, [(host, port)...]) of "user:pw@h1:7000,h2:7000" (port 6379 when
    omitted; IPv6 hosts in brackets)."""
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = user or None
        password = pw if colon else None
    seeds: list[tuple[str, int]] = []
    for item in hosts.split(","):
        item = item.strip()
        if not item:
            continue
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port_text = rest.removeprefix(":")
        else:
            host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
        try:
            port = int(port_text) if port_text else 6379
        except ValueError:
            raise ValueError(f"bad port in cluster seed node {item!r}") from None
        seeds.append((host, port))
    if not seeds:
        raise ValueError("a cluster URL needs at least one seed node: redis+cluster://host:port")
    return username, password, seeds


class RedisClusterTier(RespTier):
    """An L2 tier in the Redis or Valkey Cluster reached through `seeds`, under `prefix`."""

    kind = "redis+cluster"

    def __init__(
        self,
        seeds: list[tuple[str, int]],
        *,
        username: str | None = None,
        password: str | None = None,
        tls: bool = False,
        prefix: str = "kvtier",
        ttl: int | None = None,
        connect_timeout: float = 0.5,
        timeout: float = 1.0,
        cooldown: float = 1.0,
        max_connections: int = 16,
        refresh_interval: float = 0.25,
        name: str = "redis-cluster",
        codec: str = "none",
    ) -> None:
        if not seeds:
            raise ValueError("a cluster tier needs at least one seed node")
        check_options(prefix, ttl, connect_timeout, timeout, cooldown)
        if refresh_interval < 0:
            raise ValueError(f"refresh_interval must be >= 0 seconds, got {refresh_interval}")
        self._init_common(name, prefix, ttl, codec)
        self.seeds = list(seeds)
        self.cooldown = cooldown
        self.refresh_interval = refresh_interval
        scheme = "rediss+cluster" if tls else "redis+cluster"
        auth = f"{username or ''}:***@" if password else (f"{username}@" if username else "")
        self.url = f"{scheme}://{auth}{','.join(f'{h}:{p}' for h, p in seeds)}"
        self._conn_kwargs: dict[str, Any] = {
            "username": username,
            "password": password,
            "socket_connect_timeout": connect_timeout,
            "socket_timeout": timeout,
        }
        self._max_connections = max_connections
        self._tls = tls
        self._rc: RedisCluster | None = None  # made once, by the first refresh that reaches it
        self._nodes: dict[str, Node] = {}
        self._admin: dict[str, redis.Redis] = {}  # SCAN, UNLINK, INFO per master
        self._admin_lock = threading.Lock()  # one admin client per master, made once
        self._closed = False  # close() ran: nothing opens a connection any more
        self._slots: list[Node | None] = [None] * SLOTS
        self._topology_lock = threading.Lock()  # one refresh at a time; never held across I/O
        self._refreshing = threading.Lock()
        self._refresh_after = float("-inf")  # no refresh before this monotonic time
        self._refresh()

    @classmethod
    def from_url(cls, url: str) -> RedisClusterTier:
        """A tier from "redis+cluster://[user:password@]host:port,host2:port/?prefix=kvtier&ttl=86400"
        (also valkey+cluster://, and rediss+cluster:// or valkeys+cluster:// for TLS).

        The hosts are seed nodes: the rest of the cluster is discovered. Options: those of the
        Redis tier (prefix, ttl, connect_timeout, timeout, cooldown, max_connections, codec) plus
        refresh_interval (seconds between topology refreshes, 0.25 by default).
        """
        parts, options = parse_url(url, OPTIONS, tier="Redis Cluster")
        scheme = parts.scheme.lower()
        if scheme not in _SCHEMES:
            raise ValueError(f"not a cluster URL: {redact(url)!r} (schemes: {list(_SCHEMES)})")
        if parts.path not in ("", "/"):
            raise ValueError(
                f"a cluster has no databases: drop {parts.path!r} from {redact(url)!r}"
            )
        username, password, seeds = parse_seeds(parts.netloc)
        return cls(seeds, username=username, password=password, tls=_SCHEMES[scheme], **options)

    # -- naming and routing --------------------------------------------------------------------

    def redis_key(self, key: ObjectKey) -> str:
        """The key name of `key`: hash-tagged by chunk, so a model spreads over all slots."""
        return (
            f"{self.prefix}:{key.model.encode().hex()}.{key.cache_salt.encode().hex()}:"
            f"{{{key.chunk_hash.hex()}}}:{key.world_size}.{key.worker_id}"
        )

    def clear_pattern(self, model: str | None, cache_salt: str | None) -> str:
        """The SCAN MATCH pattern of this prefix's keys of `model` and `cache_salt`."""
        m = "*" if model is None else model.encode().hex()
        s = "*" if cache_salt is None else cache_salt.encode().hex()
        # hex has no '.' or ':', and the only '.' followed by "<salt>:" is the model/salt one
        return f"{glob_escape(self.prefix)}:{m}.{s}:*"

    def _node_at(self, address: str) -> Node:
        with self._topology_lock:
            node = self._nodes.get(address)
            if node is None:
                host, _, port = address.rpartition(":")
                kwargs = dict(self._conn_kwargs)
                if self._tls:
                    kwargs["connection_class"] = redis.SSLConnection
                pool = redis.ConnectionPool(
                    host=host.strip("[]"),
                    port=int(port),
                    max_connections=self._max_connections,
                    **kwargs,
                )
                node = self._nodes[address] = Node(address, pool, self.cooldown)
            return node

    def _route(self, name: bytes) -> Node | None:
        node = self._slots[key_slot(name)]
        if node is None:
            self._maybe_refresh()
            node = self._slots[key_slot(name)]
        return node

    def _follow(self, redirect: Redirect) -> Node | None:
        node = self._node_at(redirect.address)
        if not redirect.ask:  # the slot moved for good
            self._slots[redirect.slot] = node
            self._maybe_refresh()
        return node

    def _node_failed(self, node: Node) -> None:
        self._maybe_refresh()

    # -- topology ------------------------------------------------------------------------------

    def _maybe_refresh(self) -> None:
        if time.monotonic() >= self._refresh_after:
            self._refresh()

    def _refresh(self) -> bool:
        """Re-read the slot map through RedisCluster (one caller at a time, others go on with
        the old map); False when no node answered, and then no new try for `cooldown` seconds,
        so an unreachable cluster does not stall every call on connection attempts."""
        if not self._refreshing.acquire(blocking=False):
            return False
        try:
            if self._closed:
                return False
            self._refresh_after = time.monotonic() + self.refresh_interval
            self._counters.add("refreshes")
            try:
                if self._rc is None:
                    self._rc = RedisCluster(
                        startup_nodes=[ClusterNode(h, p) for h, p in self.seeds],  # type: ignore[no-untyped-call]
                        require_full_coverage=False,
                        ssl=self._tls,
                        **self._conn_kwargs,
                    )
                else:
                    self._rc.nodes_manager.initialize()
                slots_cache: dict[int, list[ClusterNode]] = self._rc.nodes_manager.slots_cache
            except (RedisClusterException, redis.RedisError) as exc:
                self._refresh_after = time.monotonic() + max(self.refresh_interval, self.cooldown)
                self._counters.failed("topology", f"redis cluster {self.url}: {exc}")
                return False
            table: list[Node | None] = [None] * SLOTS
            owners: dict[str, Node] = {}
            for slot, nodes in slots_cache.items():
                if nodes:
                    name = nodes[0].name
                    if name not in owners:
                        owners[name] = self._node_at(name)
                    table[slot] = owners[name]
            self._slots = table
            return True
        finally:
            self._refreshing.release()

    def masters(self) -> list[Node]:
        """The nodes that own at least one slot now."""
        seen: dict[str, Node] = {}
        for node in self._slots:
            if node is not None:
                seen.setdefault(node.address, node)
        return list(seen.values())

    def _clients(self) -> list[tuple[Node, redis.Redis]]:
        """A redis-py client per master (kept between calls: /metrics asks for stats often)."""
        out = []
        masters = self.masters()
        with self._admin_lock:  # no I/O here: a client connects on its first command
            if self._closed:
                return []  # a closed tier answers from its counters alone
            for node in masters:
                client = self._admin.get(node.address)
                if client is None:
                    kw = node.pool.connection_kwargs
                    kwargs = dict(self._conn_kwargs)
                    if self._tls:
                        kwargs["ssl"] = True
                    client = self._admin[node.address] = redis.Redis(
                        host=kw["host"], port=kw["port"], **kwargs
                    )
                out.append((node, client))
        return out

    # -- admin verbs ---------------------------------------------------------------------------

    def clear(self, *, model: str | None = None, cache_salt: str | None = None) -> int:
        """UNLINK this prefix's keys matching the filters on every master (SCAN on each one)."""
        pattern = self.clear_pattern(model, cache_salt)
        removed = 0
        for node, client in self._clients():
            if not node.available:
                self._counters.add("skipped")
                continue
            try:
                removed += scan_unlink(client, pattern, one_by_one=True)
            except redis.RedisError as exc:
                self._failed("clear", node, exc)
        return removed

    def stats(self) -> TierStats:
        """Counters of this process, plus the masters' key counts, used_memory and maxmemory
        summed; `extra` has the number of masters, those in cool-down and uncovered slots."""
        objects = used = capacity = 0
        masters = self._clients()
        down = 0
        for node, client in masters:
            if not node.available:
                down += 1
                continue
            try:
                n, u, c = self.server_figures(client)
            except redis.RedisError as exc:
                self._failed("stats", node, exc)
                down += 1
                continue
            objects, used, capacity = objects + n, used + u, capacity + c
        uncovered = sum(1 for node in self._slots if node is None)
        return self._counters.snapshot(
            name=self.name,
            kind=self.kind,
            url=self.url,
            objects=objects,
            used_bytes=used,
            capacity_bytes=capacity,
            healthy=down == 0 and uncovered == 0,
            extra={
                "ttl": self.ttl or 0,
                "masters": len(masters),
                "masters_down": down,
                "uncovered_slots": uncovered,
            },
            codec=self._codec.stats(),
        )

    def close(self) -> None:
        """Close every connection and the fan-out threads; idempotent. A refresh in flight
        ends first, and none starts after: no client is made or left open once closed."""
        with self._admin_lock:
            if self._closed:
                return
            self._closed = True
            admin, self._admin = list(self._admin.values()), {}
        self._shutdown()
        with self._refreshing:
            rc, self._rc = self._rc, None
        for node in list(self._nodes.values()):
            node.close()
        for client in admin:
            client.close()
        if rc is not None:
            rc.close()

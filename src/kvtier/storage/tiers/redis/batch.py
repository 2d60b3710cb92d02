"""The batch engine of both Redis tiers: names grouped by the node that serves them, sent in one
pipeline per node (nodes concurrently), cluster redirects followed; a node that fails is skipped
for its cool-down."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import redis
from typing_extensions import Buffer

from kvtier.storage.observers import NO_OBSERVER, StorageObserver
from kvtier.storage.tiers.accounting import TierCounters
from kvtier.storage.tiers.codecs import TierCodec
from kvtier.storage.tiers.resp import Node, Redirect, Wire, command

logger = logging.getLogger(__name__)

_EXTRA = ("skipped", "redirects", "refreshes")
_ASKING = command(b"ASKING")
GET_PIPELINE_BYTES = 1 << 20  # see get_many_into
_R = TypeVar("_R")


class BatchEngine:
    """Per-node pipelines with redirects followed; subclasses route names to nodes (see
    `RespTier`)."""

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

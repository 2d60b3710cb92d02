"""The KV events' replay: a buffer of recent batches bounded in bytes, one window per tenant,
and the replies to vLLM's replay request, sent no faster than the peer reads them.

`ReplayBuffer` keeps each tenant's batches apart (a batch's topic is one model's, and a model
is a tenant's): past `--kv-events-buffer-bytes` (or `--kv-events-buffer` batches) in all, the
oldest batch of the tenant holding the most bytes goes first, so a tenant that stores a lot
shortens its own replay window, never another's below its fair share.

`ReplayServer` answers a replay request (a start sequence number) with the buffered batches
from there on, then vLLM's end marker. It keeps only a cursor per peer (the next sequence
number to send), never a copy of what it replays: each round it sends that peer what its
queue takes (ZMQ_ROUTER_MANDATORY says when the queue is full; the queue is
`--kv-events-queue-bytes` over the largest batch, in messages) and resumes in a later round.
A peer gone, or one that took nothing for `STALL_S` seconds, loses its cursor: the bytes a
peer that never reads can make the server hold are its queue, whatever it asks.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator

import zmq

from kvtier.keys import decompose

from .event_wire import END_SEQ, seq_bytes

__all__ = ["ReplayBuffer", "ReplayServer", "tenant_of"]

logger = logging.getLogger(__name__)

#: seconds a replay peer may take nothing before its cursor is dropped
STALL_S = 10.0
#: the most batches sent to one peer in one round (others get their turn)
_ROUND_BATCHES = 64
#: seconds between two log lines about malformed replay requests (counted in between)
_LOG_EVERY_S = 10.0

Batch = tuple[int, bytes, bytes]  # (seq, topic, payload)


def tenant_of(model: str) -> str:
    """The tenant whose model `model` (as chunk keys name it) is: "" for the anonymous one."""
    try:
        parts = decompose(model)
    except ValueError:
        return ""
    return parts[0] if len(parts) == 2 else ""


class ReplayBuffer:
    """Recent batches per tenant, bounded in bytes and in batches in all. Not thread-safe:
    the publishing thread alone uses it."""

    def __init__(self, max_bytes: int, max_batches: int) -> None:
        self.max_bytes = max_bytes
        self.max_batches = max_batches
        self._by_tenant: dict[str, deque[Batch]] = {}
        self._bytes: dict[str, int] = {}
        self.total_bytes = 0
        self.total_batches = 0

    def add(self, tenant: str, seq: int, topic: bytes, payload: bytes) -> None:
        batches = self._by_tenant.setdefault(tenant, deque())
        batches.append((seq, topic, payload))
        size = len(topic) + len(payload)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        self.total_bytes += size
        self.total_batches += 1
        while self.total_bytes > self.max_bytes or self.total_batches > self.max_batches:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest batch of the tenant holding the most bytes."""
        tenant = max(self._bytes, key=self._bytes.__getitem__)
        _, topic, payload = self._by_tenant[tenant].popleft()
        size = len(topic) + len(payload)
        self._bytes[tenant] -= size
        self.total_bytes -= size
        self.total_batches -= 1
        if not self._by_tenant[tenant]:
            del self._by_tenant[tenant], self._bytes[tenant]

    def since(self, first: int) -> Iterator[Batch]:
        """The kept batches from sequence number `first` on, in order."""
        runs = []
        for batches in self._by_tenant.values():
            at = bisect.bisect_left(batches, (first,))
            runs.append(itertools.islice(batches, at, None))
        return heapq.merge(*runs)

    def windows(self) -> dict[str, int]:
        """Bytes each tenant's window holds (for status)."""
        return dict(self._bytes)

    def __len__(self) -> int:
        return self.total_batches


class ReplayServer:
    """Serves replay requests on a ROUTER socket from a `ReplayBuffer` (see the module doc)."""

    def __init__(self, sock: zmq.Socket[bytes], buffer: ReplayBuffer, max_peers: int) -> None:
        self.socket = sock
        self.buffer = buffer
        self.max_peers = max_peers
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._cursors: dict[bytes, list[float]] = {}  # peer -> [next seq, last progress]
        self._moved = False  # whether a replay sent something in the last round, or is new
        self.replays = 0
        self.malformed = 0
        self._unlogged = 0
        self._logged_at = 0.0

    @property
    def busy(self) -> bool:
        """Whether some replay is under way and moved in the last round (its peer reads): the
        next round comes sooner. Replays whose peers read nothing wait for the usual round."""
        return self._moved

    def receive(self) -> None:
        """Take every waiting request; a new request of a peer replaces its cursor."""
        sock = self.socket
        while sock.poll(0, zmq.POLLIN):
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or len(frames[2]) != 8:
                self._malformed()
                continue
            client, _, start = frames
            old = self._cursors.get(client)
            if old is None and len(self._cursors) >= self.max_peers:
                self._cursors.pop(next(iter(self._cursors)))  # the oldest replay gives way
            # a peer that asks again keeps its last progress: asking is not reading, so one
            # that never reads loses its cursor after STALL_S however often it asks
            since = time.monotonic() if old is None else old[1]
            self._cursors[client] = [int.from_bytes(start, "big"), since]
            self._moved = True
            self.replays += 1

    def _malformed(self) -> None:
        """Count a malformed request (ignored, as vLLM does); log at most one line per
        `_LOG_EVERY_S`, with how many came since."""
        self.malformed += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY_S:
            logger.warning(
                "kv events: ignored %d malformed replay request(s) (a request is [empty frame, "
                "8-byte start sequence number])",
                self._unlogged,
            )
            self._unlogged = 0
            self._logged_at = now

    def send(self) -> None:
        """Send each waiting replay what its peer's queue takes now."""
        now = time.monotonic()
        self._moved = False
        for client, cursor in list(self._cursors.items()):
            try:
                done = self._send_some(client, cursor)
            except zmq.ZMQError:  # gone (EHOSTUNREACH) or anything else: its replay ends
                done = True
            if done:
                del self._cursors[client]
            elif now - cursor[1] > STALL_S:
                del self._cursors[client]  # it reads nothing: its cursor goes, its queue drains
                logger.warning("kv events: a replay peer read nothing for %.0f s; dropped", STALL_S)

    def _send_some(self, client: bytes, cursor: list[float]) -> bool:
        """Send up to a round's batches; True when the end marker went out."""
        sock = self.socket
        for sent, (seq, topic, payload) in enumerate(self.buffer.since(int(cursor[0]))):
            if sent >= _ROUND_BATCHES:
                return False
            try:
                sock.send_multipart(
                    (client, b"", topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK
                )
            except zmq.Again:  # its queue is full: resume in a later round
                return False
            cursor[0] = seq + 1
            cursor[1] = time.monotonic()
            self._moved = True
        try:
            sock.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

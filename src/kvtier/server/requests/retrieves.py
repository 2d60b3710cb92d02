"""Retrieves: the leading held chunks of a range, handed out under a lease or copied inline.

Retrieve finds the leading chunks READY for the rank and holds them (never evicted) under a
retrieve lease until RetrieveDone; a retrieve of a session renews its pins, and its RetrieveDone
marks the rank done on them. Inline, the server copies the held slots into frames itself and ends
the lease at once.

Locking: `done` and `end_lease` run under the engine lock, which the caller holds. `retrieve`
takes it itself for the bookkeeping only; the layout check, naming, the inline copy and encoding
the reply run outside it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvtier import protocol as p
from kvtier.config import ServerConfig
from kvtier.errors import InvalidArgumentError
from kvtier.keys import ChunkKey
from kvtier.layouts import LayoutRegistry
from kvtier.server.fencing import CopyGuard, Watch
from kvtier.server.leases import LeaseBook, RetrieveLease
from kvtier.server.limits import tenant_bounds
from kvtier.server.locking import TimedLock
from kvtier.server.observe.metrics import Metrics
from kvtier.server.requests.sessions import SessionBook
from kvtier.storage.arena import Arena
from kvtier.storage.l1 import L1Store

__all__ = ["RetrieveBook"]

_LAPSED_MEMORY = 65536  # sessions whose pin lapsed, remembered to name a later short load


class RetrieveBook:
    """The retrieve path: retrieve leases, their end, inline retrieves."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        arena: Arena,
        l1: L1Store,
        layouts: LayoutRegistry,
        leases: LeaseBook,
        sessions: SessionBook,
        metrics: Metrics,
        lock: TimedLock,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._arena = arena
        self._l1 = l1
        self._layouts = layouts
        self._leases = leases
        self._sessions = sessions
        self._metrics = metrics
        self._lock = lock
        self._clock = clock
        # a tenant's retrieve leases hold at most this (lapsed ones stay held while the reader
        # lives): a retrieve past it hands out only the leading chunks that fit
        self._max_held = tenant_bounds(config, l1.capacity_bytes).quarantine_bytes
        self._lapsed: OrderedDict[str, None] = OrderedDict()  # sessions whose pin lapsed

    def pins_lapsed(self, holders: Sequence[str]) -> None:
        """Under the lock: these sessions' pins lapsed (a later short retrieve says why)."""
        for holder in holders:
            self._lapsed[holder] = None
            self._lapsed.move_to_end(holder)
        while len(self._lapsed) > _LAPSED_MEMORY:
            self._lapsed.popitem(last=False)

    def retrieve(
        self, client_id: str, req: p.Retrieve | p.RetrieveKeys, watch: Watch | None
    ) -> list[Any]:
        """The leading chunks held for this rank: their slots under a lease (fenced by the
        client's `watch` should it lapse), or, inline, their bytes copied by the server."""
        layout = self._layouts.check(
            req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype
        )
        # Named chunks have no session: their retrieve neither renews nor releases any pin.
        session_id = req.request_id if isinstance(req, p.Retrieve) else None
        looked_up = session_id is not None and self._sessions.exists(session_id)
        keys = self._sessions.range_keys(req)
        offsets: list[int] = []
        lease_id = 0
        guard = CopyGuard() if req.inline else None
        reader = req.reader if isinstance(req, p.Retrieve) and req.reader >= 0 else req.worker_id
        with self._lock.hold("Retrieve"):
            if session_id is not None:
                self._check_reader(session_id, reader)
            peer = self._leases.peers.get(client_id)
            tenant = "" if peer is None else peer.tenant
            room = len(keys)
            if self._max_held is not None:
                room = (self._max_held - self._leases.held_bytes(tenant)) // layout.nbytes
            for key in keys[: max(0, room)]:
                shard = self._l1.get_shard(key, req.worker_id)
                if shard is None or not self._l1.is_complete(key):
                    break
                offsets.append(shard[0])
            found = keys[: len(offsets)]
            if session_id is not None and len(found) < len(keys):
                self._count_short(session_id, keys, len(found), looked_up)
            if found:
                self._l1.touch(found)
                if session_id is not None and self._l1.pinned_keys(session_id):
                    self._l1.renew(session_id, self._config.pin_lease)  # pins live while in use
                held = [self._l1.acquire(key) for key in found]  # while the bytes are copied
                lease_id = self._leases.add_lease(
                    RetrieveLease(
                        client_id,
                        session_id,
                        reader,
                        found,
                        layout.nbytes,
                        self._clock() + self._config.staging_lease,
                        watch=guard if guard is not None else watch and watch.retain(),
                        tenant=tenant,
                        held=held,
                    )
                )
        if not req.inline:
            return [p.encode(p.RetrieveReply(len(offsets), offsets, lease_id, layout.nbytes))]
        # Inline: copy the held slots into frames outside the lock, then end the lease.
        try:
            frames = [bytes(self._arena.view(off, layout.nbytes)) for off in offsets]
        finally:
            assert guard is not None
            guard.finish()
        if lease_id:
            with self._lock.hold("Retrieve"):
                self.done(client_id, lease_id)
        elif session_id is not None:
            with self._lock.hold("Retrieve"):
                self._l1.mark_retrieved(session_id, reader)
        return [p.encode(p.RetrieveReply(len(offsets), [], 0, layout.nbytes)), *frames]

    def done(self, client_id: str, lease_id: int) -> p.Ok:
        """RetrieveDone: end the lease; the rank is done on the session's pins."""
        lease = self._leases.take_lease(client_id, lease_id)
        self.end_lease(lease)
        if lease.lapsed:  # the slots were kept, but the copy was not vouched for in time
            self._metrics.count_failed_load("lease_expired")
            raise self._leases.expired("the retrieve's lease", self._config.staging_lease)
        if lease.request_id is not None:
            self._l1.mark_retrieved(lease.request_id, lease.reader)
        self._metrics.add_retrieved_bytes(len(lease.keys) * lease.nbytes)
        return p.Ok()

    def _count_short(
        self, session_id: str, keys: list[ChunkKey], found: int, looked_up: bool
    ) -> None:
        """Under the lock: a retrieve found `found` of `keys`; count it as a failed load when
        it fell short of what the session's lookup reported (asking past the hit is not)."""
        pinned = self._l1.pinned_keys(session_id)
        if pinned:
            self._lapsed.pop(session_id, None)  # pinned again since its pin lapsed
            held = set(pinned)
            expected = next((i for i, key in enumerate(keys) if key not in held), len(keys))
            if found < expected:
                self._metrics.count_failed_load("short")
        elif session_id in self._lapsed:
            del self._lapsed[session_id]
            self._metrics.count_failed_load("pin_lapsed")
        elif not looked_up:
            self._metrics.count_failed_load("no_lookup")

    def _check_reader(self, session_id: str, reader: int) -> None:
        """Under the lock: a reader outside the ranks the session's pin waits for is an error
        (it would never be marked done there, and the pin would outlive every real reader)."""
        readers = self._l1.pin_readers(session_id)
        if readers and reader >= readers:
            raise InvalidArgumentError(
                f"reader {reader} is outside range(readers={readers}) of this request's lookup: "
                "pass readers= to the lookup (the ranks that retrieve) or the reader's index"
            )

    def end_lease(self, lease: RetrieveLease) -> None:
        """Release what an ended lease holds: its groups, its watch."""
        for held in lease.held:
            self._l1.release(held)
        if lease.watch is not None:
            lease.watch.release()
            lease.watch = None

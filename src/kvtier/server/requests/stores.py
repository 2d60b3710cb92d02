"""Stores: staging slots reserved, filled by the client (or inline by the server), committed.

Reserve hands out STAGING slots under a reservation in the lease book; Commit makes them READY
and hands the new shards to the L2 write-through; Abort, a lapsed lease or a dead client frees
them (fenced first while the writer may still be copying). StoreInline is the same for a client
without the arena: the server copies the frames into the slots itself.

Every staging slot counts against its client's tenant: at most `--tenant-staging-share` of the
L1 staging, and at most `--tenant-quarantine-share` staging and quarantined together (a slot of
a client that went silent stays quarantined while its process lives, and every staging slot can
become one). A tenant past either gets NO_SPACE on its stores before anything is evicted for it;
other tenants' stores are not affected.

Locking: `commit`, `abort`, `stored_prefix`, `end_reservation` and `fence` run under the engine
lock, which the caller holds. `reserve` and `store_inline` take it themselves for the
bookkeeping only; layout checks and the inline copy run outside it, as does `write_committed`
(queueing for L2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier import protocol as p
from kvtier.config import ServerConfig
from kvtier.errors import BadArrayError, KVTierError, LeaseExpiredError, UnknownReservationError
from kvtier.keys import ChunkKey
from kvtier.layouts import LayoutRegistry
from kvtier.server.answers import Answer
from kvtier.server.fencing import CopyGuard, Watch
from kvtier.server.leases import LeaseBook, Reservation
from kvtier.server.limits import tenant_bounds
from kvtier.server.locking import TimedLock
from kvtier.server.observe.chunk_notes import ChunkNotes
from kvtier.server.observe.metrics import Metrics
from kvtier.server.requests.handoffs import HandoffBook, handoff_holder
from kvtier.server.requests.sessions import SessionBook
from kvtier.server.writethrough import Shard, WriteThrough
from kvtier.storage.arena import Arena
from kvtier.storage.l1 import L1Store, stored_holder
from kvtier.storage.manager import TierManager

__all__ = ["Committed", "StoreBook"]


@dataclass(slots=True)
class Committed:
    """A commit's outcome and the shards it hands to the L2 write-through."""

    result: p.StoreReply | KVTierError
    shards: list[Shard]


class StoreBook:
    """The store path: reservations, commits, aborts and inline stores."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        arena: Arena,
        l1: L1Store,
        tiers: TierManager,
        layouts: LayoutRegistry,
        leases: LeaseBook,
        sessions: SessionBook,
        write_through: WriteThrough,
        metrics: Metrics,
        lock: TimedLock,
        clock: Callable[[], float],
        notes: ChunkNotes,
        handoffs: HandoffBook,
    ) -> None:
        """`notes` keeps what the KV events publish of each stored chunk (its tokens);
        `handoffs` pins the chunks of hand-off stores."""
        self._config = config
        self._handoffs = handoffs
        self._notes = notes
        self._arena = arena
        self._l1 = l1
        self._tiers = tiers
        self._layouts = layouts
        self._leases = leases
        self._sessions = sessions
        self._write_through = write_through
        self._metrics = metrics
        self._lock = lock
        self._clock = clock
        self._bounds = tenant_bounds(config, l1.capacity_bytes)

    def reserve(
        self,
        client_id: str,
        req: p.RangeRequest | p.KeyRequest,
        keys: list[ChunkKey],
        watch: Watch | None,
        parent: bytes | None = None,
    ) -> p.ReserveReply:
        """Staging slots for `keys` (after the chunk named `parent`, in a prompt's range);
        `watch` tells while whoever copies into them may still touch them (the client's
        process, or the server's own inline copy)."""
        layout = self._layouts.check(
            req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype
        )
        if isinstance(req, p.RangeRequest) and self._notes:
            cs = self._config.chunk_size
            tokens = req.tokens[4 * req.start : 4 * req.end]
            self._notes.note(keys, parent, tokens, cs, req.extra_key)
        offsets: list[int] = []
        reserved: list[ChunkKey] = []
        flags = req.resumable if isinstance(req, p.Reserve | p.StoreInline) else []
        handoff = isinstance(req, p.ReserveKeys | p.StoreKeysInline) and req.handoff
        if handoff:
            self._notes.hide(keys)  # no prefix-cache entries: never in the KV events
        with self._lock.hold("Reserve"):
            peer = self._leases.peers.get(client_id)
            tenant = "" if peer is None else peer.tenant
            try:
                for i, key in enumerate(keys):
                    if self._l1.is_busy(key, req.worker_id, client_id):
                        # Another client is storing it right now: this store cannot call it
                        # stored (that client may still abort or die).
                        offsets.append(p.IN_FLIGHT)
                        continue
                    offset = self._l1.reserve(
                        key,
                        req.worker_id,
                        layout.nbytes,
                        owner=client_id,
                        lease_s=self._config.staging_lease,
                        layout=layout.text,
                        tenant=tenant,
                        bounds=self._bounds,
                        resumable=flags[i] if flags else True,
                        admit=True if handoff else None,  # a hand-off is for its reader
                    )
                    offsets.append(p.STORED if offset is None else offset)
                    if offset is not None:
                        reserved.append(key)
            except BaseException:  # NoSpaceError or a bug: never leak the slots taken so far
                for key in reserved:
                    self._l1.abort(key, req.worker_id, owner=client_id)
                raise
            reservation_id = 0
            if reserved:
                reservation_id = self._leases.add_reservation(
                    Reservation(
                        client_id,
                        req.worker_id,
                        keys,
                        reserved,
                        layout.nbytes,
                        self._clock() + self._config.staging_lease,
                        watch=None if watch is None else watch.retain(),
                        tenant=tenant,
                        request_id=req.request_id if isinstance(req, p.RangeRequest) else None,
                        handoff=handoff_holder(tenant, req.request_id) if handoff else None,
                    )
                )
        return p.ReserveReply(reservation_id, offsets, layout.nbytes)

    def stored_prefix(self, keys: list[ChunkKey], worker_id: int) -> int:
        """How many leading chunks of `keys` are READY for this rank: what a store reports."""
        n = 0
        for key in keys:
            if self._l1.get_shard(key, worker_id) is None:
                break
            n += 1
        return n

    def end_reservation(self, res: Reservation) -> None:
        """Free what an ended reservation still holds: its staging or quarantined slots."""
        if res.lapsed:
            for offset, nbytes in res.fenced:
                self._l1.unfence(offset, nbytes, tenant=res.tenant)
            res.fenced.clear()
        else:
            for key in res.reserved:
                with contextlib.suppress(UnknownReservationError):  # committed meanwhile
                    self._l1.abort(key, res.worker_id, owner=res.owner)
        if res.watch is not None:
            res.watch.release()
            res.watch = None

    def fence(self, res: Reservation) -> None:
        """Quarantine a lapsed reservation's staging slots: its writer may still be copying."""
        for key in res.reserved:
            with contextlib.suppress(UnknownReservationError):
                res.fenced.append(self._l1.fence(key, res.worker_id, owner=res.owner))

    def commit(self, client_id: str, reservation_id: int) -> Committed:
        """Make a reservation's slots ready (under the lock); what to write through to L2."""
        staging_lease = self._config.staging_lease
        res = self._leases.take_reservation(client_id, reservation_id, staging_lease)
        if res.lapsed:
            self.end_reservation(res)
            raise self._leases.expired("the store's staging lease", staging_lease)
        if res.watch is not None:
            res.watch.release()
            res.watch = None
        lost = 0
        shards: list[Shard] = []
        declined: list[ChunkKey] = []
        for key in res.reserved:
            try:
                complete = self._l1.commit(key, res.worker_id, owner=client_id)
            except UnknownReservationError:
                lost += 1
                continue
            if not self._l1.is_admitted(key):  # the cache policy declined it: no L2 copy
                if complete:
                    declined.append(key)
            elif self._tiers.tiers:
                shards.append(self._write_through_shard(key, res.worker_id))
        if declined and res.request_id is not None:
            self._hold_for_request(res, res.request_id, declined)
        if res.handoff is not None:
            stored = (len(res.reserved) - lost) * res.nbytes
            self._handoffs.committed(res.handoff, res.keys, tenant=res.tenant, nbytes=stored)
        self._l1.touch(res.keys)
        self._metrics.add_stored_bytes((len(res.reserved) - lost) * res.nbytes)
        if lost:
            return Committed(
                LeaseExpiredError(
                    f"{lost} of {len(res.reserved)} staging slots expired before the commit "
                    f"(--staging-lease {staging_lease:g}s); those chunks are not stored"
                ),
                shards,
            )
        return Committed(p.StoreReply(self.stored_prefix(res.keys, res.worker_id)), shards)

    def _hold_for_request(self, res: Reservation, request_id: str, keys: list[ChunkKey]) -> None:
        """Pin chunks the cache policy declined for the request that stored them, so its own
        lookups find them while it lives (its session's end releases them, coldest in L1)."""
        holder = stored_holder(request_id)
        self._l1.pin(
            holder,
            [*self._l1.pinned_keys(holder), *keys],
            ranks=(),
            lease_s=self._config.pin_lease,
            tenant=res.tenant,
            max_bytes=self._bounds.pinned_bytes,
            owner=res.owner,
        )

    def write_committed(self, committed: Committed, answer: Answer) -> p.StoreReply | None:
        """Queue the committed shards for L2 (no lock held); the reply, or None when the
        queue is full under the block policy and the answer waits for room."""
        result = committed.result

        def then() -> None:
            if isinstance(result, KVTierError):
                answer.error(result)
            else:
                answer.reply(result)

        if not self._write_through.write(committed.shards, then):
            return None
        if isinstance(result, KVTierError):
            raise result
        return result

    def abort(self, client_id: str, reservation_id: int) -> p.Ok:
        res = self._leases.take_reservation(client_id, reservation_id, self._config.staging_lease)
        self.end_reservation(res)
        return p.Ok()

    def store_inline(
        self,
        client_id: str,
        req: p.StoreInline | p.StoreKeysInline,
        payloads: Sequence[Any],
        answer: Answer,
    ) -> p.StoreReply | None:
        """Reserve, copy the frames into the slots (outside the lock), commit."""
        layout = self._layouts.check(
            req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype
        )
        pieces = _chunk_pieces(payloads, req.num_chunks, layout.nbytes, layout.text)
        keys, parent = self._sessions.range_chain(req)
        # The server copies into the slots itself, outside the lock: the guard keeps them
        # fenced, should the lease lapse, until that copy is over.
        guard = CopyGuard()
        reply = self.reserve(client_id, req, keys, guard, parent)
        try:
            for offset, chunk in zip(reply.offsets, pieces, strict=True):
                if offset >= 0:  # a remote client's bytes have to land in the arena somehow
                    at = offset
                    for piece in chunk:
                        self._arena.view(at, len(piece))[:] = piece
                        at += len(piece)
        except BaseException:
            if reply.reservation_id:
                with self._lock.hold("StoreInline"):
                    self.abort(client_id, reply.reservation_id)
            raise
        finally:
            guard.finish()
        if reply.reservation_id:
            with self._lock.hold("StoreInline"):
                committed = self.commit(client_id, reply.reservation_id)
            return self.write_committed(committed, answer)
        with self._lock.hold("StoreInline"):
            return p.StoreReply(self.stored_prefix(keys, req.worker_id))

    def _write_through_shard(self, key: ChunkKey, worker_id: int) -> Shard:
        """A newly committed shard for the L2 tiers; its group stays held until written."""
        shard = self._l1.get_shard(key, worker_id)
        assert shard is not None
        offset, size, layout = shard
        held = self._l1.acquire(key)

        def done() -> None:
            with self._lock.hold("L2 written"):
                self._l1.release(held)

        view = self._arena.view(offset, size)
        return Shard(
            key.shard(worker_id), view, layout, done, self._l1.is_resumable(key, worker_id)
        )


def _chunk_pieces(
    payloads: Sequence[Any], num_chunks: int, nbytes: int, layout: str
) -> list[list[memoryview]]:
    """The frames of an inline store cut at chunk boundaries: each chunk's `nbytes` bytes as
    the pieces of the frames that carry them (a chunk may span several frames, see
    `protocol.INLINE_FRAME_BYTES`). BadArrayError unless they add up to `num_chunks` chunks."""
    views = [memoryview(frame).cast("B") for frame in payloads]
    total = sum(len(v) for v in views)
    if total != num_chunks * nbytes:
        raise BadArrayError(
            f"StoreInline announced {num_chunks} chunks of {nbytes} bytes (layout {layout}) "
            f"but its {len(views)} frames carry {total} bytes"
        )
    chunks: list[list[memoryview]] = []
    current: list[memoryview] = []
    room = nbytes
    for view in views:
        while len(view):
            piece, view = view[:room], view[room:]
            current.append(piece)
            room -= len(piece)
            if room == 0:
                chunks.append(current)
                current, room = [], nbytes
    return chunks

"""Request handlers: everything the server does, without sockets.

`Engine.handle(identity, header, payloads, respond)` takes one request's frames and answers
through `respond(frames)` exactly once (see `answers.py`): at once for most requests, later
(from another thread) for a lookup that waits on L2 loads or a commit that waits for room in a
full L2 queue. Every failure becomes a typed error reply.

State is shared by the transport thread, the prefetch workers, the lease reaper, session expiry,
L2 write completions and the admin API, and guarded by one lock (`TimedLock`) that each holds
only for short sections: hashing a prompt, building names, tier I/O and encoding big replies
happen outside it. Its longest hold per operation is measured (`lock_stats()`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier import protocol as p
from kvtier._version import __version__
from kvtier.config import ServerConfig
from kvtier.errors import (
    BadArrayError,
    HashContractError,
    InternalError,
    InvalidArgumentError,
    KVTierError,
    LeaseExpiredError,
    NoSpaceError,
    NotConnectedError,
    ProtocolVersionError,
    UnknownReservationError,
    UnknownSessionError,
)
from kvtier.hashing import TokenHasher
from kvtier.keys import ChunkKey
from kvtier.metrics import Metrics
from kvtier.periodic import PeriodicThread, PeriodicThreadRegistry, ThreadRunSummary
from kvtier.server import naming
from kvtier.server.answers import Answer, Respond, offloaded
from kvtier.server.layouts import LayoutRegistry
from kvtier.server.leases import Expired, LeaseBook, Peer, Reservation, RetrieveLease
from kvtier.server.locking import HoldStats, TimedLock
from kvtier.server.lookups import LookupBook
from kvtier.server.writethrough import Shard, WriteThrough
from kvtier.session import Session, SessionManager
from kvtier.storage.arena import Arena
from kvtier.storage.l1 import L1Store
from kvtier.storage.manager import TierManager
from kvtier.storage.prefetch import Prefetcher

__all__ = ["Engine", "EngineParts", "Respond"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Committed:
    """A commit's outcome and the shards it hands to the L2 write-through."""

    result: p.StoreReply | KVTierError
    shards: list[Shard]


_OK = p.encode(p.Ok())


@dataclass(slots=True)
class EngineParts:
    """What the engine works with, built by `server.app.build_engine` and handed over."""

    hasher: TokenHasher
    arena: Arena
    l1: L1Store
    tiers: TierManager
    sessions: SessionManager
    lock: TimedLock
    prefetcher: Prefetcher
    write_through: WriteThrough
    handlers: ThreadPoolExecutor
    metrics: Metrics
    registry: PeriodicThreadRegistry


class Engine:
    """The server's state and request handlers (transport-agnostic)."""

    def __init__(
        self,
        config: ServerConfig,
        parts: EngineParts,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Take the parts `server.app.build_engine` assembled; the engine owns them from now on
        (`close()` stops and closes every one)."""
        self.config = config
        self.clock = clock
        self.started_at = time.time()
        self.hasher = parts.hasher
        self.chunk_size = config.chunk_size
        self.contract = self.hasher.contract()
        self.host_id = p.local_host_id()
        self.server_id = uuid.uuid4().hex
        self.arena = parts.arena
        self.l1 = parts.l1
        self.tiers = parts.tiers
        self.metrics = parts.metrics
        self._lock = parts.lock
        self.prefetcher = parts.prefetcher
        self._write_through = parts.write_through
        # Requests with big prompts or inline bytes run here, so the transport thread only
        # decodes, routes and replies (see `_offloaded`).
        self._handlers = parts.handlers
        self.sessions = parts.sessions
        self.sessions.destroy_listeners.append(self._on_session_destroyed)
        self.layouts = LayoutRegistry()
        self.leases = LeaseBook(clock)
        self.lookups = LookupBook(config, self.l1, self.tiers, self.prefetcher, self.metrics)
        self._recent_errors: deque[dict[str, Any]] = deque(maxlen=50)
        self._ending: set[str] = set()  # sessions being ended on purpose, not expired
        self._orphaned = 0  # expired sessions that still held pins
        self._closed = False
        #: periodic threads the assembler started for this engine (the lease reaper)
        self.threads: list[PeriodicThread] = []
        self._registry = parts.registry
        self.metrics.bind_state(self.status)

    # -- the one entry point --------------------------------------------------------------------

    def handle(
        self,
        identity: bytes,
        header: bytes | memoryview,
        payloads: Sequence[Any],
        respond: Respond,
    ) -> None:
        """One request's frames in; its reply goes to `respond`, now or later. Never raises."""
        answer = Answer(self.metrics, self._record_error, respond)
        try:
            request = p.decode_request(header)
        except Exception as exc:
            answer.error(exc)
            return
        answer.operation = type(request).__name__
        if offloaded(request):
            try:
                self._handlers.submit(self._run, identity, request, payloads, answer)
                return
            except RuntimeError:  # the pool is shut down: the server is closing
                pass
        self._run(identity, request, payloads, answer)

    def _run(
        self, identity: bytes, request: p.Request, payloads: Sequence[Any], answer: Answer
    ) -> None:
        try:
            frames = self._dispatch(identity, request, payloads, answer)
        except Exception as exc:
            answer.error(exc)
            return
        if frames is not None:
            answer.frames(frames)

    def call(
        self, identity: bytes, header: bytes | memoryview, payloads: Sequence[Any] = ()
    ) -> list[Any]:
        """`handle` for callers that can wait: the reply's frames (tests, in-process use)."""
        done = threading.Event()
        out: list[Any] = []

        def respond(frames: list[Any]) -> None:
            out.extend(frames)
            done.set()

        self.handle(identity, header, payloads, respond)
        done.wait()
        return out

    def _record_error(self, operation: str, exc: KVTierError) -> None:
        self.metrics.count_error(operation, exc.code.name)
        self._recent_errors.append(
            {
                "time": time.time(),
                "operation": operation,
                "code": exc.code.name,
                "message": exc.message,
            }
        )

    def _dispatch(
        self, identity: bytes, req: p.Request, payloads: Sequence[Any], answer: Answer
    ) -> list[Any] | None:
        """Route a request; the reply's frames, or None when `answer` is kept for later."""
        op = answer.operation
        if isinstance(req, p.Hello):
            with self._lock.hold(op):
                return [p.encode(self._hello(identity, req))]
        with self._lock.hold(op):
            client = self.leases.peer(identity)
        if client is None:
            raise NotConnectedError(f"send Hello before {type(req).__name__}: no handshake yet")
        client_id = client.client_id
        match req:
            case p.Heartbeat():
                reply: p.Reply | None = p.Ok()
            case p.Register():
                with self._lock.hold(op):
                    reply = self._register(client, req)
            case p.Lookup():
                reply = self._lookup(req, answer)
            case p.LookupPoll():
                with self._lock.hold(op):
                    reply = self.lookups.poll(req, answer)
            case p.Reserve():
                reply = self._reserve(client_id, req, self._range_keys(req))
            case p.Commit():
                with self._lock.hold(op):
                    committed = self._commit(client_id, req.reservation_id)
                reply = self._write_committed(committed, answer)
            case p.Abort():
                with self._lock.hold(op):
                    reply = self._abort(client_id, req.reservation_id)
            case p.StoreInline():
                reply = self._store_inline(client_id, req, payloads, answer)
            case p.Retrieve():
                return self._retrieve(client_id, req)
            case p.RetrieveDone():
                with self._lock.hold(op):
                    reply = self._retrieve_done(client_id, req.lease_id)
            case p.Release():
                self._require_session(req.request_id)
                with self._lock.hold(op):
                    self.l1.unpin(req.request_id)
                reply = p.Ok()
            case p.EndSession():
                self._require_session(req.request_id)
                with self._lock.hold(op):
                    self._remove_session(req.request_id)
                reply = p.Ok()
            case p.Goodbye():
                with self._lock.hold(op):
                    self._goodbye(client_id)
                reply = p.Ok()
            case _:
                raise InternalError(f"no handler for {type(req).__name__}")
        if reply is None:
            return None
        return [_OK if type(reply) is p.Ok else p.encode(reply)]

    # -- handshake and registration -------------------------------------------------------------

    def _hello(self, identity: bytes, req: p.Hello) -> p.HelloReply:
        if req.protocol_version != p.PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"client speaks protocol version {req.protocol_version}, this server speaks "
                f"{p.PROTOCOL_VERSION}: install matching kvtier versions "
                f"(server {__version__})"
            )
        server_info = self.hasher.contract_info()
        if req.contract is not None and req.contract != self.contract:
            diffs = [
                f"{k}: client {req.contract_info.get(k)!r}, server {v!r}"
                for k, v in server_info.items()
                if req.contract_info.get(k) != v
            ]
            detail = "; ".join(diffs) or "same settings, different hash implementation"
            raise HashContractError(
                f"hash contract mismatch (client {req.contract}, server {self.contract}): "
                f"{detail}. Chunk names would differ; use the server's settings "
                "(--chunk-size, --hash-algorithm, --hash-seed)"
            )
        self.leases.connect(identity, req.client_id)
        return p.HelloReply(
            server_version=__version__,
            protocol_version=p.PROTOCOL_VERSION,
            contract=self.contract,
            contract_info=dict(server_info),
            chunk_size=self.chunk_size,
            arena_name=self.arena.name,
            arena_size=self.arena.size,
            host_id=self.host_id,
            server_id=self.server_id,
        )

    def _register(self, client: Peer, req: p.Register) -> p.Ok:
        layout = self.layouts.register(
            req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype
        )
        registration = {
            "model": req.model,
            "world_size": req.world_size,
            "worker_id": req.worker_id,
            "chunk_shape": list(layout.chunk_shape),
            "dtype": layout.dtype,
        }
        if registration not in client.registrations:
            client.registrations.append(registration)
        return p.Ok()

    def _goodbye(self, client_id: str) -> None:
        """A client closed on purpose: forget it and reclaim what it still holds."""
        logger.info("client %s closed", client_id)
        self._reclaim(self.leases.disconnect(client_id))

    # -- sessions and names (no engine lock: sessions guard themselves) -------------------------

    def _session(self, request_id: str, tokens: bytes) -> Session:
        return naming.session_for(self.sessions, request_id, tokens)

    def _range_keys(self, req: p.RangeRequest) -> list[ChunkKey]:
        return naming.range_keys(self.sessions, self.chunk_size, req)

    _keys = staticmethod(naming.chunk_keys)

    def _require_session(self, request_id: str) -> Session:
        session = self.sessions.get(request_id)
        if session is None:
            raise UnknownSessionError(
                f"no session {request_id!r}: it never existed, already ended, or expired "
                f"(--session-ttl {self.config.session_ttl:g}s)"
            )
        return session

    def _remove_session(self, request_id: str) -> Session | None:
        """End a session on purpose (not an expiry)."""
        self._ending.add(request_id)
        try:
            return self.sessions.remove(request_id)
        finally:
            self._ending.discard(request_id)

    def _on_session_destroyed(self, session: Session) -> None:
        with self._lock.hold("session ended"):
            self.lookups.forget(session.request_id)
            held_pins = self.l1.unpin(session.request_id)
            if held_pins and session.request_id not in self._ending:
                self._orphaned += 1  # the engine abandoned it mid-flight, holding cache

    # -- lookup ---------------------------------------------------------------------------------

    def _lookup(self, req: p.Lookup, answer: Answer) -> p.LookupReply | None:
        """Name the prompt's chunks (no lock), then look them up (see `LookupBook`)."""
        if req.world_size < 1:
            raise InvalidArgumentError(f"world_size must be >= 1, got {req.world_size}")
        session = self._session(req.request_id, req.tokens)
        num_tokens = session.num_tokens
        end = num_tokens - num_tokens % self.chunk_size
        keys = self._keys(session, req.model, req.cache_salt, req.world_size, end)
        layout = self.layouts.get(req.model, req.world_size)
        with self._lock.hold(answer.operation):
            return self.lookups.lookup(req, keys, num_tokens, layout, answer)

    # -- store ----------------------------------------------------------------------------------

    def _reserve(self, client_id: str, req: p.RangeRequest, keys: list[ChunkKey]) -> p.ReserveReply:
        layout = self.layouts.check(
            req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype
        )
        offsets: list[int] = []
        reserved: list[ChunkKey] = []
        with self._lock.hold("Reserve"):
            try:
                for key in keys:
                    offset = self.l1.reserve(
                        key,
                        req.worker_id,
                        layout.nbytes,
                        owner=client_id,
                        lease_s=self.config.staging_lease,
                        layout=layout.text,
                    )
                    offsets.append(-1 if offset is None else offset)
                    if offset is not None:
                        reserved.append(key)
            except NoSpaceError:
                for key in reserved:
                    self.l1.abort(key, req.worker_id, owner=client_id)
                raise
            reservation_id = 0
            if reserved:
                reservation_id = self.leases.add_reservation(
                    Reservation(
                        client_id,
                        req.worker_id,
                        keys,
                        reserved,
                        layout.nbytes,
                        self.clock() + self.config.staging_lease,
                    )
                )
        return p.ReserveReply(reservation_id, offsets, layout.nbytes)

    def _commit(self, client_id: str, reservation_id: int) -> _Committed:
        """Make a reservation's slots ready (under the lock); what to write through to L2."""
        res = self.leases.take_reservation(client_id, reservation_id, self.config.staging_lease)
        lost = 0
        shards: list[Shard] = []
        for key in res.reserved:
            try:
                self.l1.commit(key, res.worker_id, owner=client_id)
            except UnknownReservationError:
                lost += 1
                continue
            if self.tiers.tiers:
                shards.append(self._write_through_shard(key, res.worker_id))
        self.l1.touch(res.keys)
        self.metrics.add_stored_bytes((len(res.reserved) - lost) * res.nbytes)
        if lost:
            return _Committed(
                LeaseExpiredError(
                    f"{lost} of {len(res.reserved)} staging slots expired before the commit "
                    f"(--staging-lease {self.config.staging_lease:g}s); those chunks are not "
                    "stored"
                ),
                shards,
            )
        return _Committed(p.StoreReply(len(res.keys)), shards)

    def _write_committed(self, committed: _Committed, answer: Answer) -> p.StoreReply | None:
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

    def _abort(self, client_id: str, reservation_id: int) -> p.Ok:
        res = self.leases.take_reservation(client_id, reservation_id, self.config.staging_lease)
        for key in res.reserved:
            with contextlib.suppress(UnknownReservationError):  # reclaimed already
                self.l1.abort(key, res.worker_id, owner=client_id)
        return p.Ok()

    def _store_inline(
        self, client_id: str, req: p.StoreInline, payloads: Sequence[Any], answer: Answer
    ) -> p.StoreReply | None:
        layout = self.layouts.check(
            req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype
        )
        if len(payloads) != req.num_chunks:
            raise BadArrayError(
                f"StoreInline announced {req.num_chunks} chunks but carried {len(payloads)} frames"
            )
        for i, frame in enumerate(payloads):
            if len(frame) != layout.nbytes:
                raise BadArrayError(
                    f"chunk {i} carries {len(frame)} bytes; layout {layout.text} needs "
                    f"{layout.nbytes}"
                )
        reply = self._reserve(client_id, req, self._range_keys(req))
        # The slots are this client's staging slots: the copy needs no lock.
        for offset, frame in zip(reply.offsets, payloads, strict=True):
            if offset >= 0:  # a remote client's bytes have to land in the arena somehow
                self.arena.view(offset, layout.nbytes)[:] = memoryview(frame).cast("B")
        if reply.reservation_id:
            with self._lock.hold("StoreInline"):
                committed = self._commit(client_id, reply.reservation_id)
            return self._write_committed(committed, answer)
        return p.StoreReply(req.num_chunks)

    def _write_through_shard(self, key: ChunkKey, worker_id: int) -> Shard:
        """A newly committed shard for the L2 tiers; its group stays held until written."""
        shard = self.l1.get_shard(key, worker_id)
        assert shard is not None
        offset, size, layout = shard
        self.l1.acquire(key)

        def done() -> None:
            with self._lock.hold("L2 written"):
                self.l1.release(key)

        return Shard(key.shard(worker_id), self.arena.view(offset, size), layout, done)

    # -- retrieve -------------------------------------------------------------------------------

    def _retrieve(self, client_id: str, req: p.Retrieve) -> list[Any]:
        layout = self.layouts.check(
            req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype
        )
        keys = self._range_keys(req)
        offsets: list[int] = []
        lease_id = 0
        with self._lock.hold("Retrieve"):
            for key in keys:
                shard = self.l1.get_shard(key, req.worker_id)
                if shard is None or not self.l1.is_complete(key):
                    break
                offsets.append(shard[0])
            found = keys[: len(offsets)]
            if found:
                self.l1.touch(found)
                if self.l1.pinned_keys(req.request_id):  # the lookup's pins live while in use
                    self.l1.renew(req.request_id, self.config.pin_lease)
                for key in found:
                    self.l1.acquire(key)  # held while the bytes are copied out
                lease_id = self.leases.add_lease(
                    RetrieveLease(
                        client_id,
                        req.request_id,
                        req.worker_id,
                        found,
                        layout.nbytes,
                        self.clock() + self.config.staging_lease,
                    )
                )
        if not req.inline:
            return [p.encode(p.RetrieveReply(len(offsets), offsets, lease_id, layout.nbytes))]
        # Inline: copy the held slots into frames outside the lock, then end the lease.
        frames = [bytes(self.arena.view(off, layout.nbytes)) for off in offsets]
        if lease_id:
            with self._lock.hold("Retrieve"):
                self._retrieve_done(client_id, lease_id)
        else:
            with self._lock.hold("Retrieve"):
                self.l1.mark_retrieved(req.request_id, req.worker_id)
        return [p.encode(p.RetrieveReply(len(offsets), [], 0, layout.nbytes)), *frames]

    def _retrieve_done(self, client_id: str, lease_id: int) -> p.Ok:
        lease = self.leases.take_lease(client_id, lease_id)
        self._end_lease(lease)
        self.l1.mark_retrieved(lease.request_id, lease.worker_id)
        self.metrics.add_retrieved_bytes(len(lease.keys) * lease.nbytes)
        return p.Ok()

    def _end_lease(self, lease: RetrieveLease) -> None:
        for key in lease.keys:
            self.l1.release(key)

    # -- background -----------------------------------------------------------------------------

    def reap(self) -> ThreadRunSummary:
        """Reclaim what dead or slow clients hold: staging slots, retrieve leases, pins."""
        with self._lock.hold("reap"):
            expired = self.leases.sweep(self.config.client_timeout)
            for client_id in expired.dead_clients:
                logger.info("client %s stopped heartbeating: reclaiming its leases", client_id)
            self._reclaim(expired)
            staging = self.l1.reclaim_staging()
            pins = self.l1.reclaim_pins()
        return ThreadRunSummary(
            success=True,
            message=(
                f"{len(expired.dead_clients)} dead clients, {staging} staging slots, "
                f"{pins} pins reclaimed"
            ),
            extra_info={
                "dead_clients": len(expired.dead_clients),
                "staging": staging,
                "pins": pins,
                "leases": len(expired.leases),
            },
        )

    def _reclaim(self, gone: Expired) -> None:
        """Release what departed clients held (under the lock)."""
        for client_id in gone.dead_clients:
            self.l1.reclaim_staging(owner=client_id)
        self._release_expired(gone.reservations, gone.leases)

    def _release_expired(
        self, reservations: list[Reservation], leases: list[RetrieveLease]
    ) -> None:
        for res in reservations:
            for key in res.reserved:
                with contextlib.suppress(UnknownReservationError):  # reclaimed already
                    self.l1.abort(key, res.worker_id, owner=res.owner)
        for lease in leases:
            self._end_lease(lease)

    # -- admin backend --------------------------------------------------------------------------

    def is_ready(self) -> bool:
        return not self._closed

    def lock_stats(self) -> dict[str, HoldStats]:
        """The longest and total hold of the engine lock, per operation."""
        return self._lock.stats()

    def status(self) -> dict[str, Any]:
        """The JSON-safe picture of the server the admin API and metrics read."""
        now = self.clock()
        with self._lock.hold("status"):
            l1 = self.l1.stats()
            clients = [
                {
                    "client_id": c.client_id,
                    "connected_s": now - c.connected_at,
                    "last_seen_s": now - c.last_seen,
                    "registrations": list(c.registrations),
                }
                for c in self.leases.peers.values()
            ]
            recent = list(self._recent_errors)
        return {
            "version": __version__,
            "uptime_s": time.time() - self.started_at,
            "ready": self.is_ready(),
            "config": self.config.to_dict(),
            "l1": {k: l1[k] for k in l1},
            "l2": self.tiers.summary(),
            "clients": clients,
            "sessions": {
                "active": self.sessions.active_count(),
                "created": self.sessions.created_count,
                # expired: left without end_session (SessionManager calls these orphans);
                # orphaned: those of them that still held pins when they expired
                "expired": self.sessions.orphaned_count,
                "orphaned": self._orphaned,
            },
            "lookup": {
                "requested_tokens": self.lookups.requested_tokens,
                "hit_tokens": self.lookups.hit_tokens,
            },
            "prefetch": {
                "in_flight": self.prefetcher.in_flight,
                "started": self.prefetcher.started,
                "refused": self.prefetcher.refused,
                "loaded_groups": self.prefetcher.loaded_groups,
            },
            "lock_hold": {
                op: {"count": s.count, "total_s": s.total_s, "max_s": s.max_s}
                for op, s in self.lock_stats().items()
            },
            "recent_errors": recent,
        }

    def _session_dict(self, session: Session) -> dict[str, Any]:
        data = session.to_dict()
        data["pinned_chunks"] = len(self.l1.pinned_keys(session.request_id))
        return data

    def list_sessions(self, offset: int, limit: int) -> tuple[int, list[dict[str, Any]]]:
        sessions = sorted(self.sessions.sessions(), key=lambda s: s.created_at, reverse=True)
        with self._lock:
            page = [self._session_dict(s) for s in sessions[offset : offset + limit]]
        return len(sessions), page

    def get_session(self, request_id: str) -> dict[str, Any] | None:
        session = self.sessions.peek(request_id)
        if session is None:
            return None
        with self._lock:
            return self._session_dict(session)

    def end_session(self, request_id: str) -> bool:
        with self._lock:
            return self._remove_session(request_id) is not None

    def clear(self, *, model: str | None = None, cache_salt: str | None = None) -> int:
        with self._lock:
            cleared = self.l1.clear(model=model, cache_salt=cache_salt)
        return cleared + self.tiers.clear(model=model, cache_salt=cache_salt)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop background work, flush the L2 queue, and remove the arena; idempotent."""
        if self._closed:
            return
        self._closed = True
        for thread in self.threads:
            thread.stop()
            self._registry.unregister(thread.name)
        self._handlers.shutdown(wait=True, cancel_futures=True)
        self.prefetcher.close()
        self._write_through.close()
        self.sessions.close()
        self.tiers.close()
        self.arena.close()

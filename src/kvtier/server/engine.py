"""Request handlers: everything the server does, without sockets.

`Engine.handle(identity, header, payloads)` takes one request's frames and returns the reply's
frames; the transport only moves frames. Every failure becomes a typed error reply. State is
mutated under one re-entrant lock, held per request: the transport thread is its main user, the
lease reaper, session expiry, L2 write completions and the admin API the others. The only I/O
under it is a lookup's L2 reads, which that lookup is waiting for anyway.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import kvtier
from kvtier import protocol as p
from kvtier.config import ServerConfig
from kvtier.errors import (
    BadArrayError,
    HashContractError,
    InternalError,
    InvalidArgumentError,
    KVTierError,
    MisalignedRangeError,
    NoSpaceError,
    NotConnectedError,
    ProtocolVersionError,
    UnknownReservationError,
    UnknownSessionError,
)
from kvtier.hashing import TokenHasher
from kvtier.keys import ChunkKey
from kvtier.metrics import Metrics
from kvtier.periodic import (
    PeriodicThread,
    PeriodicThreadRegistry,
    ThreadLevel,
    ThreadRunSummary,
    create_periodic_thread,
)
from kvtier.server.layouts import LayoutRegistry
from kvtier.server.leases import LeaseBook, Peer, Reservation, RetrieveLease
from kvtier.session import Session, SessionManager
from kvtier.snapshots import ErrorRecord, Registration
from kvtier.storage.arena import Arena, default_arena_name
from kvtier.storage.l1 import L1Store
from kvtier.storage.manager import TierManager
from kvtier.storage.prefetch import prefetch

__all__ = ["Engine"]

logger = logging.getLogger(__name__)

_instances = itertools.count()


class Engine:
    """The server's state and request handlers (transport-agnostic)."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        registry: PeriodicThreadRegistry | None = None,
        tiers: TierManager | None = None,
        start_threads: bool = True,
    ) -> None:
        self.config = config
        self.clock = clock
        self.started_at = time.time()
        self.hasher = TokenHasher(config.chunk_size, config.hash_algorithm, seed=config.hash_seed)
        self.chunk_size = config.chunk_size
        self.contract = self.hasher.contract()
        self.host_id = p.local_host_id()
        self.server_id = uuid.uuid4().hex
        self.arena = Arena.create(
            config.arena_name or default_arena_name(config.address[0]),
            config.l1_size,
            prefault=config.prefault,
        )
        self.l1 = L1Store(self.arena.size, clock=clock)
        self.tiers = tiers
        self.metrics = Metrics()
        self._lock = threading.RLock()
        self._registry = registry or PeriodicThreadRegistry.get_instance()
        self.sessions = SessionManager(
            self.hasher,
            ttl=config.session_ttl,
            cleanup_interval=config.session_cleanup_interval if start_threads else None,
            registry=self._registry,
        )
        self.sessions.destroy_listeners.append(self._on_session_destroyed)
        self.layouts = LayoutRegistry()
        self.leases = LeaseBook(clock)
        self.recent_errors: deque[ErrorRecord] = deque(maxlen=50)
        self._ending: set[str] = set()  # sessions being ended on purpose, not expired
        self.orphaned_sessions = 0  # expired sessions that still held pins
        self._lookup_requested = 0
        self._lookup_hit = 0
        self._closed = False
        self._reaper: PeriodicThread | None = None
        if start_threads:
            self._reaper = create_periodic_thread(
                f"lease-reaper-{next(_instances)}",
                config.reap_interval,
                self.reap,
                ThreadLevel.CRITICAL,
                registry=self._registry,
                start=True,
            )

    # -- the one entry point --------------------------------------------------------------------

    def handle(
        self, identity: bytes, header: bytes | memoryview, payloads: Sequence[Any] = ()
    ) -> list[Any]:
        """One request's frames in, the reply's frames out (header first); never raises."""
        t0 = time.perf_counter()
        operation = "unknown"
        try:
            request = p.decode_request(header)
            operation = type(request).__name__
            with self._lock:
                frames = self._dispatch(identity, request, payloads)
        except KVTierError as exc:
            frames = [p.error_reply(exc)]
            self._record_error(operation, exc)
        except Exception as exc:  # a bug: still answer, so no client waits for a timeout
            logger.exception("handler for %s failed", operation)
            err = InternalError(f"{operation} failed inside the server: {exc!r}")
            frames = [p.error_reply(err)]
            self._record_error(operation, err)
        self.metrics.observe_request(operation, time.perf_counter() - t0)
        return frames

    def _record_error(self, operation: str, exc: KVTierError) -> None:
        self.metrics.count_error(operation, exc.code.name)
        self.recent_errors.append(
            ErrorRecord(
                time=time.time(), operation=operation, code=exc.code.name, message=exc.message
            )
        )

    def _dispatch(self, identity: bytes, req: p.Request, payloads: Sequence[Any]) -> list[Any]:
        if isinstance(req, p.Hello):
            return [p.encode(self._hello(identity, req))]
        client = self.leases.peer(identity)
        if client is None:
            raise NotConnectedError(f"send Hello before {type(req).__name__}: no handshake yet")
        client_id = client.client_id
        match req:
            case p.Heartbeat():
                reply: p.Reply = p.Ok()
            case p.Register():
                reply = self._register(client, req)
            case p.Lookup():
                reply = self._lookup(req)
            case p.Reserve():
                reply = self._reserve(client_id, req)
            case p.Commit():
                reply = self._commit(client_id, req.reservation_id)
            case p.Abort():
                reply = self._abort(client_id, req.reservation_id)
            case p.StoreInline():
                reply = self._store_inline(client_id, req, payloads)
            case p.Retrieve():
                return self._retrieve(client_id, req)
            case p.RetrieveDone():
                reply = self._retrieve_done(client_id, req.lease_id)
            case p.Release():
                self._require_session(req.request_id)
                self.l1.unpin(req.request_id)
                reply = p.Ok()
            case p.EndSession():
                self._require_session(req.request_id)
                self._remove_session(req.request_id)
                reply = p.Ok()
        return [p.encode(reply)]

    # -- handshake and registration -------------------------------------------------------------

    def _hello(self, identity: bytes, req: p.Hello) -> p.HelloReply:
        if req.protocol_version != p.PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"client speaks protocol version {req.protocol_version}, this server speaks "
                f"{p.PROTOCOL_VERSION}: install matching kvtier versions "
                f"(server {kvtier.__version__})"
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
            server_version=kvtier.__version__,
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
        if layout.nbytes * req.world_size > self.arena.size:
            raise NoSpaceError(
                f"one chunk of {req.model!r} needs {layout.nbytes * req.world_size} bytes "
                f"({req.world_size} ranks of {layout.nbytes}), more than the whole L1 of "
                f"{self.arena.size} bytes: restart the server with a larger --l1-size"
            )
        registration = Registration(
            model=req.model,
            world_size=req.world_size,
            worker_id=req.worker_id,
            chunk_shape=list(layout.chunk_shape),
            dtype=layout.dtype,
        )
        if registration not in client.registrations:
            client.registrations.append(registration)
        return p.Ok()

    # -- sessions and names -----------------------------------------------------------------------

    def _session(self, request_id: str, tokens: bytes) -> Session:
        if len(tokens) % 4:
            raise InvalidArgumentError(
                f"tokens must be packed uint32: {len(tokens)} bytes is not a multiple of 4"
            )
        session = self.sessions.get_or_create(request_id)
        session.set_tokens(tokens)
        return session

    def _range_keys(
        self,
        req: p.RangeRequest,
    ) -> list[ChunkKey]:
        cs = self.chunk_size
        if req.start % cs or req.end % cs or req.start < 0 or req.start > req.end:
            raise MisalignedRangeError(
                f"token range [{req.start}, {req.end}) must have both ends on multiples of the "
                f"chunk size {cs} with start <= end"
            )
        if req.num_chunks != (req.end - req.start) // cs:
            raise BadArrayError(
                f"the array holds {req.num_chunks} chunks but the range [{req.start}, "
                f"{req.end}) covers {(req.end - req.start) // cs} chunks of {cs} tokens"
            )
        session = self._session(req.request_id, req.tokens)
        keys = self._keys(session, req.model, req.cache_salt, req.world_size, req.end)
        return keys[req.start // cs :]

    @staticmethod
    def _keys(session: Session, model: str, salt: str, world_size: int, end: int) -> list[ChunkKey]:
        """Names of the session's chunks [0, end) under (model, salt, world_size).

        Kept per session and extended as it grows: a repeated lookup of a long prompt builds no
        new keys. Hashes are chained, so when the last cached key still carries the hash at its
        position, every earlier one does too; otherwise the cache is rebuilt.
        """
        hashes = session.get_hashes(0, end)
        cache: dict[tuple[str, str, int], list[ChunkKey]] = session.extras.setdefault(
            "chunk_keys", {}
        )
        keys = cache.setdefault((model, salt, world_size), [])
        n = len(hashes)
        valid = min(len(keys), n)  # the cached keys agree with these hashes up to here
        if valid and keys[valid - 1].chunk_hash != hashes[valid - 1]:
            keys.clear()
        elif len(keys) >= n:
            return keys[:n]  # a shorter range of a prompt already named: keep the rest cached
        keys.extend(ChunkKey(model, salt, world_size, h) for h in hashes[len(keys) :])
        return keys[:]

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
        with self._lock:
            held_pins = self.l1.unpin(session.request_id)
            if held_pins and session.request_id not in self._ending:
                self.orphaned_sessions += 1  # the engine abandoned it mid-flight, holding cache

    # -- lookup ---------------------------------------------------------------------------------

    def _lookup(self, req: p.Lookup) -> p.LookupReply:
        if req.world_size < 1:
            raise InvalidArgumentError(f"world_size must be >= 1, got {req.world_size}")
        session = self._session(req.request_id, req.tokens)
        num_tokens = session.num_tokens
        keys = self._keys(
            session,
            req.model,
            req.cache_salt,
            req.world_size,
            num_tokens - num_tokens % self.chunk_size,
        )
        hit = self.l1.count_prefix(keys)
        if hit:
            self.l1.pin(
                req.request_id,
                keys[:hit],
                ranks=range(req.world_size),
                lease_s=self.config.pin_lease,
            )
        if hit < len(keys) and self.tiers is not None:
            hit = self._prefetch(req, keys, hit)
        if hit:
            self.l1.touch(keys[:hit])
        else:
            self.l1.unpin(req.request_id)
        hit_tokens = hit * self.chunk_size
        self._lookup_requested += session.num_tokens
        self._lookup_hit += hit_tokens
        self.metrics.observe_lookup(req.model, session.num_tokens, hit_tokens)
        return p.LookupReply(hit_tokens)

    def _prefetch(self, req: p.Lookup, keys: list[ChunkKey], hit: int) -> int:
        """Extend an L1 hit with the following chunks every rank has in L2, and pin them."""
        assert self.tiers is not None
        layout = self.layouts.get(req.model, req.world_size)
        if layout is None:
            return hit  # no worker told us the layout: nothing in L2 can be checked or loaded
        with prefetch(
            self.l1,
            self.arena,
            self.tiers,
            keys[hit:],
            nbytes=layout.nbytes,
            layout=layout.text,
            lease_s=self.config.staging_lease,
        ) as loaded:
            if loaded:
                hit += len(loaded)
                self.l1.pin(
                    req.request_id,
                    keys[:hit],
                    ranks=range(req.world_size),
                    lease_s=self.config.pin_lease,
                )
        return hit

    # -- store ----------------------------------------------------------------------------------

    def _reserve(self, client_id: str, req: p.RangeRequest) -> p.ReserveReply:
        layout = self.layouts.check(
            req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype
        )
        keys = self._range_keys(req)
        offsets: list[int] = []
        reserved: list[ChunkKey] = []
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

    def _commit(self, client_id: str, reservation_id: int) -> p.StoreReply:
        res = self.leases.take_reservation(client_id, reservation_id, self.config.staging_lease)
        lost = 0
        for key in res.reserved:
            try:
                self.l1.commit(key, res.worker_id, owner=client_id)
            except UnknownReservationError:
                lost += 1
                continue
            self._write_through(key, res.worker_id)
        self.l1.touch(res.keys)
        self.metrics.add_stored_bytes((len(res.reserved) - lost) * res.nbytes)
        if lost:
            raise UnknownReservationError(
                f"{lost} of {len(res.reserved)} staging slots expired before the commit "
                f"(--staging-lease {self.config.staging_lease:g}s); those chunks are not stored"
            )
        return p.StoreReply(len(res.keys))

    def _abort(self, client_id: str, reservation_id: int) -> p.Ok:
        res = self.leases.take_reservation(client_id, reservation_id, self.config.staging_lease)
        for key in res.reserved:
            self.l1.abort(key, res.worker_id, owner=client_id)
        return p.Ok()

    def _store_inline(
        self, client_id: str, req: p.StoreInline, payloads: Sequence[Any]
    ) -> p.StoreReply:
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
        reply = self._reserve(client_id, req)
        for offset, frame in zip(reply.offsets, payloads, strict=True):
            if offset >= 0:  # a remote client's bytes have to land in the arena somehow
                self.arena.view(offset, layout.nbytes)[:] = memoryview(frame).cast("B")
        if reply.reservation_id:
            return self._commit(client_id, reply.reservation_id)
        return p.StoreReply(req.num_chunks)

    def _write_through(self, key: ChunkKey, worker_id: int) -> None:
        """Queue a newly committed shard for the L2 tiers; its slot stays held until written."""
        if self.tiers is None:
            return
        shard = self.l1.get_shard(key, worker_id)
        assert shard is not None
        offset, size, layout = shard
        self.l1.acquire(key)

        def done() -> None:
            with self._lock:
                self.l1.release(key)

        self.tiers.submit(key.shard(worker_id), self.arena.view(offset, size), layout, done)

    # -- retrieve -------------------------------------------------------------------------------

    def _retrieve(self, client_id: str, req: p.Retrieve) -> list[Any]:
        layout = self.layouts.check(
            req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype
        )
        keys = self._range_keys(req)
        offsets: list[int] = []
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
        if req.inline:
            # bytes() copies under the lock, so the slots may be reused once it is released.
            frames = [bytes(self.arena.view(off, layout.nbytes)) for off in offsets]
            self.l1.mark_retrieved(req.request_id, req.worker_id)
            self.metrics.add_retrieved_bytes(len(frames) * layout.nbytes)
            reply = p.RetrieveReply(len(offsets), [], 0, layout.nbytes)
            return [p.encode(reply), *frames]
        lease_id = 0
        if found:
            for key in found:
                self.l1.acquire(key)
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
        return [p.encode(p.RetrieveReply(len(offsets), offsets, lease_id, layout.nbytes))]

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
        with self._lock:
            expired = self.leases.sweep(self.config.client_timeout)
            for client_id in expired.dead_clients:
                logger.info("client %s stopped heartbeating: reclaiming its leases", client_id)
                self.l1.reclaim_staging(owner=client_id)
            for res in expired.reservations:
                for key in res.reserved:
                    with contextlib.suppress(UnknownReservationError):  # reclaimed just above
                        self.l1.abort(key, res.worker_id, owner=res.owner)
            for lease in expired.leases:
                self._end_lease(lease)
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

    # -- admin backend --------------------------------------------------------------------------

    def is_ready(self) -> bool:
        return not self._closed

    def lookup_totals(self) -> tuple[int, int]:
        """(tokens asked about, tokens found cached) by every lookup since start."""
        return self._lookup_requested, self._lookup_hit

    @property
    def lock(self) -> threading.RLock:
        """The lock every read of the engine's state takes (the admin views use it)."""
        return self._lock

    def end_session(self, request_id: str) -> bool:
        """End a session on purpose and drop its pins; False if there was none."""
        with self._lock:
            return self._remove_session(request_id) is not None

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop background work, flush the L2 queue, and remove the arena; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.stop()
            self._registry.unregister(self._reaper.name)
        self.sessions.close()
        if self.tiers is not None:
            self.tiers.close()
        self.arena.close()

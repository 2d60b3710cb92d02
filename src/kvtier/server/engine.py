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
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

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
from kvtier.names import named_chunk_keys
from kvtier.periodic import PeriodicThread, PeriodicThreadRegistry, ThreadRunSummary
from kvtier.redaction import redact
from kvtier.server import naming
from kvtier.server.answers import Answer, Respond, offloaded
from kvtier.server.auth import Authenticator, scoped
from kvtier.server.fencing import CopyGuard, FencingStats, Watch, watch_process
from kvtier.server.layouts import LayoutRegistry
from kvtier.server.leases import Expired, LeaseBook, Peer, Reservation, RetrieveLease
from kvtier.server.limits import Limits, SessionBounds
from kvtier.server.locking import HoldStats, TimedLock
from kvtier.server.lookups import LookupBook
from kvtier.server.writethrough import Shard, WriteThrough
from kvtier.session import Session, SessionManager
from kvtier.snapshots import ErrorRecord, Registration
from kvtier.storage.arena import Arena
from kvtier.storage.l1 import L1Store
from kvtier.storage.manager import TierManager
from kvtier.storage.prefetch import Prefetcher

__all__ = ["Engine", "EngineParts", "Respond"]

logger = logging.getLogger(__name__)

_Scoped = TypeVar("_Scoped", p.Lookup, p.Reserve, p.StoreInline, p.Retrieve)
_ScopedNames = TypeVar(
    "_ScopedNames", p.ExistsKeys, p.ReserveKeys, p.StoreKeysInline, p.RetrieveKeys
)


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
    #: the credentials Hello checks; empty (everyone anonymous) without --auth-tokens-file
    auth: Authenticator = field(default_factory=Authenticator)


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
        self.auth = parts.auth
        self.limits = Limits(
            chunk_size=config.chunk_size,
            max_request_tokens=config.max_request_tokens,
            max_world_size=config.max_world_size,
            max_chunk_bytes=self.arena.size,
        )
        # Requests with big prompts or inline bytes run here, so the transport thread only
        # decodes, routes and replies (see `_offloaded`).
        self._handlers = parts.handlers
        self.sessions = parts.sessions
        self.sessions.destroy_listeners.append(self._on_session_destroyed)
        self.layouts = LayoutRegistry()
        self.leases = LeaseBook(clock)
        self.lookups = LookupBook(config, self.l1, self.tiers, self.prefetcher, self.metrics)
        self.recent_errors: deque[ErrorRecord] = deque(maxlen=50)
        self._ending: set[str] = set()  # sessions being ended on purpose, not expired
        self.orphaned_sessions = 0  # expired sessions that still held pins
        self._session_tokens = 0  # tokens held by all sessions together
        self._shed_sessions = 0  # ended early to keep within --max-sessions/--max-session-tokens
        self._lease_expired_count = 0  # commits and retrieve-dones answered LEASE_EXPIRED
        self._closed = False
        #: periodic threads the assembler started for this engine (the lease reaper)
        self.threads: list[PeriodicThread] = []
        self._registry = parts.registry

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
            answer.operation = type(request).__name__
            self.limits.check(request)  # every count and size, before any work
        except Exception as exc:
            answer.error(exc)
            return
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
        self.recent_errors.append(
            ErrorRecord(
                time=time.time(),
                operation=operation,
                code=exc.code.name,
                message=redact(exc.message),
            )
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
                reply = self._lookup(self._scope(client, req), answer)
            case p.LookupPoll():
                poll = msgspec.structs.replace(
                    req, request_id=self._session_id(client, req.request_id, req.cache_salt)
                )
                with self._lock.hold(op):
                    reply = self.lookups.poll(poll, answer)
            case p.Reserve():
                self._require_watch(client, "Reserve")
                req = self._scope(client, req)
                reply = self._reserve(client_id, req, self._range_keys(req), client.watch)
            case p.Commit():
                with self._lock.hold(op):
                    committed = self._commit(client_id, req.reservation_id)
                reply = self._write_committed(committed, answer)
            case p.Abort():
                with self._lock.hold(op):
                    reply = self._abort(client_id, req.reservation_id)
            case p.StoreInline():
                reply = self._store_inline(client_id, self._scope(client, req), payloads, answer)
            case p.Retrieve():
                if not req.inline:
                    self._require_watch(client, "Retrieve")
                return self._retrieve(client_id, self._scope(client, req), client.watch)
            case p.RetrieveDone():
                with self._lock.hold(op):
                    reply = self._retrieve_done(client_id, req.lease_id)
            case p.Release():
                request_id = self._session_id(client, req.request_id, req.cache_salt)
                self._require_session(request_id)
                with self._lock.hold(op):
                    self.l1.unpin(request_id)
                reply = p.Ok()
            case p.EndSession():
                request_id = self._session_id(client, req.request_id, req.cache_salt)
                self._require_session(request_id)
                with self._lock.hold(op):
                    self._remove_session(request_id)
                reply = p.Ok()
            case p.Goodbye():
                with self._lock.hold(op):
                    self._goodbye(client_id)
                reply = p.Ok()
            case p.ExistsKeys():
                reply = self._exists_keys(self._scope_names(client, req), answer)
            case p.ReserveKeys():
                self._require_watch(client, "ReserveKeys")
                req = self._scope_names(client, req)
                reply = self._reserve(client_id, req, self._range_keys(req), client.watch)
            case p.StoreKeysInline():
                req = self._scope_names(client, req)
                reply = self._store_inline(client_id, req, payloads, answer)
            case p.RetrieveKeys():
                if not req.inline:
                    self._require_watch(client, "RetrieveKeys")
                return self._retrieve(client_id, self._scope_names(client, req), client.watch)
            case _:
                raise InternalError(f"no handler for {type(req).__name__}")
        if reply is None:
            return None
        return [_OK if type(reply) is p.Ok else p.encode(reply)]

    # -- tenants ----------------------------------------------------------------------------------

    @staticmethod
    def _session_id(client: Peer, request_id: str, cache_salt: str) -> str:
        """Sessions and pins are scoped per tenant: its credential's, or with none its salt, so
        one tenant reusing another's request id neither sees nor ends the other's session."""
        return scoped(client.tenant or cache_salt, request_id)

    def _scope(self, client: Peer, req: _Scoped) -> _Scoped:
        """The request as the engine handles it: session id, model and salt in the client's
        tenant's namespace (the anonymous tenant's names are unchanged), after checking that its
        credential may use the salt."""
        client.credential.check_salt(req.cache_salt)
        request_id = self._session_id(client, req.request_id, req.cache_salt)
        if not client.tenant:
            if request_id == req.request_id:
                return req
            return msgspec.structs.replace(req, request_id=request_id)
        return msgspec.structs.replace(
            req,
            request_id=request_id,
            model=scoped(client.tenant, req.model),
            cache_salt=scoped(client.tenant, req.cache_salt),
        )

    @staticmethod
    def _scope_names(client: Peer, req: _ScopedNames) -> _ScopedNames:
        """A key-addressed request in the client's tenant's namespace (model and salt), after
        checking that its credential may use the salt. Named chunks have no session."""
        client.credential.check_salt(req.cache_salt)
        if not client.tenant:
            return req
        return msgspec.structs.replace(
            req,
            model=scoped(client.tenant, req.model),
            cache_salt=scoped(client.tenant, req.cache_salt),
        )

    @staticmethod
    def _require_watch(client: Peer, what: str) -> None:
        if client.watch is None:
            raise InvalidArgumentError(
                f"{what} hands out arena slots, which only a client on this machine whose "
                "process the server can watch may use (name its pid at Hello); move the bytes "
                "inline instead (StoreInline, Retrieve with inline=True)"
            )

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
        credential = self.auth.authenticate(req.token)
        # Only a process on this machine can touch the arena; the pidfd is what fences it.
        watch = watch_process(req.pid) if req.host_id == self.host_id else None
        self.leases.connect(identity, req.client_id, credential=credential, watch=watch)
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
        # Layouts live in the tenant's namespace: another tenant registering a bogus layout for
        # the same model name first cannot lock this tenant's workers out.
        layout = self.layouts.register(
            scoped(client.tenant, req.model),
            req.world_size,
            req.worker_id,
            req.chunk_shape,
            req.dtype,
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

    def _goodbye(self, client_id: str) -> None:
        """A client closed on purpose: forget it and reclaim what it still holds."""
        logger.info("client %s closed", client_id)
        self._reclaim(self.leases.disconnect(client_id))

    # -- sessions and names (no engine lock: sessions guard themselves) -------------------------

    def _session(self, request_id: str, tokens: bytes) -> Session:
        before = self._held_tokens(request_id)
        session = naming.session_for(self.sessions, request_id, tokens)
        self._account(session, before)
        return session

    def _held_tokens(self, request_id: str) -> int:
        session = self.sessions.peek(request_id)
        return 0 if session is None else session.num_tokens

    def _account(self, session: Session, before: int) -> None:
        """Count the session's token change against --max-session-tokens; shed if over."""
        with self._lock.hold("sessions"):
            self._session_tokens += session.num_tokens - before
            if (
                self.sessions.active_count() > self.config.max_sessions
                or self._session_tokens > self.config.max_session_tokens
            ):
                self._shed_sessions_for(session)

    def _shed_sessions_for(self, keep: Session) -> None:
        """End the longest-idle sessions until both session bounds hold with 10% to spare (so
        a server at its bound does not sort its sessions on every request); counted."""
        max_sessions = self.config.max_sessions * 9 // 10
        max_tokens = self.config.max_session_tokens * 9 // 10
        for session in self.sessions.sessions():  # least recently used first
            if self.sessions.active_count() <= max_sessions and self._session_tokens <= max_tokens:
                break
            if session is keep:
                continue
            self._shed_sessions += 1
            self._remove_session(session.request_id)

    def _range_keys(self, req: p.RangeRequest | p.KeyRequest) -> list[ChunkKey]:
        if isinstance(req, p.KeyRequest):  # named by the caller: no session, no token range
            if req.num_chunks != len(req.names):
                raise BadArrayError(
                    f"the array holds {req.num_chunks} chunks but {len(req.names)} names came"
                )
            return named_chunk_keys(
                req.names, model=req.model, cache_salt=req.cache_salt, world_size=req.world_size
            )
        before = self._held_tokens(req.request_id)
        keys = naming.range_keys(self.sessions, self.chunk_size, req)
        session = self.sessions.peek(req.request_id)
        if session is not None:
            self._account(session, before)
        return keys

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
            self._session_tokens -= session.num_tokens
            self.lookups.forget(session.request_id)
            held_pins = self.l1.unpin(session.request_id)
            if held_pins and session.request_id not in self._ending:
                self.orphaned_sessions += 1  # the engine abandoned it mid-flight, holding cache

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

    def _exists_keys(self, req: p.ExistsKeys, answer: Answer) -> p.ExistsReply | None:
        """Leading named chunks every rank has; the ones only L2 holds are loaded into L1 first
        (a prefetch job; the answer comes when it ends, or at once from L1 when none can start).

        Unlike a lookup nothing is pinned: named chunks have no session to release a pin, and a
        chunk evicted before the caller's get is a miss there, never wrong bytes.
        """
        keys = named_chunk_keys(
            req.names, model=req.model, cache_salt=req.cache_salt, world_size=req.world_size
        )
        layout = self.layouts.get(req.model, req.world_size)

        def count(_loaded: object = None) -> p.ExistsReply:  # under the lock
            hit = self.l1.count_prefix(keys)
            self.l1.touch(keys[:hit])
            return p.ExistsReply(hit)

        with self._lock.hold(answer.operation):
            hit = self.l1.count_prefix(keys)
            if hit < len(keys) and layout is not None and self.tiers.tiers:
                started = self.prefetcher.submit(
                    keys[hit:],
                    nbytes=layout.nbytes,
                    layout=layout.text,
                    on_done=lambda loaded: answer.reply(count(loaded)),
                )
                if started:
                    return None
            return count()

    # -- store ----------------------------------------------------------------------------------

    def _reserve(
        self,
        client_id: str,
        req: p.RangeRequest | p.KeyRequest,
        keys: list[ChunkKey],
        watch: Watch | None,
    ) -> p.ReserveReply:
        """Staging slots for `keys`; `watch` tells while whoever copies into them may still
        touch them (the client's process, or the server's own inline copy)."""
        layout = self.layouts.check(
            req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype
        )
        offsets: list[int] = []
        reserved: list[ChunkKey] = []
        with self._lock.hold("Reserve"):
            try:
                for key in keys:
                    if self.l1.is_busy(key, req.worker_id):
                        # Another client is storing it right now: this store cannot call it
                        # stored (that client may still abort or die).
                        offsets.append(p.IN_FLIGHT)
                        continue
                    offset = self.l1.reserve(
                        key,
                        req.worker_id,
                        layout.nbytes,
                        owner=client_id,
                        lease_s=self.config.staging_lease,
                        layout=layout.text,
                    )
                    offsets.append(p.STORED if offset is None else offset)
                    if offset is not None:
                        reserved.append(key)
            except BaseException:  # NoSpaceError or a bug: never leak the slots taken so far
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
                        watch=None if watch is None else watch.retain(),
                    )
                )
        return p.ReserveReply(reservation_id, offsets, layout.nbytes)

    def _stored_prefix(self, keys: list[ChunkKey], worker_id: int) -> int:
        """How many leading chunks of `keys` are READY for this rank: what a store reports."""
        n = 0
        for key in keys:
            if self.l1.get_shard(key, worker_id) is None:
                break
            n += 1
        return n

    def _end_reservation(self, res: Reservation) -> None:
        """Free what an ended reservation still holds: its staging or quarantined slots."""
        if res.lapsed:
            for offset, nbytes in res.fenced:
                self.l1.unfence(offset, nbytes)
            res.fenced.clear()
        else:
            for key in res.reserved:
                with contextlib.suppress(UnknownReservationError):  # committed meanwhile
                    self.l1.abort(key, res.worker_id, owner=res.owner)
        if res.watch is not None:
            res.watch.release()
            res.watch = None

    def _fence(self, res: Reservation) -> None:
        """Quarantine a lapsed reservation's staging slots: its writer may still be copying."""
        for key in res.reserved:
            with contextlib.suppress(UnknownReservationError):
                res.fenced.append(self.l1.fence(key, res.worker_id, owner=res.owner))

    def _lease_expired(self, what: str) -> LeaseExpiredError:
        self._lease_expired_count += 1
        return LeaseExpiredError(
            f"{what} expired before it was acknowledged (--staging-lease "
            f"{self.config.staging_lease:g}s): nothing of it counts; recompute"
        )

    def _commit(self, client_id: str, reservation_id: int) -> _Committed:
        """Make a reservation's slots ready (under the lock); what to write through to L2."""
        res = self.leases.take_reservation(client_id, reservation_id, self.config.staging_lease)
        if res.lapsed:
            self._end_reservation(res)
            raise self._lease_expired("the store's staging lease")
        if res.watch is not None:
            res.watch.release()
            res.watch = None
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
        return _Committed(p.StoreReply(self._stored_prefix(res.keys, res.worker_id)), shards)

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
        self._end_reservation(res)
        return p.Ok()

    def _store_inline(
        self,
        client_id: str,
        req: p.StoreInline | p.StoreKeysInline,
        payloads: Sequence[Any],
        answer: Answer,
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
        keys = self._range_keys(req)
        # The server copies into the slots itself, outside the lock: the guard keeps them
        # fenced, should the lease lapse, until that copy is over.
        guard = CopyGuard()
        reply = self._reserve(client_id, req, keys, guard)
        try:
            for offset, frame in zip(reply.offsets, payloads, strict=True):
                if offset >= 0:  # a remote client's bytes have to land in the arena somehow
                    self.arena.view(offset, layout.nbytes)[:] = memoryview(frame).cast("B")
        except BaseException:
            if reply.reservation_id:
                with self._lock.hold("StoreInline"):
                    self._abort(client_id, reply.reservation_id)
            raise
        finally:
            guard.finish()
        if reply.reservation_id:
            with self._lock.hold("StoreInline"):
                committed = self._commit(client_id, reply.reservation_id)
            return self._write_committed(committed, answer)
        with self._lock.hold("StoreInline"):
            return p.StoreReply(self._stored_prefix(keys, req.worker_id))

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

    def _retrieve(
        self, client_id: str, req: p.Retrieve | p.RetrieveKeys, watch: Watch | None
    ) -> list[Any]:
        """The leading chunks held for this rank: their slots under a lease (fenced by the
        client's `watch` should it lapse), or, inline, their bytes copied by the server."""
        layout = self.layouts.check(
            req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype
        )
        keys = self._range_keys(req)
        offsets: list[int] = []
        lease_id = 0
        guard = CopyGuard() if req.inline else None
        # Named chunks have no session: their retrieve neither renews nor releases any pin.
        session_id = req.request_id if isinstance(req, p.Retrieve) else None
        with self._lock.hold("Retrieve"):
            for key in keys:
                shard = self.l1.get_shard(key, req.worker_id)
                if shard is None or not self.l1.is_complete(key):
                    break
                offsets.append(shard[0])
            found = keys[: len(offsets)]
            if found:
                self.l1.touch(found)
                if session_id is not None and self.l1.pinned_keys(session_id):
                    self.l1.renew(session_id, self.config.pin_lease)  # pins live while in use
                for key in found:
                    self.l1.acquire(key)  # held while the bytes are copied out
                lease_id = self.leases.add_lease(
                    RetrieveLease(
                        client_id,
                        session_id,
                        req.worker_id,
                        found,
                        layout.nbytes,
                        self.clock() + self.config.staging_lease,
                        watch=guard if guard is not None else watch and watch.retain(),
                    )
                )
        if not req.inline:
            return [p.encode(p.RetrieveReply(len(offsets), offsets, lease_id, layout.nbytes))]
        # Inline: copy the held slots into frames outside the lock, then end the lease.
        try:
            frames = [bytes(self.arena.view(off, layout.nbytes)) for off in offsets]
        finally:
            assert guard is not None
            guard.finish()
        if lease_id:
            with self._lock.hold("Retrieve"):
                self._retrieve_done(client_id, lease_id)
        elif session_id is not None:
            with self._lock.hold("Retrieve"):
                self.l1.mark_retrieved(session_id, req.worker_id)
        return [p.encode(p.RetrieveReply(len(offsets), [], 0, layout.nbytes)), *frames]

    def _retrieve_done(self, client_id: str, lease_id: int) -> p.Ok:
        lease = self.leases.take_lease(client_id, lease_id)
        self._end_lease(lease)
        if lease.lapsed:  # the slots were kept, but the copy was not vouched for in time
            raise self._lease_expired("the retrieve's lease")
        if lease.request_id is not None:
            self.l1.mark_retrieved(lease.request_id, lease.worker_id)
        self.metrics.add_retrieved_bytes(len(lease.keys) * lease.nbytes)
        return p.Ok()

    def _end_lease(self, lease: RetrieveLease) -> None:
        for key in lease.keys:
            self.l1.release(key)
        if lease.watch is not None:
            lease.watch.release()
            lease.watch = None

    # -- background -----------------------------------------------------------------------------

    def reap(self) -> ThreadRunSummary:
        """Reclaim what dead or slow clients hold: staging slots, retrieve leases, pins."""
        # Staging slots are reclaimed only through the lease book, never by an L1 deadline: a
        # slot whose writer may still be copying (a paused client, a slow L2 read of a
        # prefetch) is fenced, not freed, until the writer acknowledges or its process exits.
        with self._lock.hold("reap"):
            expired = self.leases.sweep(self.config.client_timeout)
            for client_id in expired.dead_clients:
                logger.info("client %s stopped heartbeating: reclaiming its leases", client_id)
            for res in expired.fenced:
                self._fence(res)
            self._reclaim(expired)
            staging = len(expired.reservations) + len(expired.fenced)
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
                "fenced": len(expired.fenced) + len(expired.held),
            },
        )

    def _reclaim(self, gone: Expired) -> None:
        """Release what the book ended (under the lock): reservations and leases whose owner
        can no longer touch their slots."""
        for res in gone.reservations:
            self._end_reservation(res)
        for lease in gone.leases:
            self._end_lease(lease)

    # -- admin backend --------------------------------------------------------------------------

    def is_ready(self) -> bool:
        return not self._closed

    def lock_stats(self) -> dict[str, HoldStats]:
        """The longest and total hold of the engine lock, per operation."""
        return self._lock.stats()

    def fencing_stats(self) -> FencingStats:
        """The quarantine of lapsed slots now (see `server/fencing.py`)."""
        with self._lock.hold("status"):
            l1 = self.l1.stats()
            return FencingStats(
                lapsed=self.leases.num_lapsed,
                fenced_slots=l1.fenced_slots,
                fenced_bytes=l1.fenced_bytes,
                lease_expired=self._lease_expired_count,
            )

    def session_bounds(self) -> SessionBounds:
        """Tokens held by sessions and sessions shed to stay within the bounds."""
        return SessionBounds(tokens=self._session_tokens, shed=self._shed_sessions)

    def lookup_totals(self) -> tuple[int, int]:
        """(tokens asked about, tokens found cached) by every lookup since start."""
        return self.lookups.requested_tokens, self.lookups.hit_tokens

    @property
    def lock(self) -> TimedLock:
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
        for thread in self.threads:
            thread.stop()
            self._registry.unregister(thread.name)
        self._handlers.shutdown(wait=True, cancel_futures=True)
        self.prefetcher.close()
        self._write_through.close()
        self.sessions.close()
        self.tiers.close()
        self.arena.close()

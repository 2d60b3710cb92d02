"""The server without sockets: one entry point that routes each request to its handler.

`Engine.handle(identity, header, payloads, respond)` takes one request's frames and answers
through `respond(frames)` exactly once (see `answers.py`): at once for most requests, later
(from another thread) for a lookup that waits on L2 loads or a commit that waits for room in a
full L2 queue. Every failure becomes a typed error reply.

Each request type has one route (`routes.py`): its bounds, whether a handler thread takes it,
its tenant scoping and its handler. The engine looks the route up and runs it in that order, and
keeps the reaping and the admin accessors. Each request family has its own module, built here
and handed the parts it needs: `handshake.py` (Hello, Register), `lookups.py` (Lookup,
LookupPoll, ExistsKeys), `stores.py` (Reserve, Commit, Abort, StoreInline and their
key-addressed forms), `retrieves.py` (Retrieve, RetrieveDone), `sessions.py` (a request's session
and chunk names, the session bounds, a session's end), `handoffs.py` (prefill/decode hand-offs).

State is shared by the transport thread, the prefetch workers, the lease reaper, session expiry,
L2 write completions and the admin API, and guarded by one lock (`TimedLock`) that each holds
only for short sections: hashing a prompt, building names, tier I/O and encoding big replies
happen outside it. Its longest hold per operation is measured (`lock_stats()`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvtier import protocol as p
from kvtier.config import ServerConfig
from kvtier.errors import KVTierError, NotConnectedError
from kvtier.hashing import TokenHasher
from kvtier.layouts import LayoutRegistry
from kvtier.periodic import PeriodicThread, PeriodicThreadRegistry, ThreadRunSummary
from kvtier.redaction import redact
from kvtier.server import tenants
from kvtier.server.answers import Answer, Respond
from kvtier.server.auth import Authenticator
from kvtier.server.fencing import FencingStats
from kvtier.server.leases import Expired, LeaseBook
from kvtier.server.limits import Limits, SessionBounds
from kvtier.server.locking import HoldStats, TimedLock
from kvtier.server.observe.chunk_notes import ChunkNotes
from kvtier.server.observe.chunkmemory import ChunkMemory
from kvtier.server.observe.metrics import Metrics
from kvtier.server.observe.snapshots import ErrorRecord
from kvtier.server.requests.handoffs import HandoffBook
from kvtier.server.requests.handshake import Handshake
from kvtier.server.requests.lookups import LookupBook
from kvtier.server.requests.retrieves import RetrieveBook
from kvtier.server.requests.sessions import SessionBook
from kvtier.server.requests.stores import StoreBook
from kvtier.server.routes import Call, Route, route_of
from kvtier.server.writethrough import WriteThrough
from kvtier.session import SessionManager
from kvtier.storage.arena import Arena
from kvtier.storage.l1 import L1Store
from kvtier.storage.manager import TierManager
from kvtier.storage.prefetch import Prefetcher

__all__ = ["Engine", "EngineParts", "Respond"]

logger = logging.getLogger(__name__)

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
    #: what each tier holds and lost, by chunk name: what a lookup's misses are explained from
    memory: ChunkMemory
    #: the credentials Hello checks; empty (everyone anonymous) without --auth-tokens-file
    auth: Authenticator = field(default_factory=Authenticator)
    #: the tokens of stored chunks the KV events publish; keeps none without them
    notes: ChunkNotes = field(default_factory=ChunkNotes)


class Engine:
    """The server's state and the request families (transport-agnostic)."""

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
        self.arena = parts.arena
        self.l1 = parts.l1
        self.tiers = parts.tiers
        self.metrics = parts.metrics
        self._lock = parts.lock
        self.prefetcher = parts.prefetcher
        self._write_through = parts.write_through
        self.auth = parts.auth
        self.memory = parts.memory
        self.limits = Limits(
            chunk_size=config.chunk_size,
            max_request_tokens=config.max_request_tokens,
            max_world_size=config.max_world_size,
            max_chunk_bytes=self.arena.size,
            max_lookup_shards=config.max_lookup_shards,
        )
        # Requests with big prompts or inline bytes run here, so the transport thread only
        # decodes, routes and replies (see `Route.offloaded`).
        self._handlers = parts.handlers
        self.sessions = parts.sessions
        self.layouts = LayoutRegistry(clock)
        self.leases = LeaseBook(clock)
        self.handshake = Handshake(
            hasher=self.hasher,
            auth=self.auth,
            leases=self.leases,
            layouts=self.layouts,
            arena=self.arena,
            chunk_size=self.chunk_size,
            host_id=p.local_host_id(),
            server_id=uuid.uuid4().hex,
            max_clients_per_tenant=config.max_clients_per_tenant,
            max_connections_per_client=config.max_connections_per_client,
            max_watched_processes=config.max_watched_processes,
            max_registrations_per_client=config.max_registrations_per_client,
        )
        # The request families, each in its own module (see there what runs under the lock).
        self.lookups = LookupBook(
            config, self.l1, self.tiers, self.prefetcher, self.metrics, self.memory
        )
        self.session_book = SessionBook(config, self.sessions, self.l1, self.lookups, self._lock)
        self.sessions.destroy_listeners.append(self.session_book.end)
        self.handoffs = HandoffBook(
            l1=self.l1,
            tiers=self.tiers,
            metrics=self.metrics,
            lease_s=config.handoff_lease,
            clock=clock,
        )
        self.stores = StoreBook(
            config,
            arena=self.arena,
            l1=self.l1,
            tiers=self.tiers,
            layouts=self.layouts,
            leases=self.leases,
            sessions=self.session_book,
            write_through=self._write_through,
            metrics=self.metrics,
            lock=self._lock,
            clock=clock,
            notes=parts.notes,
            handoffs=self.handoffs,
        )
        self.retrieves = RetrieveBook(
            config,
            arena=self.arena,
            l1=self.l1,
            layouts=self.layouts,
            leases=self.leases,
            sessions=self.session_book,
            metrics=self.metrics,
            lock=self._lock,
            clock=clock,
        )
        self.recent_errors: deque[ErrorRecord] = deque(maxlen=50)
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
            route = route_of(request)
            route.bounds(self.limits, request)  # every count and size, before any work
        except Exception as exc:
            answer.error(exc)
            return
        if route.offloaded(request, self.chunk_size):
            try:
                self._handlers.submit(self._run, identity, route, request, payloads, answer)
                return
            except RuntimeError:  # the pool is shut down: the server is closing
                pass
        self._run(identity, route, request, payloads, answer)

    def _run(
        self,
        identity: bytes,
        route: Route[Any],
        request: p.Request,
        payloads: Sequence[Any],
        answer: Answer,
    ) -> None:
        try:
            frames = self._dispatch(identity, route, request, payloads, answer)
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
        self,
        identity: bytes,
        route: Route[Any],
        req: p.Request,
        payloads: Sequence[Any],
        answer: Answer,
    ) -> list[Any] | None:
        """Run a request's route; the reply's frames, or None when `answer` is kept for later.

        Every request but Hello comes from a client that said Hello; one that hands out arena
        slots from a client the server can watch; and it is put in its client's tenant before
        its handler makes any session for it."""
        client = None
        if route.connected:
            with self._lock.hold(answer.operation):
                client = self.leases.peer(identity)
            if client is None:
                raise NotConnectedError(f"send Hello before {answer.operation}: no handshake yet")
            if route.watched(req):
                tenants.require_watch(client, answer.operation)
            req = route.scope(client, req)
        reply = route.handle(self, Call(identity, req, client, payloads, answer))
        if reply is None or isinstance(reply, list):
            return reply
        return [_OK if type(reply) is p.Ok else p.encode(reply)]

    def goodbye(self, client_id: str) -> None:
        """Under the lock: a client closed on purpose; forget it and reclaim what it still
        holds."""
        logger.info("client %s closed", client_id)
        self._reclaim(self.leases.disconnect(client_id))

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
                self.stores.fence(res)
            for res in (*expired.fenced, *expired.reservations):
                self.memory.lapsed(res.reserved)  # what a later lookup misses, and why
            self._reclaim(expired)
            staging = len(expired.reservations) + len(expired.fenced)
            self.layouts.expire(self.config.layout_ttl)
            lapsed = self.l1.reclaim_pins(self._pin_owner_seen)
            self.retrieves.pins_lapsed(lapsed)
            handed_off = self.handoffs.lapsed(lapsed)
            self.handoffs.release_shared()
            pins = len(lapsed)
        self.handoffs.delete_l2(handed_off)  # tier I/O, outside the lock
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

    def _pin_owner_seen(self, holder: str, owner: str) -> float | None:
        """Under the lock: when the client that made `holder`'s pin was last seen (None: it
        is gone). Its session counts as used, so it does not expire under the pin either."""
        peer = self.leases.peers.get(owner)
        if peer is None:
            return None
        self.sessions.get(holder)
        return peer.last_seen

    def _reclaim(self, gone: Expired) -> None:
        """Release what the book ended (under the lock): reservations and leases whose owner
        can no longer touch their slots."""
        for client_id in gone.dead_clients:  # their layouts start their time to live
            self.layouts.release(client_id)
        for res in gone.reservations:
            self.stores.end_reservation(res)
        for lease in gone.leases:
            self.retrieves.end_lease(lease)

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
                lease_expired=self.leases.num_expired_answers,
            )

    def session_bounds(self) -> SessionBounds:
        """Tokens held by sessions and sessions shed to stay within the bounds."""
        return self.session_book.bounds()

    @property
    def orphaned_sessions(self) -> int:
        """Sessions that expired while still holding pins (the engine abandoned them)."""
        return self.session_book.orphaned

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
            return self.session_book.remove(request_id) is not None

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

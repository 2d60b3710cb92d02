"""The engine's sessions: a request's session and chunk names, the session bounds, their end.

Locking: naming (`session`, `range_keys`) runs outside the engine lock, as a `Session` guards
itself (see `naming.py`); only counting the session's tokens against the bounds, and the
shedding that may cause, take the lock. `end`, the SessionManager's destroy listener, takes it
to release what the session held (its pending lookup, its pins) and count it out. `require`
and `remove` need no lock and may be called holding it.

Counting is exact under concurrency: the book keeps, per session and under the engine lock,
the tokens it has counted for it, and each count reads the session's tokens now, under that
lock. So every request of a session, however many run at once, leaves the totals equal to what
the sessions hold once they end; a session that ended (or was replaced under its id) is never
counted again.

The bounds: server-wide, --max-sessions and --max-session-tokens; per tenant (the first part of
a session's composed id, `tenants.session_id`), --tenant-session-share of each with a tokens
file (without one, every client is the anonymous tenant, which has the whole). A tenant over
its share, or one whose request takes the server over its bound, ends its own longest-idle
sessions, never another tenant's; when it has none left to end and the server is still over
its bound, the request is refused (NoSpaceError) and its session ended. Each tenant keeps its
sessions in least-recently-counted order, so shedding costs time in proportion to the sessions
it ends, not to the sessions held.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier import protocol as p
from kvtier.config import ServerConfig
from kvtier.errors import BadArrayError, NoSpaceError, UnknownSessionError
from kvtier.keys import ChunkKey, decompose
from kvtier.names import named_chunk_keys
from kvtier.server import naming
from kvtier.server.limits import SessionBounds
from kvtier.server.locking import TimedLock
from kvtier.server.requests.lookups import LookupBook
from kvtier.session import Session, SessionManager
from kvtier.storage.l1 import L1Store, stored_holder

__all__ = ["SessionBook", "tenant_of"]

_SPARE = 0.9  # shedding goes down to 90% of a bound, so a tenant at it does not shed per request


def tenant_of(session_id: str) -> str:
    """The tenant of a session id `tenants.session_id` composed; "" (anonymous) for any other
    id (tests and tools may name sessions directly)."""
    try:
        parts = decompose(session_id)
    except ValueError:
        return ""
    return parts[0] if len(parts) == 3 else ""


class _TenantSessions:
    """One tenant's counted sessions: tokens counted for each, least recently counted first."""

    __slots__ = ("held", "tokens")

    def __init__(self) -> None:
        self.held: OrderedDict[Session, int] = OrderedDict()
        self.tokens = 0


class SessionBook:
    """Sessions as the engine uses them: named, counted against the bounds, ended."""

    def __init__(
        self,
        config: ServerConfig,
        sessions: SessionManager,
        l1: L1Store,
        lookups: LookupBook,
        lock: TimedLock,
    ) -> None:
        self._config = config
        self._chunk_size = config.chunk_size
        self._sessions = sessions
        self._l1 = l1
        self._lookups = lookups
        self._lock = lock
        self._ending: set[str] = set()  # sessions being ended on purpose, not expired
        self.orphaned = 0  # expired sessions that still held pins
        self._tokens = 0  # tokens counted for all sessions together
        self._shed = 0  # ended early to keep within the bounds
        self._tenants: dict[str, _TenantSessions] = {}
        # Without a tokens file every client is the anonymous tenant: it has the whole bounds.
        share = config.tenant_session_share if config.auth_tokens_file else 1.0
        self._tenant_max_sessions = max(1, int(config.max_sessions * share))
        self._tenant_max_tokens = max(1, int(config.max_session_tokens * share))

    def session(self, request_id: str, tokens: bytes) -> tuple[Session, list[bytes]]:
        """The request's session, holding `tokens` now, and the hashes of these tokens' full
        chunks (never another request's: see `naming.session_hashes`); counted against the
        bounds."""
        session, hashes = naming.session_hashes(self._sessions, request_id, tokens)
        self._account(session)
        return session, hashes

    def range_keys(self, req: p.RangeRequest | p.KeyRequest) -> list[ChunkKey]:
        """The chunk names of a store or retrieve: its names, or its session's token range."""
        return self.range_chain(req)[0]

    def range_chain(
        self, req: p.RangeRequest | p.KeyRequest
    ) -> tuple[list[ChunkKey], bytes | None]:
        """`range_keys`, and the name of the chunk before them in their prompt (None when they
        start it, or are named by the caller)."""
        if isinstance(req, p.KeyRequest):  # named by the caller: no session, no token range
            if req.num_chunks != len(req.names):
                raise BadArrayError(
                    f"the array holds {req.num_chunks} chunks but {len(req.names)} names came"
                )
            named = named_chunk_keys(
                req.names,
                model=req.model,
                cache_salt=req.cache_salt,
                world_size=req.world_size,
                extra_key=req.extra_key,
            )
            return named, None
        session, keys, parent = naming.range_keys(self._sessions, self._chunk_size, req)
        self._account(session)
        return keys, parent

    def exists(self, request_id: str) -> bool:
        """Whether the server holds a session of this id now (not a use of it)."""
        return self._sessions.peek(request_id) is not None

    def require(self, request_id: str) -> Session:
        session = self._sessions.get(request_id)
        if session is None:
            raise UnknownSessionError(
                f"no session {request_id!r}: it never existed, already ended, or expired "
                f"(--session-ttl {self._config.session_ttl:g}s)"
            )
        return session

    def remove(self, request_id: str) -> Session | None:
        """End a session on purpose (not an expiry)."""
        self._ending.add(request_id)
        try:
            return self._sessions.remove(request_id)
        finally:
            self._ending.discard(request_id)

    def end(self, session: Session) -> None:
        """A session ended (on purpose or expired): release its pending lookup and its pins,
        and count it out."""
        with self._lock.hold("session ended"):
            self._count_out(session)
            self._lookups.forget(session.request_id)
            held_pins = self._l1.unpin(session.request_id)
            self._l1.unpin(stored_holder(session.request_id))
            if held_pins and session.request_id not in self._ending:
                self.orphaned += 1  # the engine abandoned it mid-flight, holding cache

    def bounds(self) -> SessionBounds:
        """Tokens held by sessions and sessions shed to stay within the bounds."""
        return SessionBounds(tokens=self._tokens, shed=self._shed)

    def _count_out(self, session: Session) -> None:
        """Stop counting `session` (idempotent). Caller holds the engine lock."""
        tenant = tenant_of(session.request_id)
        use = self._tenants.get(tenant)
        if use is None:
            return
        counted = use.held.pop(session, None)
        if counted is None:
            return
        use.tokens -= counted
        self._tokens -= counted
        if not use.held:
            del self._tenants[tenant]

    def _account(self, session: Session) -> None:
        """Count the session's tokens now against the bounds; shed or refuse if over."""
        with self._lock.hold("sessions"):
            if self._sessions.peek(session.request_id) is not session:
                return  # it ended (or another took its id) meanwhile: its end counted it out
            tenant = tenant_of(session.request_id)
            use = self._tenants.get(tenant)
            if use is None:
                use = self._tenants[tenant] = _TenantSessions()
            now = session.num_tokens
            before = use.held.pop(session, 0)
            use.held[session] = now  # the most recently counted, last
            use.tokens += now - before
            self._tokens += now - before
            if self._over(use, 1.0):
                self._shed_for(session, use)

    def _over(self, use: _TenantSessions, fraction: float) -> bool:
        """Whether the tenant or the server is over `fraction` of a bound."""
        cfg = self._config
        return (
            len(use.held) > self._tenant_max_sessions * fraction
            or use.tokens > self._tenant_max_tokens * fraction
            or self._sessions.active_count() > cfg.max_sessions * fraction
            or self._tokens > cfg.max_session_tokens * fraction
        )

    def _shed_for(self, keep: Session, use: _TenantSessions) -> None:
        """End the tenant's own longest-idle sessions (never `keep`, never another tenant's)
        until its share and the server's bounds hold with 10% to spare; counted. Refuse the
        request when the server is still over a bound and the tenant has nothing left to end.
        Caller holds the engine lock."""
        while self._over(use, _SPARE):
            victim = next(iter(use.held))
            if victim is keep:
                break  # the tenant holds no other session
            self._shed += 1
            if self._sessions.peek(victim.request_id) is victim:
                self.remove(victim.request_id)  # its end (re-entrant lock) counts it out
            self._count_out(victim)  # ended already, its end still waiting for the lock
        cfg = self._config
        active, tokens = self._sessions.active_count(), self._tokens
        if active > cfg.max_sessions or tokens > cfg.max_session_tokens:
            self.remove(keep.request_id)
            self._count_out(keep)
            raise NoSpaceError(
                f"the server holds {active} sessions of {tokens} tokens, over its bound "
                f"(--max-sessions {cfg.max_sessions}, --max-session-tokens "
                f"{cfg.max_session_tokens}), and this tenant has no idle session of its own to "
                "end: retry once sessions end or expire (--session-ttl), or raise the bounds"
            )

"""The engine's sessions: a request's session and chunk names, the session bounds, their end.

Locking: naming (`session`, `range_keys`) runs outside the engine lock, as a `Session` guards
itself (see `naming.py`); only counting the session's tokens against --max-sessions and
--max-session-tokens, and the shedding that may cause, take the lock. `end`, the
SessionManager's destroy listener, takes it to release what the session held (its pending
lookup, its pins). `require` and `remove` need no lock and may be called holding it.
"""

from __future__ import annotations

from kvtier import protocol as p
from kvtier.config import ServerConfig
from kvtier.errors import BadArrayError, UnknownSessionError
from kvtier.keys import ChunkKey
from kvtier.names import named_chunk_keys
from kvtier.server import naming
from kvtier.server.limits import SessionBounds
from kvtier.server.locking import TimedLock
from kvtier.server.lookups import LookupBook
from kvtier.session import Session, SessionManager
from kvtier.storage.l1 import L1Store

__all__ = ["SessionBook"]


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
        self._tokens = 0  # tokens held by all sessions together
        self._shed = 0  # ended early to keep within --max-sessions/--max-session-tokens

    def session(self, request_id: str, tokens: bytes) -> Session:
        """The request's session, holding `tokens` now; counted against the bounds."""
        before = self._held_tokens(request_id)
        session = naming.session_for(self._sessions, request_id, tokens)
        self._account(session, before)
        return session

    def range_keys(self, req: p.RangeRequest | p.KeyRequest) -> list[ChunkKey]:
        """The chunk names of a store or retrieve: its names, or its session's token range."""
        if isinstance(req, p.KeyRequest):  # named by the caller: no session, no token range
            if req.num_chunks != len(req.names):
                raise BadArrayError(
                    f"the array holds {req.num_chunks} chunks but {len(req.names)} names came"
                )
            return named_chunk_keys(
                req.names,
                model=req.model,
                cache_salt=req.cache_salt,
                world_size=req.world_size,
                extra_key=req.extra_key,
            )
        before = self._held_tokens(req.request_id)
        keys = naming.range_keys(self._sessions, self._chunk_size, req)
        session = self._sessions.peek(req.request_id)
        if session is not None:
            self._account(session, before)
        return keys

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
        """A session ended (on purpose or expired): release its pending lookup and its pins."""
        with self._lock.hold("session ended"):
            self._tokens -= session.num_tokens
            self._lookups.forget(session.request_id)
            held_pins = self._l1.unpin(session.request_id)
            if held_pins and session.request_id not in self._ending:
                self.orphaned += 1  # the engine abandoned it mid-flight, holding cache

    def bounds(self) -> SessionBounds:
        """Tokens held by sessions and sessions shed to stay within the bounds."""
        return SessionBounds(tokens=self._tokens, shed=self._shed)

    def _held_tokens(self, request_id: str) -> int:
        session = self._sessions.peek(request_id)
        return 0 if session is None else session.num_tokens

    def _account(self, session: Session, before: int) -> None:
        """Count the session's token change against --max-session-tokens; shed if over."""
        with self._lock.hold("sessions"):
            self._tokens += session.num_tokens - before
            if (
                self._sessions.active_count() > self._config.max_sessions
                or self._tokens > self._config.max_session_tokens
            ):
                self._shed_for(session)

    def _shed_for(self, keep: Session) -> None:
        """End the longest-idle sessions until both session bounds hold with 10% to spare (so
        a server at its bound does not sort its sessions on every request); counted."""
        max_sessions = self._config.max_sessions * 9 // 10
        max_tokens = self._config.max_session_tokens * 9 // 10
        for session in self._sessions.sessions():  # least recently used first
            if self._sessions.active_count() <= max_sessions and self._tokens <= max_tokens:
                break
            if session is keep:
                continue
            self._shed += 1
            self.remove(session.request_id)

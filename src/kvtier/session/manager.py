"""`SessionManager`: sessions by request id, expired once unused for longer than their ttl, by
a periodic cleanup thread (see `kvtier.session`)."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvtier.hashing import TokenHasher
from kvtier.periodic import (
    PeriodicThread,
    PeriodicThreadRegistry,
    ThreadLevel,
    ThreadRunSummary,
    create_periodic_thread,
)
from kvtier.session.state import Clock, Session

logger = logging.getLogger(__name__)

DestroyListener = Callable[["Session"], None]


class SessionManager:
    """Sessions by request id, expired once unused for longer than `ttl` seconds.

    Expiry is exact and costs time in proportion to the sessions it looks at: new sessions wait
    in a creation-order queue, so `cleanup_expired` stops at the first one younger than the ttl
    and most requests (removed well before the ttl) leave it in O(1). A session found still in
    use when its first ttl passes (a use through the manager or its own methods moves
    `last_access`) moves to a heap keyed by that last use, and is looked at again only when
    that use is a ttl old.
    """

    # The lineage's library defaults, kept on purpose under the lineage's names and values (code
    # written for it reads them) although ServerConfig, where defaults live, sweeps every 10 s
    # (`session_cleanup_interval`): the server never relies on these, server/app.py passes
    # ServerConfig's values.
    DEFAULT_SESSION_TTL = 600.0
    DEFAULT_CLEANUP_INTERVAL = 60.0
    _BATCH = 256  # sessions looked at per hold of the lock during cleanup (tens of us)
    _ids = itertools.count()

    def __init__(
        self,
        hasher: TokenHasher,
        ttl: float = DEFAULT_SESSION_TTL,
        cleanup_interval: float | None = DEFAULT_CLEANUP_INTERVAL,
        *,
        clock: Clock = time.time,
        registry: PeriodicThreadRegistry | None = None,
    ) -> None:
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
            raise ValueError(f"session ttl must be a number of seconds > 0, got {ttl!r}")
        if cleanup_interval is not None and (
            isinstance(cleanup_interval, bool)
            or not isinstance(cleanup_interval, int | float)
            or not (cleanup_interval >= 0 and math.isfinite(cleanup_interval))
        ):
            raise ValueError(
                "session cleanup_interval must be a finite number of seconds > 0 (None or 0:"
                f" no background cleanup), got {cleanup_interval!r}"
            )
        self.hasher = hasher
        self.ttl = float(ttl)
        self.clock = clock
        self.destroy_listeners: list[DestroyListener] = []
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        # Sessions younger than one ttl (or not yet looked at), in creation order.
        self._fresh: OrderedDict[str, Session] = OrderedDict()
        # (last_access when pushed, seq, request_id) of the others; an entry whose seq is not
        # its session's `_expiry_seq` is stale (the session was removed) and is skipped.
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._removed = 0
        self._orphaned = 0
        self._closed = False
        self._registry = registry
        self._cleanup_thread: PeriodicThread | None = None
        if cleanup_interval:
            self._cleanup_thread = create_periodic_thread(
                f"session-cleanup-{next(self._ids)}",
                cleanup_interval,
                self._cleanup_cycle,
                ThreadLevel.HIGH,
                registry=registry,
                start=True,
            )

    # -- lookups -------------------------------------------------------------------------------

    def get_or_create(self, request_id: str) -> Session:
        """The session of `request_id`, created on first use; counts as a use."""
        with self._lock:
            session = self._sessions.get(request_id)
            if session is None:
                session = Session(request_id, self.hasher, clock=self.clock)
                self._sessions[request_id] = self._fresh[request_id] = session
            else:
                session.last_access = self.clock()
        return session

    def get(self, request_id: str) -> Session | None:
        """The session of `request_id` or None; never creates one. Counts as a use."""
        with self._lock:
            session = self._sessions.get(request_id)
            if session is not None:
                session.last_access = self.clock()
        return session

    def peek(self, request_id: str) -> Session | None:
        """The session of `request_id` or None, without counting as a use (for observers)."""
        return self._sessions.get(request_id)

    def remove(self, request_id: str) -> Session | None:
        """Take a session out (the request ended); destroy listeners run for it."""
        with self._lock:
            session = self._sessions.pop(request_id, None)
            if session is not None:
                self._fresh.pop(request_id, None)  # in the heap, its entry just goes stale
                self._removed += 1
        if session is not None:
            self._notify(session)
        return session

    def active_count(self) -> int:
        """How many sessions the manager holds."""
        return len(self._sessions)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._sessions

    def sessions(self) -> list[Session]:
        """A snapshot of the sessions, most recently used last."""
        with self._lock:
            snapshot = list(self._sessions.values())
        snapshot.sort(key=lambda s: s.last_access)
        return snapshot

    def __iter__(self) -> Iterator[Session]:
        return iter(self.sessions())

    # -- expiry --------------------------------------------------------------------------------

    @property
    def created_count(self) -> int:
        """Sessions created by `get_or_create` (each is active, removed or orphaned)."""
        return len(self._sessions) + self._removed + self._orphaned

    @property
    def removed_count(self) -> int:
        """Sessions taken out by `remove` (the request ended normally)."""
        return self._removed

    @property
    def orphaned_count(self) -> int:
        """Sessions that expired without `remove`: requests their engine abandoned."""
        return self._orphaned

    def cleanup_expired(self) -> int:
        """Remove sessions unused for longer than the ttl; returns how many expired.

        Works in batches of `_BATCH` sessions per hold of the lock; destroy listeners run
        between batches, outside it.
        """
        expired_total = 0
        while True:
            expired: list[Session] = []
            with self._lock:
                budget = self._expire_batch(expired)
                self._orphaned += len(expired)
            if expired and self.destroy_listeners:
                for session in expired:
                    self._notify(session)
            expired_total += len(expired)
            if budget:  # stopped before the batch was used up: nothing due is left
                return expired_total

    def _expire_batch(self, expired: list[Session]) -> int:
        """Look at up to `_BATCH` due sessions, expiring idle ones; returns the unused budget.

        Caller holds `_lock`.
        """
        now, ttl = self.clock(), self.ttl
        budget = self._BATCH
        fresh, heap, sessions = self._fresh, self._heap, self._sessions
        while budget and fresh:
            request_id, session = fresh.popitem(last=False)
            if not now - session.created_at > ttl:
                fresh[request_id] = session
                fresh.move_to_end(request_id, last=False)
                break  # every later one was created later still
            budget -= 1
            if now - session.last_access > ttl:
                del sessions[request_id]
                expired.append(session)
            else:
                session._expiry_seq = seq = next(self._seq)
                heapq.heappush(heap, (session.last_access, seq, request_id))
        while budget and heap and now - heap[0][0] > ttl:
            budget -= 1
            _, seq, request_id = heapq.heappop(heap)
            held = sessions.get(request_id)
            if held is None or held._expiry_seq != seq:
                continue  # removed since it was pushed
            if now - held.last_access > ttl:
                del sessions[request_id]
                expired.append(held)
            else:
                held._expiry_seq = seq = next(self._seq)
                heapq.heappush(heap, (held.last_access, seq, request_id))
        return budget

    def _cleanup_cycle(self) -> ThreadRunSummary:
        expired = self.cleanup_expired()
        return ThreadRunSummary(
            success=True,
            message=f"expired {expired} sessions",
            extra_info={"expired": expired, "active": len(self._sessions)},
        )

    def _notify(self, session: Session) -> None:
        """Run every destroy listener for `session`, outside the manager's lock."""
        for listener in list(self.destroy_listeners):
            try:
                listener(session)
            except Exception:
                logger.exception(
                    "session destroy listener %r failed for %r", listener, session.request_id
                )

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop and unregister the cleanup thread; idempotent. Sessions stay readable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread, self._cleanup_thread = self._cleanup_thread, None
        if thread is not None:
            thread.stop()
            registry = self._registry
            if registry is None:
                registry = PeriodicThreadRegistry.get_instance()
            if registry.get(thread.name) is thread:
                registry.unregister(thread.name)

    def __enter__(self) -> SessionManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Per-request state: `Session` (tokens and their chunk hashes) and `SessionManager` (expiry).

The names and public semantics descend from LMCache's multiprocess server. Where it was weak,
this module differs on purpose:

- `set_tokens` with a sequence that diverges inside already-hashed chunks drops the hashes from
  the first differing chunk on (the lineage kept them, so a changed prompt reused stale names);
- range errors are `ValueError`s that name the numbers (the lineage used `assert`);
- expiry counts from the last use, not from creation, so a long request keeps its session;
- `cleanup_expired` costs time in proportion to the sessions that expire and holds the manager's
  lock only for short batches (the lineage scanned every session under its lock).
"""

from __future__ import annotations

import array
import heapq
import itertools
import logging
import math
import operator
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvtier.errors import MisalignedRangeError
from kvtier.hashing import TokenHasher, TokenIds, token_bytes
from kvtier.periodic import (
    PeriodicThread,
    PeriodicThreadRegistry,
    ThreadLevel,
    ThreadRunSummary,
    create_periodic_thread,
)
from kvtier.samelist import same_items

__all__ = ["DestroyListener", "Session", "SessionManager"]

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
DestroyListener = Callable[["Session"], None]

_TOKEN_BYTES = 4  # tokens are held as packed little-endian uint32


def _pack_list(tokens: list[int]) -> array.array[int] | bytes | memoryview:
    """Python ints as packed little-endian uint32, checked: array('I').fromlist converts a short
    list several times faster than numpy; anything it refuses goes through token_bytes, which
    raises kvtier's error naming the bad value."""
    if _NATIVE_U32:
        packed = array.array("I")
        try:
            packed.fromlist(tokens)
            return packed
        except (OverflowError, TypeError):
            pass
    return token_bytes(tokens)


_NATIVE_U32 = sys.byteorder == "little" and array.array("I").itemsize == _TOKEN_BYTES


def _packed(token_ids: TokenIds) -> bytes:
    """The tokens packed as immutable bytes (a copy of a mutable buffer: the caller may reuse
    it); raises kvtier's error naming a bad value."""
    new = token_bytes(token_ids)
    return new if isinstance(new, bytes) else bytes(new)


def _common_prefix_tokens(a: bytes | bytearray, b: bytes, limit: int) -> int:
    """Length, in tokens, of the common prefix of two packed token buffers within `limit` bytes."""
    count = min(limit, len(a), len(b)) // _TOKEN_BYTES
    x = np.frombuffer(a, dtype="<u4", count=count)
    y = np.frombuffer(b, dtype="<u4", count=count)
    differs = x != y
    return int(np.argmax(differs)) if differs.any() else count


# Sessions take their lock from a fixed pool, in turn, instead of owning one: a lock is a
# GC-tracked object, and with 100k live sessions every one of them lengthens each full garbage
# collection (it halved get_or_create's rate). Sessions created near each other in time (those
# of concurrent requests) get different locks; two sharing one only wait for each other's
# hashing. No code holds two sessions' locks at once, so sharing cannot deadlock.
_NUM_SESSION_LOCKS = 1024
_SESSION_LOCKS = tuple(threading.Lock() for _ in range(_NUM_SESSION_LOCKS))
_lock_turn = itertools.count()


class Session:
    """One request's tokens and the hashes of its full chunks, computed incrementally.

    Safe to share between threads (one per tensor-parallel worker): every method holds the
    session's lock (one of a shared pool, see `_SESSION_LOCKS`; never held while taking
    another), so no chunk is hashed twice and nobody sees a half-updated list.
    """

    __slots__ = (
        "_expiry_seq",
        "_extras",
        "_hashes",
        "_list",
        "_lock",
        "_tokens",
        "clock",
        "created_at",
        "hasher",
        "last_access",
        "lookup_ipc_key",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        hasher: TokenHasher,
        *,
        clock: Clock = time.time,
        lookup_ipc_key: Any = None,
    ) -> None:
        self.request_id = request_id
        self.hasher = hasher
        self.clock = clock
        # The lineage's field for the key of the request's last lookup: None until a caller
        # sets it; kvtier itself never reads it. It stays on the session `remove` returns.
        self.lookup_ipc_key = lookup_ipc_key
        self._lock = _SESSION_LOCKS[next(_lock_turn) % _NUM_SESSION_LOCKS]
        # bytes as given to set_tokens (no copy), or a bytearray once append_tokens grows it in
        # place. A bytearray cannot resize while a view of it exists, so views of it are taken
        # and dropped only under _lock.
        self._tokens: bytes | bytearray = b""
        # The tokens as the caller's Python ints, kept while set_tokens is given lists, so a
        # growing list is checked and converted only where it grew (see _extend_from_list).
        self._list: list[int] | None = None
        # Hashes of chunks [0, len); always a prefix of the current tokens' chunks. Created by
        # the first hashing: one GC-tracked object less per session (see SessionManager).
        self._hashes: list[bytes] | None = None
        self._extras: dict[str, Any] | None = None
        self.created_at = clock()
        self.last_access = self.created_at
        # SessionManager bookkeeping: the sequence number of its valid expiry-heap entry, -1
        # while it is still in the manager's creation-order queue.
        self._expiry_seq = -1

    @property
    def extras(self) -> dict[str, Any]:
        """Free-form per-request data (the lineage's field), created on first use.

        Lazy because every dict a session owns is one more object for the garbage collector to
        scan: with 100k live sessions that cost more than creating them.
        """
        if self._extras is None:
            self._extras = {}
        return self._extras

    # -- the lineage's read-only views -------------------------------------------------------

    @property
    def token_ids(self) -> list[int]:
        """The current tokens as Python ints (a copy; prefer `token_bytes` on hot paths)."""
        with self._lock:
            return np.frombuffer(self._tokens, dtype="<u4").tolist()  # type: ignore[no-any-return]

    @property
    def token_bytes(self) -> bytes:
        """The current tokens, packed little-endian uint32 (immutable; no copy unless appended)."""
        with self._lock:
            if not isinstance(self._tokens, bytes):
                self._tokens = bytes(self._tokens)
            return self._tokens

    @property
    def num_tokens(self) -> int:
        """How many tokens the session holds."""
        return len(self._tokens) // _TOKEN_BYTES

    @property
    def chunk_hashes(self) -> list[bytes]:
        """Hashes of the leading chunks hashed so far (the session's own list: read, don't
        change it), always a prefix of the current tokens' chunk hashes."""
        hashes = self._hashes
        return hashes if hashes is not None else []

    @property
    def num_chunks_processed(self) -> int:
        """How many leading chunks have their hash computed."""
        hashes = self._hashes
        return len(hashes) if hashes is not None else 0

    @property
    def last_prefix_hash(self) -> bytes | None:
        """Hash of the last hashed chunk: the parent of the next one (None before any)."""
        hashes = self._hashes
        return hashes[-1] if hashes else None

    def touch(self) -> None:
        """Record a use now: expiry counts from the last use."""
        self.last_access = self.clock()

    # -- mutation ----------------------------------------------------------------------------

    def set_tokens(self, full_token_ids: TokenIds) -> None:
        """Replace the tokens (never appends); idempotent.

        Hashes of chunks at or after the first token that differs from the old sequence are
        dropped and recomputed on demand by `get_hashes`. A Python list that repeats the
        previous list and adds a tail (the lineage's growth pattern) costs only the tail's
        conversion and an exact comparison of the prefix (see `_extend_from_list`). Like any
        reader of a list, it expects no other thread to change that list during the call.
        """
        if type(full_token_ids) is list and self._extend_from_list(full_token_ids):
            return
        new = _packed(full_token_ids)
        with self._lock:
            self._replace_locked(new, full_token_ids)

    def hashes_for(self, full_token_ids: TokenIds, end: int | None = None) -> list[bytes]:
        """Set the tokens and return the hashes of their chunks [0, end), in one hold of the
        session's lock: the hashes of exactly these tokens, whatever another thread sets
        between two calls (`set_tokens` then `get_hashes` are two holds, and a concurrent
        request of the same id with another prompt could replace the tokens between them).

        `end=None` means the last full-chunk boundary of these tokens. Same costs as
        `set_tokens` and `get_hashes` together: only chunks not yet hashed are hashed.
        """
        if end is not None:
            end = operator.index(end)
        if type(full_token_ids) is list:
            with self._lock:
                if self._extend_locked(full_token_ids):
                    return self._hashes_locked(0, end)
        new = _packed(full_token_ids)  # outside the lock: converting a list is O(n)
        with self._lock:
            self._replace_locked(new, full_token_ids)
            return self._hashes_locked(0, end)

    def _replace_locked(self, new: bytes, full_token_ids: TokenIds) -> None:
        """set_tokens' general path, given the packed tokens. Caller holds `_lock`."""
        self.last_access = self.clock()
        self._list = list(full_token_ids) if type(full_token_ids) is list else None
        old = self._tokens
        if new is old:
            return
        # Only the hashed prefix matters, and decode growth leaves it unchanged: one memcmp
        # (no copy) settles that; the token-by-token search runs only on a real divergence.
        hashes = self._hashes
        hashed = len(hashes) * self.hasher.chunk_size * _TOKEN_BYTES if hashes else 0
        if hashes and not new.startswith(memoryview(old)[:hashed]):
            valid_chunks = _common_prefix_tokens(old, new, hashed) // self.hasher.chunk_size
            del hashes[valid_chunks:]
        self._tokens = new

    def _extend_from_list(self, tokens: list[int]) -> bool:
        """set_tokens for a list that starts with the previous list: convert just the tail.

        The check is exact: the kept copy of the previous list is extended by the new tail and
        compared with `tokens` whole (no slice of the prefix): one memcmp of the two lists' item
        pointers when the caller grows the same int objects, else `==` (`samelist`). Any
        difference restores the kept copy and takes the general path, which converts the whole
        list and drops the hashes from the first differing chunk on. Packed tokens (what the
        server receives) always take the general path.
        """
        with self._lock:
            return self._extend_locked(tokens)

    def _extend_locked(self, tokens: list[int]) -> bool:
        """`_extend_from_list`'s body. Caller holds `_lock`."""
        old = self._list
        if old is None:
            return False
        n = len(old)
        if len(tokens) < n:
            return False
        tail = tokens[n:]
        old += tail
        try:
            same = same_items(tokens, old)
            packed = _pack_list(tail) if same and tail else b""  # validates the tail only
        except BaseException:
            del old[n:]
            raise
        if not same:
            del old[n:]
            return False
        if tail:
            if isinstance(self._tokens, bytes):
                self._tokens = bytearray(self._tokens)  # one copy, then growth is in place
            self._tokens += packed
        self.last_access = self.clock()
        return True

    def append_tokens(self, token_ids: TokenIds) -> None:
        """Extend the tokens (decode growth) in amortized time proportional to the new ones."""
        extra = token_bytes(token_ids)
        with self._lock:
            self.last_access = self.clock()
            self._list = None
            if isinstance(self._tokens, bytes):
                self._tokens = bytearray(self._tokens)  # one copy, then growth is in place
            self._tokens += extra

    def get_hashes(self, start: int = 0, end: int | None = None) -> list[bytes]:
        """Hashes of the chunks covering tokens [start, end), hashing only chunks not yet hashed.

        `end=None` means the last full-chunk boundary of the current tokens. Both ends must be
        multiples of the chunk size, `start <= end`, and `end` within the tokens.
        """
        start = operator.index(start)
        if end is not None:
            end = operator.index(end)
        with self._lock:
            return self._hashes_locked(start, end)

    def _hashes_locked(self, start: int, end: int | None) -> list[bytes]:
        """`get_hashes`' body. Caller holds `_lock`."""
        cs = self.hasher.chunk_size
        self.last_access = self.clock()
        num_tokens = len(self._tokens) // _TOKEN_BYTES
        if end is None:
            end = num_tokens - num_tokens % cs
        if start < 0 or start > end:
            raise MisalignedRangeError(
                f"get_hashes: start={start} must satisfy 0 <= start <= end={end}"
            )
        if start % cs or end % cs:
            raise MisalignedRangeError(
                f"get_hashes: start={start} and end={end} must be multiples of the chunk size {cs}"
            )
        if end > num_tokens:
            raise MisalignedRangeError(
                f"get_hashes: end={end} is past the session's {num_tokens} tokens"
            )
        hashes = self._hashes
        if hashes is None:
            if not end:
                return []
            self._hashes = hashes = []
        done = len(hashes)
        first, last = start // cs, end // cs
        if last > done:
            # Both views are released before the lock goes: an append may resize the buffer.
            with (
                memoryview(self._tokens) as view,
                view[done * cs * _TOKEN_BYTES : end * _TOKEN_BYTES] as window,
            ):
                self.hasher.extend_chain(hashes, window)
        return hashes[first:last]

    def __repr__(self) -> str:
        return (
            f"Session({self.request_id!r}, tokens={self.num_tokens}, "
            f"hashed_chunks={self.num_chunks_processed})"
        )


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

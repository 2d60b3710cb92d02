"""`Session`: one request's tokens and their chunk hashes, kept in step as the prompt grows or
changes (see `kvtier.session`)."""

from __future__ import annotations

import itertools
import operator
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.errors import MisalignedRangeError
from kvtier.hashing import TokenHasher, TokenIds, token_bytes
from kvtier.session.samelist import same_items
from kvtier.session.tokens import TOKEN_BYTES, common_prefix_tokens, pack_bytes, pack_list

Clock = Callable[[], float]

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
        return len(self._tokens) // TOKEN_BYTES

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
        new = pack_bytes(full_token_ids)
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
        new = pack_bytes(full_token_ids)  # outside the lock: converting a list is O(n)
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
        hashed = len(hashes) * self.hasher.chunk_size * TOKEN_BYTES if hashes else 0
        if hashes and not new.startswith(memoryview(old)[:hashed]):
            valid_chunks = common_prefix_tokens(old, new, hashed) // self.hasher.chunk_size
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
            packed = pack_list(tail) if same and tail else b""  # validates the tail only
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
        num_tokens = len(self._tokens) // TOKEN_BYTES
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
                view[done * cs * TOKEN_BYTES : end * TOKEN_BYTES] as window,
            ):
                self.hasher.extend_chain(hashes, window)
        return hashes[first:last]

    def __repr__(self) -> str:
        return (
            f"Session({self.request_id!r}, tokens={self.num_tokens}, "
            f"hashed_chunks={self.num_chunks_processed})"
        )

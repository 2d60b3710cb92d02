"""The slot API: a store or retrieve as a context manager over the chunks' bytes, no array.

`Client.store_slots` hands out one writable uint8 view per chunk to fill (an arena slot on the
server's machine, a local buffer elsewhere) and commits on exit; `Client.retrieve_slots` hands
out read-only views of the cached chunks and ends the lease on exit. A connector that copies
from or into its own paged KV layout uses these instead of building one contiguous array.
`Client.store` and `Client.retrieve` are built on them.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier import protocol as p
from kvtier.client.connection import Connection, reply_as
from kvtier.errors import KVTierError, NotConnectedError
from kvtier.layouts import Layout

__all__ = ["RetrievedSlots", "StoreSlots"]

Bytes = npt.NDArray[np.uint8]


def _arena_gone(connection: Connection, request: str) -> NotConnectedError:
    """The error of a request answered with arena slots this process no longer maps."""
    if connection.closing:
        return NotConnectedError(f"the client was closed during {request}")
    return NotConnectedError(
        f"{request} re-joined a restarted kvtier whose arena this process cannot map: "
        "nothing moved; retry (bytes now travel inline)"
    )


class StoreSlots:
    """Staging slots for chunks [start, end) of one rank; commit makes them stored.

    Chunks the server already holds get no slot and are not listed by `targets()`. Leaving the
    `with` block commits, unless an exception leaves it: then the slots are given back.
    """

    def __init__(
        self,
        connection: Connection,
        fields: dict[str, Any],
        *,
        reserve: type[p.Reserve | p.ReserveKeys] = p.Reserve,
        store_inline: type[p.StoreInline | p.StoreKeysInline] = p.StoreInline,
    ) -> None:
        """`reserve` / `store_inline`: the key-addressed requests for chunks named by the caller."""
        self._connection = connection
        self._fields = fields
        self._store_inline = store_inline
        self.num_chunks: int = fields["num_chunks"]
        self.stored_chunks = 0  # chunks stored once committed (written now or already there)
        self._done = False
        self._stored_tokens = 0
        self._reservation_id = 0
        self._targets: list[tuple[int, Bytes]] = []
        self._inline: list[Bytes] | None = None
        arena = connection.arena_bytes
        if arena is None:  # bytes travel inline: local buffers, sent with the commit
            self.chunk_nbytes = Layout.of(fields["chunk_shape"], fields["dtype"]).nbytes
            self._inline = [
                np.empty(self.chunk_nbytes, dtype=np.uint8) for _ in range(self.num_chunks)
            ]
            self._targets = list(enumerate(self._inline))
            return
        answer, _ = connection.call(reserve(**fields))
        reply = reply_as(answer, p.ReserveReply, reserve.__name__)
        self.chunk_nbytes = nbytes = reply.chunk_nbytes
        self._reservation_id = reply.reservation_id
        if not reply.reservation_id:  # nothing to write: stored already, or being stored
            self._done = True
            # A chunk another client is storing right now (IN_FLIGHT) is not stored yet: it
            # may still be aborted, so the stored prefix ends before it.
            self.stored_chunks = next(
                (i for i, off in enumerate(reply.offsets) if off == p.IN_FLIGHT),
                len(reply.offsets),
            )
            self._stored_tokens = self.stored_chunks * connection.chunk_size
            return
        arena = connection.arena_bytes  # again: the call may have re-joined a restarted server
        if arena is None:  # ... whose arena is not mappable here, or close() ran meanwhile
            self._done = True
            with contextlib.suppress(KVTierError):
                connection.call(p.Abort(reply.reservation_id))
            raise _arena_gone(connection, reserve.__name__)
        self._targets = [
            (i, arena[offset : offset + nbytes])
            for i, offset in enumerate(reply.offsets)
            if offset >= 0
        ]

    def targets(self) -> list[tuple[int, Bytes]]:
        """(chunk index within [start, end), writable uint8 view of chunk_nbytes bytes)."""
        return list(self._targets)

    @property
    def stored_tokens(self) -> int:
        """Tokens stored from `start` once committed (0 before)."""
        return self._stored_tokens

    def commit(self) -> int:
        """Make the written chunks stored; the tokens now stored from `start`.

        Raises LeaseExpiredError when the staging lease lapsed first: nothing of it is stored.
        """
        if self._done:
            return self._stored_tokens
        self._done = True
        connection = self._connection
        if self._inline is not None:
            frames = p.inline_frames(self._inline)
            reply, _ = connection.call(self._store_inline(**self._fields), frames)
        else:
            reply, _ = connection.call(p.Commit(self._reservation_id))
        request = "Commit" if self._inline is None else self._store_inline.__name__
        stored = reply_as(reply, p.StoreReply, request)
        self.stored_chunks = stored.stored_chunks
        self._stored_tokens = stored.stored_chunks * connection.chunk_size
        return self._stored_tokens

    def abort(self) -> None:
        """Give the slots back without storing anything; idempotent."""
        if self._done:
            return
        self._done = True
        if self._reservation_id:
            self._connection.call(p.Abort(self._reservation_id))

    def __enter__(self) -> StoreSlots:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
            return
        # the original exception matters more; the server reclaims the slots anyway
        with contextlib.suppress(KVTierError):
            self.abort()


class RetrievedSlots:
    """Read-only views of the leading cached chunks of [start, end) of one rank.

    `views[i]` is chunk i's bytes: an arena slot held for this client until `done()`, or an
    inline frame. `done()` (called on leaving the `with` block) ends the lease; it raises
    LeaseExpiredError when the lease lapsed before it, and then bytes copied out of the views
    cannot be vouched for and must be discarded.
    """

    def __init__(
        self,
        connection: Connection,
        fields: dict[str, Any],
        *,
        retrieve: type[p.Retrieve | p.RetrieveKeys] = p.Retrieve,
    ) -> None:
        """`retrieve`: the key-addressed request for chunks named by the caller."""
        self._connection = connection
        inline = connection.arena_bytes is None
        answer, frames = connection.call(retrieve(**fields, inline=inline))
        reply = reply_as(answer, p.RetrieveReply, retrieve.__name__)
        self.num_chunks: int = reply.num_chunks
        self.chunk_nbytes: int = reply.chunk_nbytes
        self.num_tokens: int = reply.num_chunks * connection.chunk_size
        self._lease_id = reply.lease_id
        self._done = False
        views: list[Bytes] = []
        if inline:
            views = [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames]
            for view in views:
                view.flags.writeable = False
        else:
            arena = connection.arena_bytes  # None: the call re-joined a server not mappable here
            if arena is None:
                self._done = True
                if reply.lease_id:
                    with contextlib.suppress(KVTierError):
                        connection.call(p.RetrieveDone(reply.lease_id))
                raise _arena_gone(connection, retrieve.__name__)
            nbytes = reply.chunk_nbytes
            for offset in reply.offsets:
                view = arena[offset : offset + nbytes]
                view.flags.writeable = False
                views.append(view)
        self.views: list[Bytes] = views

    def done(self) -> None:
        """End the lease (the server may reuse the slots); idempotent."""
        if self._done:
            return
        self._done = True
        self.views = []
        if self._lease_id:
            self._connection.call(p.RetrieveDone(self._lease_id))

    def __enter__(self) -> RetrievedSlots:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.done()
            return
        with contextlib.suppress(KVTierError):  # the original exception matters more
            self.done()

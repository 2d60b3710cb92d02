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
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvtier import protocol as p
from kvtier.errors import KVTierError
from kvtier.server.layouts import Layout

if TYPE_CHECKING:
    from kvtier.client import Client

__all__ = ["RetrievedSlots", "StoreSlots"]

Bytes = npt.NDArray[np.uint8]


class StoreSlots:
    """Staging slots for chunks [start, end) of one rank; commit makes them stored.

    Chunks the server already holds get no slot and are not listed by `targets()`. Leaving the
    `with` block commits, unless an exception leaves it: then the slots are given back.
    """

    def __init__(self, client: Client, fields: dict[str, Any]) -> None:
        self._client = client
        self._fields = fields
        self.num_chunks: int = fields["num_chunks"]
        self._done = False
        self._stored_tokens = 0
        self._reservation_id = 0
        self._targets: list[tuple[int, Bytes]] = []
        self._inline: list[Bytes] | None = None
        arena = client._arena_bytes
        if arena is None:  # bytes travel inline: local buffers, sent with the commit
            self.chunk_nbytes = Layout.of(fields["chunk_shape"], fields["dtype"]).nbytes
            self._inline = [
                np.empty(self.chunk_nbytes, dtype=np.uint8) for _ in range(self.num_chunks)
            ]
            self._targets = list(enumerate(self._inline))
            return
        reply, _ = client._call(p.Reserve(**fields))
        assert isinstance(reply, p.ReserveReply)
        arena = client._arena_bytes  # again: the call may have re-joined a restarted server
        assert arena is not None
        self.chunk_nbytes = nbytes = reply.chunk_nbytes
        self._reservation_id = reply.reservation_id
        if not reply.reservation_id:  # every chunk is stored already
            self._done = True
            self._stored_tokens = len(reply.offsets) * client.chunk_size
            return
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
        client = self._client
        if self._inline is not None:
            reply, _ = client._call(p.StoreInline(**self._fields), self._inline)
        else:
            reply, _ = client._call(p.Commit(self._reservation_id))
        assert isinstance(reply, p.StoreReply)
        self._stored_tokens = reply.stored_chunks * client.chunk_size
        return self._stored_tokens

    def abort(self) -> None:
        """Give the slots back without storing anything; idempotent."""
        if self._done:
            return
        self._done = True
        if self._reservation_id:
            self._client._call(p.Abort(self._reservation_id))

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

    def __init__(self, client: Client, fields: dict[str, Any]) -> None:
        self._client = client
        inline = client._arena_bytes is None
        reply, frames = client._call(p.Retrieve(**fields, inline=inline))
        assert isinstance(reply, p.RetrieveReply)
        self.num_chunks: int = reply.num_chunks
        self.chunk_nbytes: int = reply.chunk_nbytes
        self.num_tokens: int = reply.num_chunks * client.chunk_size
        self._lease_id = reply.lease_id
        self._done = False
        views: list[Bytes] = []
        if inline:
            views = [np.frombuffer(f.buffer, dtype=np.uint8) for f in frames]
            for view in views:
                view.flags.writeable = False
        else:
            arena = client._arena_bytes
            assert arena is not None
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
            self._client._call(p.RetrieveDone(self._lease_id))

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

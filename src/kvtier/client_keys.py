"""The client side of key-addressed chunks: slots to write named chunks into, and to read them.

`Client.store_key_slots` / `Client.retrieve_key_slots` return these. On the server's machine the
views are the arena's slots themselves, so a caller copies straight between its own memory (an
SGLang host pool page) and shared memory; elsewhere they are local buffers sent or received as
frames. Either way the caller sees the same views and the same results.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier import protocol as p
from kvtier.errors import BadArrayError, KVTierError

__all__ = ["KeyRetrievedSlots", "KeyStoreSlots", "chunk_nbytes"]

#: sends one request (with payload frames) and returns the reply and the reply's frames
Call = Callable[..., tuple[p.Reply, list[Any]]]

# Element sizes of the dtypes a layout may name (the server's table is the authority; this one
# only sizes local buffers of a client without the arena before the server has answered).
_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def chunk_nbytes(chunk_shape: list[int], dtype: str) -> int:
    """Bytes of one chunk of `chunk_shape` and `dtype`."""
    try:
        itemsize = _ITEMSIZE.get(dtype) or np.dtype(dtype).itemsize
    except TypeError:
        raise BadArrayError(f"dtype {dtype!r} is not a known element type") from None
    return math.prod(chunk_shape) * itemsize


class KeyStoreSlots:
    """Where to write named chunks: `targets()` lists the chunks not yet stored.

    `with` commits on a clean exit and aborts on an exception; `stored_chunks` is then the
    number of named chunks stored (written now or already present).
    """

    def __init__(
        self,
        call: Call,
        fields: dict[str, Any],
        arena: npt.NDArray[np.uint8] | None,
    ) -> None:
        self._call = call
        self._fields = fields
        self.stored_chunks = 0
        self._done = False
        num = len(fields["names"])
        self._buffers: list[npt.NDArray[np.uint8]] = []
        if arena is None:  # inline: local buffers, sent as frames at commit
            nbytes = chunk_nbytes(fields["chunk_shape"], fields["dtype"])
            self.chunk_nbytes = nbytes
            self._buffers = [np.empty(nbytes, np.uint8) for _ in range(num)]
            self._reservation_id = 0
            self._targets = list(enumerate(self._buffers))
            return
        reply, _ = call(p.ReserveKeys(**fields))
        assert isinstance(reply, p.ReserveReply)
        self.chunk_nbytes = nbytes = reply.chunk_nbytes
        self._reservation_id = reply.reservation_id
        self._targets = [
            (i, arena[off : off + nbytes]) for i, off in enumerate(reply.offsets) if off >= 0
        ]
        if not self._reservation_id:
            self._done = True  # everything was already stored
            self.stored_chunks = num

    def targets(self) -> Iterator[tuple[int, npt.NDArray[np.uint8]]]:
        """(index into the names, writable uint8 view of `chunk_nbytes`) per chunk to write."""
        return iter(self._targets)

    def commit(self) -> int:
        """Make the written chunks visible; returns the named chunks now stored."""
        if self._done:
            return self.stored_chunks
        self._done = True
        if self._buffers:
            reply, _ = self._call(p.StoreKeysInline(**self._fields), self._buffers)
        else:
            reply, _ = self._call(p.Commit(self._reservation_id))
        assert isinstance(reply, p.StoreReply)
        self.stored_chunks = reply.stored_chunks
        return self.stored_chunks

    def abort(self) -> None:
        """Give the slots back without storing anything."""
        if self._done:
            return
        self._done = True
        if self._reservation_id:
            self._call(p.Abort(self._reservation_id))

    def __enter__(self) -> KeyStoreSlots:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            with contextlib.suppress(KVTierError):
                self.abort()


class KeyRetrievedSlots:
    """The leading named chunks stored for this rank, as read-only uint8 views.

    `views[i]` holds chunk i for i < `num_chunks`. On the arena they stay valid until `done()`
    (the `with` block's end), which gives the slots back to the server.
    """

    def __init__(self, call: Call, fields: dict[str, Any], arena: npt.NDArray[np.uint8] | None):
        self._call = call
        reply, frames = call(p.RetrieveKeys(**fields, inline=arena is None))
        assert isinstance(reply, p.RetrieveReply)
        self.num_chunks = reply.num_chunks
        self.chunk_nbytes = nbytes = reply.chunk_nbytes
        self._lease_id = reply.lease_id
        if arena is None:
            self.views = [np.frombuffer(f.buffer, np.uint8) for f in frames]
        else:
            self.views = [arena[off : off + nbytes] for off in reply.offsets]
            for view in self.views:
                view.flags.writeable = False

    def done(self) -> None:
        """The caller copied the views out: the server may reuse the slots."""
        lease_id, self._lease_id = self._lease_id, 0
        self.views = []
        if lease_id:
            self._call(p.RetrieveDone(lease_id))

    def __enter__(self) -> KeyRetrievedSlots:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.done()
        else:
            with contextlib.suppress(KVTierError):
                self.done()

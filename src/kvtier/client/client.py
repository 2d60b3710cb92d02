"""The client library used by schedulers and workers: `Client`, the request API.

`Client` holds the connection, registers workers, looks prompts up and moves the chunks of a
prompt's ranges; its calls on chunks the caller names itself come from its base,
`named.NamedChunkCalls`.

One `Client` per process is enough: it is thread-safe (see `kvtier.client.connection`). On the
server's machine the KV bytes go straight between the caller's arrays and the server's
shared-memory arena; elsewhere they travel inline as ZMQ frames. Both paths give the same
results.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from kvtier import protocol as p
from kvtier.client.arrays import chunk_rows, packed_tokens
from kvtier.client.connection import Connection, Transfer, reply_as
from kvtier.client.copying import copy_pairs
from kvtier.client.lookup_handle import LookupHandle
from kvtier.client.named import NamedChunkCalls
from kvtier.client.ranges import ChunkRange, range_of
from kvtier.client.slots import RetrievedSlots, StoreSlots
from kvtier.errors import BadArrayError, InvalidArgumentError
from kvtier.hashing import TokenHasher, TokenIds

__all__ = ["Client"]


def _range_and_array(
    request: ChunkRange | str, second: Any, third: Any, short: dict[str, Any]
) -> tuple[ChunkRange, Any]:
    """The range and array of a store or retrieve: `(span, array)` or the short form
    `(request_id, tokens, array, **range keywords)`."""
    if not isinstance(request, ChunkRange):
        return range_of(request, second, short), third
    if third is not None:
        raise InvalidArgumentError("a store or retrieve given a ChunkRange takes one array")
    return range_of(request, None, short), second


def _slot_end(span: ChunkRange, call: str) -> int:
    """The range's end, which a slot call needs (it has no array to count chunks from)."""
    if span.end is None:
        raise InvalidArgumentError(f"{call} needs the range's end")
    return span.end


class Client(NamedChunkCalls):
    """A connection to one `kvtier serve`. docs/client.md shows the flow of one request.

    Stores and retrieves name their chunks with a `ChunkRange` (`client.store(span, kv)`), or
    in the short form with its fields as keywords (`client.store("r", tokens, kv, model="m")`).
    """

    def __init__(
        self,
        address: str,
        *,
        hasher: TokenHasher | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 2.0,
        transfer: Transfer = "auto",
        heartbeat_interval: float = 1.0,
        client_id: str | None = None,
        token: str = "",
    ) -> None:
        """`token`: a credential from the server's --auth-tokens-file, when it has one."""
        self._connection = Connection(
            address,
            hasher=hasher,
            timeout=timeout,
            connect_timeout=connect_timeout,
            transfer=transfer,
            heartbeat_interval=heartbeat_interval,
            client_id=client_id or uuid.uuid4().hex,
            token=token,
        )
        self._world_sizes = {}  # per model, as registered: a range's and a name's default

    # -- connection -----------------------------------------------------------------------------

    @property
    def connection(self) -> Connection:
        """The connection under this client: `call` sends any protocol message (for tools and
        tests that speak the wire protocol directly)."""
        return self._connection

    @property
    def address(self) -> str:
        """The server's ZMQ address."""
        return self._connection.address

    @property
    def client_id(self) -> str:
        """This client's id, the same on every socket (the server's status lists it)."""
        return self._connection.client_id

    @property
    def timeout(self) -> float:
        """Seconds a request waits for its reply."""
        return self._connection.timeout

    @property
    def connect_timeout(self) -> float:
        """Seconds the first handshake waits."""
        return self._connection.connect_timeout

    @property
    def hasher(self) -> TokenHasher | None:
        """The chunk hasher whose contract the server checks at the handshake, if any."""
        return self._connection.hasher

    @property
    def server(self) -> p.HelloReply:
        """The server's handshake reply (its id, chunk size, arena); a new one after a rejoin."""
        return self._connection.server

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk, as the server names chunks."""
        return self._connection.chunk_size

    @property
    def transfer(self) -> str:
        """ "shm" when bytes go through the server's arena, "inline" when they go as frames."""
        return self._connection.transfer

    @property
    def arena_bytes(self) -> npt.NDArray[np.uint8] | None:
        """The server's shared-memory arena as mapped in this process (uint8, whole arena), or
        None when bytes go inline. A re-join after a server restart maps a new arena: read it
        again rather than keeping it across calls. For callers that register the arena with a
        device (pinned host memory); slot views come from `store_slots` / `retrieve_slots`."""
        return self._connection.arena_bytes

    # -- operations -----------------------------------------------------------------------------

    def register(
        self,
        *,
        model: str,
        world_size: int = 1,
        worker_id: int = 0,
        chunk_shape: Sequence[int],
        dtype: str,
        role: str = "",
        kv_groups: Sequence[p.KVGroup] = (),
    ) -> None:
        """Tell the server this worker's KV layout: one chunk of its shard is `chunk_shape`.
        `role`: its part in prefill/decode hand-offs ("kv_producer", "kv_consumer"; "" none),
        refused when a peer of the other role has registered the model with another
        world size. `kv_groups`: the engine's KV cache groups a chunk holds a piece of (the
        KV events then announce each chunk once per group, labelled as the engine would)."""
        dtype = str(dtype).removeprefix("torch.")
        try:
            shape = [int(d) for d in chunk_shape]
        except (TypeError, ValueError) as exc:
            raise BadArrayError(f"chunk_shape {chunk_shape!r} must be a sequence of ints") from exc
        register = p.Register(
            model, world_size, worker_id, shape, dtype, role=role, kv_groups=list(kv_groups)
        )
        self._connection.register(register)  # sent again to a restarted server
        self._world_sizes[model] = world_size

    @overload
    def lookup(
        self,
        request_id: str,
        tokens: TokenIds,
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
        wait: Literal[True] = True,
        readers: int = 0,
        prefill_tokens_per_s: float = 0.0,
    ) -> int: ...

    @overload
    def lookup(
        self,
        request_id: str,
        tokens: TokenIds,
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
        wait: Literal[False],
        readers: int = 0,
        prefill_tokens_per_s: float = 0.0,
    ) -> LookupHandle: ...

    def lookup(
        self,
        request_id: str,
        tokens: TokenIds,
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
        wait: bool = True,
        readers: int = 0,
        prefill_tokens_per_s: float = 0.0,
    ) -> int | LookupHandle:
        """Leading tokens whose chunks every rank has cached (pinned until retrieved).

        Chunks that must first load from an L2 tier load on the server; with `wait=False` this
        returns at once a `LookupHandle` to poll while they do (a scheduler step is not held up).
        `readers`: how many ranks retrieve under the pin (0: world_size); the pin is released
        once each of readers 0..readers-1 retrieved (see `retrieve(reader=...)`).
        With `prefill_tokens_per_s` (the engine's prefill speed) the server leaves out the L2
        chunks it predicts load slower than they recompute; 0 (unknown) reports every one.
        """
        msg = p.Lookup(
            request_id,
            packed_tokens(tokens),
            model,
            world_size,
            cache_salt,
            wait,
            extra_key,
            readers,
            prefill_tokens_per_s,
        )
        raw, _ = self._connection.call(msg)
        reply = reply_as(raw, p.LookupReply, "Lookup")
        if wait:
            return reply.hit_tokens
        hit = None if reply.pending else reply.hit_tokens
        return LookupHandle(self._connection, request_id, hit, cache_salt)

    # -- ranges of a prompt ---------------------------------------------------------------------

    @overload
    def store_slots(
        self,
        span: ChunkRange,
        /,
        *,
        chunk_shape: Sequence[int],
        dtype: str,
        resumable: Sequence[bool] = (),
    ) -> StoreSlots: ...

    @overload
    def store_slots(
        self,
        request_id: str,
        tokens: TokenIds,
        *,
        model: str,
        worker_id: int = 0,
        start: int = 0,
        end: int,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
        resumable: Sequence[bool] = (),
    ) -> StoreSlots: ...

    def store_slots(
        self,
        request_id: ChunkRange | str,
        tokens: TokenIds | None = None,
        *,
        chunk_shape: Sequence[int],
        dtype: str,
        resumable: Sequence[bool] = (),
        **short: Any,
    ) -> StoreSlots:
        """Slots to write this rank's chunks of the range into; commits on leaving `with`.

        `store_slots(span, chunk_shape=..., dtype=...)`, or the short form with the range's
        fields as keywords (`end` required). `resumable[i]`: whether chunk i is a point the
        engine can resume from (empty: every chunk is); a lookup's hit ends at the last resume
        point of its leading stored chunks.
        """
        span = range_of(request_id, tokens, short)
        end = _slot_end(span, "store_slots")
        num_chunks = max(0, (end - span.start) // self.chunk_size)
        fields = self._fields(span, end, chunk_shape, dtype, num_chunks)
        return StoreSlots(self._connection, {**fields, "resumable": [bool(r) for r in resumable]})

    @overload
    def retrieve_slots(
        self,
        span: ChunkRange,
        /,
        *,
        chunk_shape: Sequence[int],
        dtype: str,
        reader: int = -1,
    ) -> RetrievedSlots: ...

    @overload
    def retrieve_slots(
        self,
        request_id: str,
        tokens: TokenIds,
        *,
        model: str,
        worker_id: int = 0,
        start: int = 0,
        end: int,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
        reader: int = -1,
    ) -> RetrievedSlots: ...

    def retrieve_slots(
        self,
        request_id: ChunkRange | str,
        tokens: TokenIds | None = None,
        *,
        chunk_shape: Sequence[int],
        dtype: str,
        reader: int = -1,
        **short: Any,
    ) -> RetrievedSlots:
        """Read-only views of this rank's leading cached chunks of the range.

        `retrieve_slots(span, chunk_shape=..., dtype=...)`, or the short form with the range's
        fields as keywords (`end` required). `reader` is the rank marked done on the lookup's
        pin (-1: worker_id).
        """
        span = range_of(request_id, tokens, short)
        end = _slot_end(span, "retrieve_slots")
        num_chunks = max(0, (end - span.start) // self.chunk_size)
        fields = self._fields(span, end, chunk_shape, dtype, num_chunks)
        return RetrievedSlots(self._connection, {**fields, "reader": reader})

    @overload
    def store(self, span: ChunkRange, kv: Any, /, *, resumable: Sequence[bool] = ()) -> int: ...

    @overload
    def store(
        self,
        request_id: str,
        tokens: TokenIds,
        kv: Any,
        *,
        model: str,
        worker_id: int = 0,
        start: int = 0,
        end: int | None = None,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
        resumable: Sequence[bool] = (),
    ) -> int: ...

    def store(
        self,
        request_id: ChunkRange | str,
        tokens: Any = None,
        kv: Any = None,
        *,
        resumable: Sequence[bool] = (),
        **short: Any,
    ) -> int:
        """Store this rank's chunks of the range from `kv` (num_chunks, *chunk_shape).

        `store(span, kv)`, or the short form `store(request_id, tokens, kv, model=..., ...)`.
        `end` None: start + num_chunks * chunk_size. Returns the tokens now stored from
        `start`. `resumable` as in `store_slots`.
        """
        span, kv = _range_and_array(request_id, tokens, kv, short)
        rows, fields = self._rows(span, kv, "kv")
        fields["resumable"] = [bool(r) for r in resumable]
        with StoreSlots(self._connection, fields) as slots:
            copy_pairs([(view, rows[i]) for i, view in slots.targets()])
            return slots.commit()

    @overload
    def retrieve(self, span: ChunkRange, out: Any, /, *, reader: int = -1) -> int: ...

    @overload
    def retrieve(
        self,
        request_id: str,
        tokens: TokenIds,
        out: Any,
        *,
        model: str,
        worker_id: int = 0,
        start: int = 0,
        end: int | None = None,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
        reader: int = -1,
    ) -> int: ...

    def retrieve(
        self,
        request_id: ChunkRange | str,
        tokens: Any = None,
        out: Any = None,
        *,
        reader: int = -1,
        **short: Any,
    ) -> int:
        """Copy this rank's shards of the range's chunks into `out` (num_chunks, *chunk_shape).

        `retrieve(span, out)`, or the short form `retrieve(request_id, tokens, out, model=...,
        ...)`. Returns the tokens retrieved from `start`: it stops at the first chunk not
        cached. Raises LeaseExpiredError when the server's lease on the slots lapsed during the
        copy. `reader`: the rank marked done on the lookup's pin (-1: worker_id).
        """
        span, out = _range_and_array(request_id, tokens, out, short)
        rows, fields = self._rows(span, out, "out")
        with RetrievedSlots(self._connection, {**fields, "reader": reader}) as got:
            copy_pairs([(rows[i], view) for i, view in enumerate(got.views)])
        return got.num_tokens

    def _rows(
        self, span: ChunkRange, array: Any, what: str
    ) -> tuple[npt.NDArray[np.uint8], dict[str, Any]]:
        """The array's chunk rows and the fields of a RangeRequest for it."""
        rows, shape, dtype = chunk_rows(array, what, writable=what == "out")
        start, end = span.start, span.end
        if end is not None and (end - start) % self.chunk_size == 0:
            # an explicit range may use only the leading rows of a larger array (e.g. `out`
            # sized for the whole prompt, `end=hit`); a smaller array is the server's to refuse
            rows = rows[: max(0, (end - start) // self.chunk_size)]
        num_chunks = rows.shape[0]
        end = start + num_chunks * self.chunk_size if end is None else end
        return rows, self._fields(span, end, shape, dtype, num_chunks)

    def _fields(
        self,
        span: ChunkRange,
        end: int,
        chunk_shape: Sequence[int],
        dtype: str,
        num_chunks: int,
    ) -> dict[str, Any]:
        """The fields of a RangeRequest (the server checks them against the layout)."""
        return {
            "request_id": span.request_id,
            "tokens": packed_tokens(span.tokens),
            "model": span.model,
            "world_size": span.world_size or self._world_sizes.get(span.model, 1),
            "worker_id": span.worker_id,
            "start": span.start,
            "end": end,
            "chunk_shape": [int(d) for d in chunk_shape],
            "dtype": str(dtype).removeprefix("torch."),
            "num_chunks": num_chunks,
            "cache_salt": span.cache_salt,
            "extra_key": span.extra_key,
        }

    # -- sessions -------------------------------------------------------------------------------

    def release(self, request_id: str, *, cache_salt: str = "") -> None:
        """Drop the request's lookup pins (the engine computed those chunks itself)."""
        self._connection.call(p.Release(request_id, cache_salt))

    def end_session(self, request_id: str, *, cache_salt: str = "") -> None:
        """The request is finished: the server forgets its session and releases its pins.

        Without a credential, sessions are scoped by cache salt: pass the request's salt."""
        self._connection.call(p.EndSession(request_id, cache_salt))

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Say goodbye and disconnect; idempotent. The server reclaims what this client holds.

        Safe while other threads are mid-call: they are woken and raise NotConnectedError.
        """
        self._connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

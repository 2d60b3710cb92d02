"""The client library used by schedulers and workers: `Client`, the request API.

One `Client` per process is enough: it is thread-safe (see `kvtier.client.connection`). On the
server's machine the KV bytes go straight between the caller's arrays and the server's
shared-memory arena; elsewhere they travel inline as ZMQ frames. Both paths give the same
results.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from kvtier import protocol as p
from kvtier.client.connection import Connection, NoReply, Transfer, reply_as
from kvtier.client.copying import copy_pairs
from kvtier.client.ranges import ChunkRange, range_of
from kvtier.client.slots import RetrievedSlots, StoreSlots
from kvtier.errors import (
    BadArrayError,
    InvalidArgumentError,
    KVTierError,
    NotConnectedError,
    ProtocolVersionError,
)
from kvtier.hashing import TokenHasher, TokenIds, token_bytes
from kvtier.names import ChunkName, check_names

__all__ = ["Client", "LookupHandle"]


def _tokens(tokens: TokenIds) -> bytes:
    try:
        raw = token_bytes(tokens)
    except KVTierError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentError(
            f"tokens must be ints in [0, 2**32), a numpy integer array or packed uint32 "
            f"bytes: {exc}"
        ) from None
    return raw if isinstance(raw, bytes) else bytes(raw)


def _chunk_rows(
    array: Any, what: str, *, writable: bool
) -> tuple[npt.NDArray[np.uint8], list[int], str]:
    """A (num_chunks, chunk_bytes) uint8 view of a numpy array or CPU torch tensor, no copy.

    Returns the view, the chunk shape (array shape without its first axis) and the dtype name.
    """
    if isinstance(array, np.ndarray):
        if array.ndim < 2:
            raise BadArrayError(
                f"{what} must be (num_chunks, *chunk_shape), got shape {array.shape}"
            )
        if not array.flags.c_contiguous:
            raise BadArrayError(f"{what} must be C-contiguous (use np.ascontiguousarray)")
        if not array.dtype.isnative:
            raise BadArrayError(
                f"{what} has byte order {array.dtype.str!r}, not this machine's: convert it "
                "(array.astype(array.dtype.newbyteorder('=')))"
            )
        if writable and not array.flags.writeable:
            raise BadArrayError(f"{what} is read-only; retrieve writes into it")
        rows = array.reshape(array.shape[0], math.prod(array.shape[1:])).view(np.uint8)
        return rows, list(array.shape[1:]), array.dtype.name
    if type(array).__module__.startswith("torch"):
        if array.device.type != "cpu":
            raise BadArrayError(f"{what} is on {array.device}; kvtier moves CPU tensors")
        if array.dim() < 2:
            raise BadArrayError(
                f"{what} must be (num_chunks, *chunk_shape), got {tuple(array.shape)}"
            )
        if not array.is_contiguous():
            raise BadArrayError(f"{what} must be contiguous (call .contiguous())")
        import torch  # only reached when the caller already uses torch

        flat = array.detach().reshape(array.shape[0], math.prod(array.shape[1:]))
        rows_t = flat.view(torch.uint8)
        return rows_t.numpy(), list(array.shape[1:]), str(array.dtype).removeprefix("torch.")
    raise BadArrayError(f"{what} must be a numpy array or a CPU torch tensor, got {type(array)}")


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


class LookupHandle:
    """A lookup whose L2 loads may still run on the server: `poll()` asks without waiting,
    `result()` waits on the server for the answer."""

    def __init__(
        self,
        connection: Connection,
        request_id: str,
        hit_tokens: int | None,
        cache_salt: str = "",
    ) -> None:
        self._connection = connection
        self.request_id = request_id
        self._hit_tokens = hit_tokens
        self._cache_salt = cache_salt

    def poll(self) -> int | None:
        """The hit tokens once known, else None; one round trip at most, never waits."""
        if self._hit_tokens is None:
            poll = p.LookupPoll(self.request_id, cache_salt=self._cache_salt)
            reply, _ = self._connection.call(poll)
            done = reply_as(reply, p.LookupReply, "LookupPoll")
            if not done.pending:
                self._hit_tokens = done.hit_tokens
        return self._hit_tokens

    def result(self, timeout: float | None = None) -> int:
        """Wait until the hit is known; NotConnectedError when `timeout` seconds pass first.

        One request that the server answers when the loads end (no polling). Without a
        timeout it waits as long as the server answers heartbeats, asking again each
        `Client.timeout` seconds.
        """
        if self._hit_tokens is not None:
            return self._hit_tokens
        connection = self._connection
        poll = p.LookupPoll(self.request_id, wait=True, cache_salt=self._cache_salt)
        while True:
            wait_s = connection.timeout if timeout is None else timeout
            try:
                if wait_s <= 0:  # no time to wait: one look, then the timeout's error
                    hit = self.poll()
                    if hit is not None:
                        return hit
                    raise NoReply("no time to wait")
                reply, _ = connection.call(poll, wait_s=wait_s)
                break
            except NoReply:
                if timeout is not None:
                    raise NotConnectedError(
                        f"lookup of request {self.request_id!r} still loading from L2 after "
                        f"{timeout:g}s (LookupHandle.result(timeout=...))"
                    ) from None
                # no timeout: ask again; a server that stopped answering heartbeats meanwhile
                # makes the next call fail fast with NotConnectedError
        self._hit_tokens = reply_as(reply, p.LookupReply, "LookupPoll").hit_tokens
        return self._hit_tokens

    def __repr__(self) -> str:
        state = "pending" if self._hit_tokens is None else f"hit_tokens={self._hit_tokens}"
        return f"LookupHandle({self.request_id!r}, {state})"


class Client:
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
        self._world_sizes: dict[str, int] = {}  # per model, as registered: a range's default

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
    ) -> None:
        """Tell the server this worker's KV layout: one chunk of its shard is `chunk_shape`.
        `role`: its part in prefill/decode hand-offs ("kv_producer", "kv_consumer"; "" none),
        refused when a peer of the other role has registered the model with another
        world size."""
        dtype = str(dtype).removeprefix("torch.")
        try:
            shape = [int(d) for d in chunk_shape]
        except (TypeError, ValueError) as exc:
            raise BadArrayError(f"chunk_shape {chunk_shape!r} must be a sequence of ints") from exc
        register = p.Register(model, world_size, worker_id, shape, dtype, role=role)
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
            _tokens(tokens),
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
        rows, shape, dtype = _chunk_rows(array, what, writable=what == "out")
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
            "tokens": _tokens(span.tokens),
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

    # -- key-addressed chunks (named by the caller, e.g. SGLang's page hashes) ---------------------

    def exists_keys(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
        prefill_tokens_per_s: float = 0.0,
    ) -> int:
        """How many leading named chunks every rank has stored (L2 hits are loaded into L1;
        with `prefill_tokens_per_s`, as for `lookup`, not those slower to load than recompute)."""
        names = check_names(names)
        msg = p.ExistsKeys(
            names,
            model,
            world_size,
            cache_salt,
            extra_key,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        raw, _ = self._connection.call(msg)
        return reply_as(raw, p.ExistsReply, "ExistsKeys").num_chunks

    def exists_each_key(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
    ) -> list[bool]:
        """Per named chunk, whether every rank has stored it (past a missing one too; L2 hits
        are loaded into L1)."""
        names = check_names(names)
        request = p.ExistsKeys(names, model, world_size, cache_salt, extra_key, each=True)
        raw, _ = self._connection.call(request)
        present = reply_as(raw, p.ExistsReply, "ExistsKeys").present
        if len(present) != len(names):
            raise ProtocolVersionError(
                f"the server answered {len(present)} flags for {len(names)} names: it predates "
                "ExistsKeys.each (upgrade the server)"
            )
        return present

    def store_key_slots(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        worker_id: int = 0,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
        handoff: str = "",
    ) -> StoreSlots:
        """Slots to write this rank's named chunks into; `with` commits them.

        As `store_slots`, with `targets()` indexing into `names` and `stored_chunks` counting
        the named chunks stored after the commit. `handoff`: the chunks are (part of) hand-off
        object `handoff` for one reader, pinned until `end_handoff` or the server's
        --handoff-lease (never subject to the cache policy).
        """
        fields = self._key_fields(
            names, model, worker_id, chunk_shape, dtype, cache_salt, extra_key, world_size
        )
        if handoff:
            fields.update(request_id=handoff, handoff=True)
        return StoreSlots(
            self._connection, fields, reserve=p.ReserveKeys, store_inline=p.StoreKeysInline
        )

    def retrieve_key_slots(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        worker_id: int = 0,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
    ) -> RetrievedSlots:
        """Read-only views of this rank's leading stored named chunks (as `retrieve_slots`)."""
        fields = self._key_fields(
            names, model, worker_id, chunk_shape, dtype, cache_salt, extra_key, world_size
        )
        return RetrievedSlots(self._connection, fields, retrieve=p.RetrieveKeys)

    def put_keys(
        self,
        names: Sequence[ChunkName],
        chunks: Any,
        *,
        model: str,
        worker_id: int = 0,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
    ) -> int:
        """Store this rank's named chunks from `chunks` (len(names), *chunk_shape).

        Returns how many of them are now stored (written now or already present).
        """
        names = check_names(names)
        rows, shape, dtype = _chunk_rows(chunks, "chunks", writable=False)
        if rows.shape[0] != len(names):
            raise BadArrayError(f"{len(names)} names but {rows.shape[0]} chunks in the array")
        if self.arena_bytes is None:  # inline: send the rows themselves, no staging copy
            fields = self._key_fields(
                names, model, worker_id, shape, dtype, cache_salt, extra_key, world_size
            )
            raw, _ = self._connection.call(
                p.StoreKeysInline(**fields), p.inline_frames(rows[i] for i in range(len(rows)))
            )
            return reply_as(raw, p.StoreReply, "StoreKeysInline").stored_chunks
        slots = self.store_key_slots(
            names,
            model=model,
            worker_id=worker_id,
            chunk_shape=shape,
            dtype=dtype,
            cache_salt=cache_salt,
            extra_key=extra_key,
            world_size=world_size,
        )
        with slots:
            copy_pairs([(view, rows[i]) for i, view in slots.targets()])
        return slots.stored_chunks

    def get_keys(
        self,
        names: Sequence[ChunkName],
        out: Any,
        *,
        model: str,
        worker_id: int = 0,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
    ) -> int:
        """Copy this rank's leading stored named chunks into `out` (>= len(names), *chunk_shape).

        Returns how many leading names were copied: it stops at the first one not stored.
        """
        names = check_names(names)
        rows, shape, dtype = _chunk_rows(out, "out", writable=True)
        if rows.shape[0] < len(names):
            raise BadArrayError(f"out holds {rows.shape[0]} chunks, fewer than {len(names)} names")
        with self.retrieve_key_slots(
            names,
            model=model,
            worker_id=worker_id,
            chunk_shape=shape,
            dtype=dtype,
            cache_salt=cache_salt,
            extra_key=extra_key,
            world_size=world_size,
        ) as got:
            copy_pairs([(rows[i], view) for i, view in enumerate(got.views)])
        return got.num_chunks

    def _key_fields(
        self,
        names: Sequence[ChunkName],
        model: str,
        worker_id: int,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str,
        extra_key: bytes,
        world_size: int | None,
    ) -> dict[str, Any]:
        """The fields of a KeyRequest, names validated here before anything is sent."""
        checked = check_names(names)
        return {
            "names": checked,
            "model": model,
            "world_size": world_size or self._world_sizes.get(model, 1),
            "worker_id": worker_id,
            "chunk_shape": [int(d) for d in chunk_shape],
            "dtype": str(dtype).removeprefix("torch."),
            "num_chunks": len(checked),
            "cache_salt": cache_salt,
            "extra_key": extra_key,
        }

    def end_handoff(
        self,
        handoff: str,
        names: Sequence[ChunkName],
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
    ) -> None:
        """The reader has hand-off `handoff` (its chunks `names`): the server frees them from L1
        and deletes them from its L2 tiers."""
        checked = check_names(names)
        msg = p.EndHandoff(handoff, checked, model, world_size, cache_salt, extra_key)
        self._connection.call(msg)

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

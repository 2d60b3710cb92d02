"""The wire protocol: msgspec tagged-union Structs, one encoder, one typed decoder.

A message is a ZMQ multipart: `[seq, header, *payloads]`. `seq` is 8 opaque bytes the client
chooses and the server echoes, so a late reply is never taken for the answer to a newer request.
`header` is a msgpack-encoded request or reply Struct (array-like: positional, tag first).
`payloads` carry KV bytes only when a client cannot map the shared-memory arena (another
machine): one frame per chunk. Tokens always travel as packed little-endian uint32 bytes.

`Hello` is the first request on every socket; its shape never changes between versions, so a
peer of another version always gets a clear `PROTOCOL_VERSION` error instead of garbage.
"""

from __future__ import annotations

import socket
from typing import Any

import msgspec

from kvtier.errors import KVTierError, MalformedFrameError, UnknownRequestError

PROTOCOL_VERSION = 4  # 2: extra keys; composed (tenant, name) keys; 3: readers, resume points;
#: 4: hand-off objects (ReserveKeys/StoreKeysInline.handoff, EndHandoff)


#: the most bytes of KV one frame carries inline: a chunk bigger than this travels as several
#: consecutive frames, so the largest frame a server must accept (from anyone, before any
#: credential) does not grow with the chunk or the arena
INLINE_FRAME_BYTES = 4 << 20


def inline_frames(chunks: Any) -> list[memoryview]:
    """The frames that carry `chunks` (a sequence of byte buffers, one per chunk) inline: each
    chunk in pieces of at most INLINE_FRAME_BYTES, in order."""
    out = []
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        if len(view) <= INLINE_FRAME_BYTES:
            out.append(view)
            continue
        out.extend(
            view[i : i + INLINE_FRAME_BYTES] for i in range(0, len(view), INLINE_FRAME_BYTES)
        )
    return out


def local_host_id() -> str:
    """Names this machine's current boot: a client whose id equals the server's can map the
    server's shared-memory arena; any other client moves bytes inline."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


class _Msg(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Base of every message: positional encoding, the class name as the tag."""


# -- requests ----------------------------------------------------------------------------------


class Hello(_Msg):
    """Handshake. `contract` None means: adopt the server's hashing settings."""

    protocol_version: int
    client_id: str
    contract: str | None = None
    contract_info: dict[str, Any] = {}
    host_id: str = ""
    pid: int = 0  # a same-host client's process: the server fences its slots by it
    token: str = ""  # a credential from the server's --auth-tokens-file (when it has one)


class Heartbeat(_Msg):
    """Keeps the client's leases (staging slots, in-flight retrieves) alive."""


class KVGroup(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One KV cache group of an engine, as its KV events name it."""

    group_idx: int  # the engine's index of the group
    kind: str  # the engine's name for the group's kind (vLLM: "full_attention", "mamba", ...)
    sliding_window: int = 0  # its window in tokens (0: none)


class Register(_Msg):
    """A worker's KV layout for one model: the shape and dtype of one chunk of its shard."""

    model: str
    world_size: int
    worker_id: int
    chunk_shape: list[int]
    dtype: str
    #: the worker's part in prefill/decode hand-offs (HANDOFF_ROLES; "": none): a producer and
    #: a consumer of one model must store and read the same shards, checked here at start
    role: str = ""
    #: the engine's KV cache groups a chunk holds a piece of (none: one, unnamed): the KV
    #: events then announce each chunk once per group, labelled as the engine labels its own
    kv_groups: list[KVGroup] = []


#: the hand-off roles a Register may name
HANDOFF_ROLES = ("kv_producer", "kv_consumer")
#: KV cache groups one Register may name at most
MAX_KV_GROUPS = 64


class Lookup(_Msg):
    """How many leading tokens are cached for every rank; pins those chunks for the request.

    When chunks must first load from L2, the server starts a prefetch job: with `wait` it answers
    once the job is done, without it at once with `pending` (then the client polls).
    """

    request_id: str
    tokens: bytes
    model: str
    world_size: int = 1
    cache_salt: str = ""
    wait: bool = True
    extra_key: bytes = b""  # what else changes the KV of these tokens (see RangeRequest)
    # How many ranks retrieve under this lookup's pin (0: world_size). More than world_size
    # when ranks share a shard (MLA: one latent cache, stored once, read by every TP rank).
    readers: int = 0
    #: how fast the engine computes a prefill, tokens per second (0 = unknown): L2 chunks whose
    #: load the server predicts slower than recomputing them are not reported
    prefill_tokens_per_s: float = 0.0


class LookupPoll(_Msg):
    """The result of the request's pending lookup; `wait` answers only once it is done."""

    request_id: str
    wait: bool = False
    cache_salt: str = ""  # the lookup's salt: without a credential, sessions are scoped by it


class RangeRequest(_Msg):
    """The fields of every request that moves one rank's chunks [start, end) of a prompt.

    `chunk_shape`, `dtype` and `num_chunks` describe the caller's array, so the server checks it
    against the registered layout before any byte moves.
    """

    request_id: str
    tokens: bytes
    model: str
    world_size: int
    worker_id: int
    start: int
    end: int
    chunk_shape: list[int]
    dtype: str
    num_chunks: int
    cache_salt: str = ""
    # Everything besides the tokens that changes their KV (a LoRA adapter, multimodal inputs),
    # as the engine adapter names it: chunks stored under one extra key are never found under
    # another. Engines without such inputs send b"".
    extra_key: bytes = b""


class Reserve(RangeRequest):
    """Store, step 1 (shared memory): staging slots for the range.

    `resumable[i]` says whether chunk i of the range is a point the engine can resume from
    (a Mamba state exists only where the engine materialized it); empty: every chunk is.
    """

    resumable: list[bool] = []


class Commit(_Msg):
    """Store, step 2: the client wrote every reserved slot; make them visible."""

    reservation_id: int


class Abort(_Msg):
    """Give back a reservation without committing it."""

    reservation_id: int


class StoreInline(RangeRequest):
    """Store for a client without the arena: one payload frame per chunk follows.

    `resumable` as in Reserve.
    """

    resumable: list[bool] = []


class Retrieve(RangeRequest):
    """Slots (or, `inline`, the bytes) of this rank's shards of the range.

    `reader` is the rank marked done on the lookup's pin (-1: `worker_id`), in
    range(Lookup.readers): several readers may retrieve one shard (MLA).
    """

    inline: bool = False
    reader: int = -1


class RetrieveDone(_Msg):
    """The client copied the slots of a retrieve out: the server may reuse them."""

    lease_id: int


class Release(_Msg):
    """Drop a request's lookup pins (the engine computed those chunks itself)."""

    request_id: str
    cache_salt: str = ""  # without a credential, sessions are scoped by their salt


class EndSession(_Msg):
    """The request is finished: remove its session and release its pins."""

    request_id: str
    cache_salt: str = ""


class Goodbye(_Msg):
    """The client closes on purpose: the server forgets it and reclaims what it still holds."""


class KeyRequest(_Msg):
    """The fields of every request that moves one rank's chunks named by the caller.

    `names` are the caller's chunk names in chain order (validated by `kvtier.names`);
    `chunk_shape`, `dtype` and `num_chunks` describe the caller's array as in RangeRequest.
    `request_id` only labels the retrieve lease (named chunks have no session).
    """

    names: list[bytes]
    model: str
    world_size: int
    worker_id: int
    chunk_shape: list[int]
    dtype: str
    num_chunks: int
    cache_salt: str = ""
    request_id: str = ""
    extra_key: bytes = b""  # as in RangeRequest


class ExistsKeys(_Msg):
    """How many leading named chunks are stored for every rank (L2 hits are loaded into L1).

    `each`: also say which of all the names are stored (`ExistsReply.present`), the ones
    after a gap included; their L2 hits are loaded too. SGLang's trailing-page pools ask this.
    """

    names: list[bytes]
    model: str
    world_size: int = 1
    cache_salt: str = ""
    extra_key: bytes = b""  # as in RangeRequest
    each: bool = False
    prefill_tokens_per_s: float = 0.0  # as in Lookup


class ReserveKeys(KeyRequest):
    """Store named chunks, step 1: staging slots (then Commit, as for Reserve).

    `handoff`: the chunks are a hand-off object for one reader (a decode instance): stored
    whatever the cache policy says, pinned under the hand-off `request_id` for the server's
    --handoff-lease, freed by EndHandoff or when that lease lapses.
    """

    handoff: bool = False


class StoreKeysInline(KeyRequest):
    """Store named chunks for a client without the arena: one payload frame per chunk.

    `handoff` as in ReserveKeys.
    """

    handoff: bool = False


class RetrieveKeys(KeyRequest):
    """Slots (or, `inline`, the bytes) of this rank's shards of the leading stored names."""

    inline: bool = False


class EndHandoff(_Msg):
    """The reader has the hand-off `request_id`: free its named chunks (L1 and L2 tiers)."""

    request_id: str
    names: list[bytes]
    model: str
    world_size: int = 1
    cache_salt: str = ""
    extra_key: bytes = b""


Request = (
    Hello
    | Heartbeat
    | Register
    | Lookup
    | LookupPoll
    | Reserve
    | Commit
    | Abort
    | StoreInline
    | Retrieve
    | RetrieveDone
    | Release
    | EndSession
    | Goodbye
    | ExistsKeys
    | ReserveKeys
    | StoreKeysInline
    | RetrieveKeys
    | EndHandoff
)

REQUEST_TAGS = frozenset(t.__name__ for t in Request.__args__)  # type: ignore[attr-defined]


# -- replies -----------------------------------------------------------------------------------


class HelloReply(_Msg):
    server_version: str
    protocol_version: int
    contract: str
    contract_info: dict[str, Any]
    chunk_size: int
    arena_name: str
    arena_size: int
    host_id: str
    server_id: str = ""  # new at every server start: a client that sees it change re-joins


class Ok(_Msg):
    pass


class LookupReply(_Msg):
    """Tokens hit and pinned; while `pending`, L2 loads still run and `hit_tokens` is 0."""

    hit_tokens: int
    pending: bool = False


#: ReserveReply offsets that are not slots: the chunk is stored already; another client is
#: storing it right now (so this store does not make it stored).
STORED = -1
IN_FLIGHT = -2


class ReserveReply(_Msg):
    """`offsets[i]` is the arena offset for chunk i, or STORED / IN_FLIGHT."""

    reservation_id: int
    offsets: list[int]
    chunk_nbytes: int


class StoreReply(_Msg):
    """Chunks that are now stored for this rank (written now or already present)."""

    stored_chunks: int


class RetrieveReply(_Msg):
    """Leading chunks available; their arena offsets (empty when inline: frames follow)."""

    num_chunks: int
    offsets: list[int]
    lease_id: int
    chunk_nbytes: int


class ExistsReply(_Msg):
    """Leading named chunks stored for every rank; with `ExistsKeys.each`, per name whether
    it is (empty otherwise)."""

    num_chunks: int
    present: list[bool] = []


class ErrorReply(_Msg):
    code: int
    message: str


Reply = (
    HelloReply
    | Ok
    | LookupReply
    | ReserveReply
    | StoreReply
    | RetrieveReply
    | ErrorReply
    | ExistsReply
)


# -- codec -------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_raw_decoder = msgspec.msgpack.Decoder()


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode_request(header: bytes | memoryview) -> Request:
    """Decode a request header, raising MalformedFrame or UnknownRequest errors."""
    try:
        return _request_decoder.decode(header)
    except msgspec.DecodeError as exc:
        raise _classify(header, exc) from None
    except RecursionError:  # msgpack nested deeper than the interpreter's stack
        raise MalformedFrameError("request header is nested too deeply") from None


def _classify(header: bytes | memoryview, exc: msgspec.DecodeError) -> KVTierError:
    try:
        raw = _raw_decoder.decode(header)
    except (msgspec.DecodeError, RecursionError):
        return MalformedFrameError(f"request header is not valid msgpack: {exc}")
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] not in REQUEST_TAGS:
        return UnknownRequestError(
            f"unknown request type {raw[0][:64]!r}; known: {', '.join(sorted(REQUEST_TAGS))}"
        )
    return MalformedFrameError(f"malformed request: {exc}")


def decode_reply(header: bytes | memoryview) -> Reply:
    return _reply_decoder.decode(header)


def error_reply(exc: KVTierError) -> bytes:
    return encode(ErrorReply(int(exc.code), exc.message))

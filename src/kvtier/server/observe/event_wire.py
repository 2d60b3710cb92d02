"""KV events on the wire, encoded exactly as vLLM encodes them (`vllm/distributed/kv_events.py`,
0.32 and 0.33), so a router decodes kvtier's stream with vLLM's own classes and no adapter.

A message on the PUB socket is three frames: the topic, the sequence number (8 bytes, big-endian)
and a msgpack `KVEventBatch`: an array `[ts, events]`, each event a map tagged `type` with the
class name. The classes here carry vLLM's names, fields, order and defaults (`omit_defaults`:
fields that have a default and hold it are left out; the others are always sent, None
included). 0.33 adds `lookahead_token_ids` to `BlockStored`, with a default: kvtier never sets
it, so the same bytes decode in both. vLLM is not imported: the server does not depend on it.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from kvtier.keys import decompose

__all__ = [
    "END_SEQ",
    "MAX_BATCH_BYTES",
    "MEDIUM_CPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "binds_locally",
    "client_salt",
    "external_hash",
    "published_hash",
    "seq_bytes",
    "split_batches",
    "token_array",
]

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"

#: the sequence frame that ends a replay (vLLM's `ZmqEventPublisher.END_SEQ`)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


#: a block hash on the wire: vLLM's `ExternalBlockHash`
ExternalHash = bytes | int


def external_hash(chunk_hash: bytes, *, as_int: bool) -> ExternalHash:
    """A chunk name as vLLM publishes a block hash (`maybe_convert_block_hash`): by default its
    last 8 bytes as an unsigned big-endian integer, else the bytes themselves."""
    if not as_int:
        return chunk_hash
    return int.from_bytes(chunk_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


def published_hash(chunk_hash: bytes, salt: str, *, as_int: bool) -> ExternalHash:
    """The block hash a chunk is published under: `external_hash` of its name, first mixed
    with the cache salt the client sent (length-prefixed, BLAKE2b) when it has one, so that
    salted and unsalted copies of a prompt (which vLLM hashes apart too) differ."""
    if salt:
        raw = salt.encode("utf-8", "surrogatepass")
        chunk_hash = hashlib.blake2b(len(raw).to_bytes(4, "big") + raw + chunk_hash).digest()
    return external_hash(chunk_hash, as_int=as_int)


_ITEM = np.dtype([("tag", "u1"), ("value", ">u4")])  # a msgpack uint32: 0xce, 4 bytes


def token_array(pieces: Sequence[bytes]) -> msgspec.Raw:
    """The msgpack array of the packed uint32 token ids in `pieces` (joined), built without a
    Python int per token: each id in msgpack's 32-bit unsigned form (5 bytes), which every
    decoder reads as the same integer as its shortest form."""
    ids = np.frombuffer(b"".join(pieces) if len(pieces) != 1 else pieces[0], "<u4")
    n = len(ids)
    head = b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")
    out = bytearray(len(head) + 5 * n)
    out[: len(head)] = head
    items = np.frombuffer(out, _ITEM, offset=len(head))
    items["tag"] = 0xCE
    items["value"] = ids
    return msgspec.Raw(out)


def seq_bytes(seq: int) -> bytes:
    """A sequence number as its frame."""
    return seq.to_bytes(8, "big")


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Chunks that became complete in a tier, in chain order (a chunk is one vLLM block)."""

    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int] | msgspec.Raw  # Raw: `token_array`, as the publisher sends them
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Chunks that left a tier."""

    block_hashes: list[ExternalHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Everything under the topic's model is gone."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message's events."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


#: the largest batch published (more events go in more batches; see `split_batches`)
MAX_BATCH_BYTES = 256 << 10
#: token ids and block hashes in one event at most (a longer chain is several events)
_EVENT_TOKENS = 32 << 10
_EVENT_HASHES = 16 << 10

Event = BlockStored | BlockRemoved | AllBlocksCleared


def _size(event: Event) -> int:
    """About the bytes `event` encodes to."""
    if isinstance(event, BlockStored):
        tokens = event.token_ids
        n = len(tokens) if isinstance(tokens, msgspec.Raw) else 5 * len(tokens)
        return 96 + n + 10 * len(event.block_hashes)
    if isinstance(event, BlockRemoved):
        return 48 + 10 * len(event.block_hashes)
    return 32


def split_batches(events: list[Event], chunk_size: int) -> Iterator[list[Event]]:
    """`events` in batches of at most about MAX_BATCH_BYTES, each event first cut to at most
    `_EVENT_TOKENS` tokens and `_EVENT_HASHES` hashes (a chain cut in two is two events, the
    second's parent the first's last block)."""
    batch: list[Event] = []
    size = 0
    for whole in events:
        for event in _cut(whole, chunk_size):
            n = _size(event)
            if batch and size + n > MAX_BATCH_BYTES:
                yield batch
                batch, size = [], 0
            batch.append(event)
            size += n
    if batch:
        yield batch


def _cut(event: Event, chunk_size: int) -> Iterator[Event]:
    if isinstance(event, BlockRemoved) and len(event.block_hashes) > _EVENT_HASHES:
        hashes = event.block_hashes
        for i in range(0, len(hashes), _EVENT_HASHES):
            yield msgspec.structs.replace(event, block_hashes=hashes[i : i + _EVENT_HASHES])
        return
    if not isinstance(event, BlockStored):
        yield event
        return
    blocks = max(1, min(_EVENT_HASHES, _EVENT_TOKENS // max(1, chunk_size)))
    hashes = event.block_hashes
    if len(hashes) <= blocks:
        yield event
        return
    tokens = event.token_ids
    raw = bytes(tokens) if isinstance(tokens, msgspec.Raw) else b""
    extra = event.extra_keys
    parent = event.parent_block_hash
    for i in range(0, len(hashes), blocks):
        part = hashes[i : i + blocks]
        if raw:
            ids: list[int] | msgspec.Raw = _raw_slice(raw, i * chunk_size, len(part) * chunk_size)
        elif tokens:
            ids = list(tokens[i * chunk_size : (i + len(part)) * chunk_size])
        else:
            ids = []
        yield msgspec.structs.replace(
            event,
            block_hashes=part,
            parent_block_hash=parent,
            token_ids=ids,
            extra_keys=None if extra is None else extra[i : i + len(part)],
        )
        parent = part[-1]


def _raw_slice(raw: bytes, first: int, n: int) -> msgspec.Raw:
    """Tokens [first, first + n) of a `token_array` (a msgpack array of 5-byte uint32s)."""
    head = 3 if raw[0] == 0xDC else 5
    body = raw[head + 5 * first : head + 5 * (first + n)]
    prefix = b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")
    return msgspec.Raw(prefix + body)


def client_salt(cache_salt: str) -> str:
    """The salt the client sent (the part after its tenant), as vLLM publishes a request's."""
    try:
        parts = decompose(cache_salt)
    except ValueError:
        return cache_salt
    return parts[-1] if len(parts) == 2 else cache_salt


def binds_locally(endpoint: str) -> bool:
    """Whether a tcp:// endpoint names a wildcard or loopback host (bound, not connected)."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host in ("*", "", "0.0.0.0", "::", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

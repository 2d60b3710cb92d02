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

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "external_hash",
    "seq_bytes",
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

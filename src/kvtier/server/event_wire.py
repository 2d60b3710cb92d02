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

from typing import Any

import msgspec

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


def seq_bytes(seq: int) -> bytes:
    """A sequence number as its frame."""
    return seq.to_bytes(8, "big")


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Chunks that became complete in a tier, in chain order (a chunk is one vLLM block)."""

    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
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

"""`ChunkRange`: which chunks a store or retrieve moves — one rank's chunks [start, end) of a
request's prompt — as one typed argument.

`Client.store`, `retrieve`, `store_slots` and `retrieve_slots` take it as their first argument;
their keyword form (`client.store("r", tokens, kv, model="m", end=...)`) builds the same range.
An engine adapter builds one per transfer (`dataclasses.replace` changes a field).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

from kvtier.errors import InvalidArgumentError
from kvtier.hashing import TokenIds

__all__ = ["ChunkRange", "range_of"]


@dataclass(frozen=True)
class ChunkRange:
    """One rank's chunks [start, end) of a request's prompt.

    `tokens` are the prompt's tokens up to at least `end`. `end` None: as many chunks as the
    array of a store or retrieve holds (the slot calls need it). `world_size` None: as this
    client registered the model. `cache_salt` and `extra_key` keep caches apart: a chunk
    stored under one is never found under another (a tenant's salt; a LoRA adapter or
    multimodal inputs, as the engine adapter names them).
    """

    request_id: str
    tokens: TokenIds
    _: KW_ONLY
    model: str
    start: int = 0
    end: int | None = None
    worker_id: int = 0
    world_size: int | None = None
    cache_salt: str = ""
    extra_key: bytes = b""


def range_of(request: ChunkRange | str, tokens: Any, short: dict[str, Any]) -> ChunkRange:
    """The range of a call made either way: `request` a ChunkRange (then nothing else names the
    range), or the keyword form's request id, tokens and range keywords (`short`)."""
    if not isinstance(request, ChunkRange):
        return ChunkRange(request, tokens, **short)
    if tokens is not None or short:
        given = ["tokens"] * (tokens is not None) + sorted(short)
        raise InvalidArgumentError(
            f"a call given a ChunkRange takes no {', '.join(given)}: set them on the range"
        )
    return request

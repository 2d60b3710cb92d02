"""Naming a request's chunks: its session's hashes, as ChunkKeys, checked against the range.

Runs without the engine lock: a `Session` guards itself, and the chunk-key cache it keeps is
replaced, never changed in place.
"""

from __future__ import annotations

from kvtier import protocol as p
from kvtier.errors import BadArrayError, InvalidArgumentError, MisalignedRangeError
from kvtier.keys import ChunkKey, with_extra_key
from kvtier.session import Session, SessionManager

__all__ = ["chunk_keys", "range_keys", "session_for"]


def session_for(sessions: SessionManager, request_id: str, tokens: bytes) -> Session:
    """The request's session, holding `tokens` (packed uint32) now."""
    if len(tokens) % 4:
        raise InvalidArgumentError(
            f"tokens must be packed uint32: {len(tokens)} bytes is not a multiple of 4"
        )
    session = sessions.get_or_create(request_id)
    session.set_tokens(tokens)
    return session


def range_keys(sessions: SessionManager, chunk_size: int, req: p.RangeRequest) -> list[ChunkKey]:
    """The names of chunks [start, end) of a store or retrieve, after checking the range."""
    cs = chunk_size
    if req.start % cs or req.end % cs or req.start < 0 or req.start > req.end:
        raise MisalignedRangeError(
            f"token range [{req.start}, {req.end}) must have both ends on multiples of the "
            f"chunk size {cs} with start <= end"
        )
    if req.num_chunks != (req.end - req.start) // cs:
        raise BadArrayError(
            f"the array holds {req.num_chunks} chunks but the range [{req.start}, "
            f"{req.end}) covers {(req.end - req.start) // cs} chunks of {cs} tokens"
        )
    session = session_for(sessions, req.request_id, req.tokens)
    keys = chunk_keys(
        session, req.model, req.cache_salt, req.world_size, req.end, extra_key=req.extra_key
    )
    return keys[req.start // cs :]


def chunk_keys(
    session: Session, model: str, salt: str, world_size: int, end: int, *, extra_key: bytes = b""
) -> list[ChunkKey]:
    """Names of the session's chunks [0, end) under (model, salt, world_size), each hash
    under the request's extra key (`keys.with_extra_key`).

    Kept per session and extended as it grows: a repeated lookup of a long prompt builds no
    new keys. Hashes are chained, so when the last cached key still carries the hash at its
    position, every earlier one does too; otherwise the cache is rebuilt. The cached list is
    replaced, never changed in place, so two threads naming one session at once at worst
    both build the same keys.
    """
    hashes = session.get_hashes(0, end)
    cache: dict[tuple[str, str, int, bytes], list[ChunkKey]] = session.extras.setdefault(
        "chunk_keys", {}
    )
    slot = (model, salt, world_size, extra_key)
    keys = cache.get(slot, [])
    n = len(hashes)
    valid = min(len(keys), n)  # the cached keys agree with these hashes up to here
    if valid and keys[valid - 1].chunk_hash != with_extra_key(hashes[valid - 1], extra_key):
        keys = []
    elif len(keys) >= n:
        return keys[:n]  # a shorter range of a prompt already named: keep the rest cached
    keys = keys + [
        ChunkKey(model, salt, world_size, with_extra_key(h, extra_key)) for h in hashes[len(keys) :]
    ]
    cache[slot] = keys
    return keys

"""Naming a request's chunks: the hashes of its own tokens, as ChunkKeys, checked against the range.

Runs without the engine lock. A chunk's name comes from the exact tokens of the request that
names it: `Session.hashes_for` sets the tokens and hashes them in one hold of the session's
lock, so another request of the same id with another prompt, at the same moment, cannot swap
its tokens in between. The chunk-key cache a session keeps is checked against those hashes
(and replaced, never changed in place), so it never hands out another prompt's names.
"""

from __future__ import annotations

from itertools import repeat

from kvtier import protocol as p
from kvtier.errors import BadArrayError, InvalidArgumentError, MisalignedRangeError
from kvtier.keys import ChunkKey, with_extra_key
from kvtier.session import Session, SessionManager

__all__ = ["chunk_keys", "range_keys", "session_hashes"]

_CACHE = "chunk_keys"  # the session extra that holds its chunk-key cache
_new = tuple.__new__


def session_hashes(
    sessions: SessionManager, request_id: str, tokens: bytes, end: int | None = None
) -> tuple[Session, list[bytes]]:
    """The request's session, holding `tokens` (packed uint32) now, and the hashes of chunks
    [0, end) of exactly these tokens (`end=None`: every full chunk)."""
    if len(tokens) % 4:
        raise InvalidArgumentError(
            f"tokens must be packed uint32: {len(tokens)} bytes is not a multiple of 4"
        )
    session = sessions.get_or_create(request_id)
    return session, session.hashes_for(tokens, end)


def range_keys(
    sessions: SessionManager, chunk_size: int, req: p.RangeRequest
) -> tuple[Session, list[ChunkKey], bytes | None]:
    """The session, the names of chunks [start, end) of a store or retrieve, after checking
    the range, and the name of the chunk before them (None when they start the prompt)."""
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
    session, hashes = session_hashes(sessions, req.request_id, req.tokens, req.end)
    keys = chunk_keys(
        session, hashes, req.model, req.cache_salt, req.world_size, extra_key=req.extra_key
    )
    first = req.start // cs
    return session, keys[first:], keys[first - 1].chunk_hash if first else None


def chunk_keys(
    session: Session,
    hashes: list[bytes],
    model: str,
    salt: str,
    world_size: int,
    *,
    extra_key: bytes = b"",
) -> list[ChunkKey]:
    """Names of the chunks whose hashes are `hashes` (a request's own, from `session_hashes`)
    under (model, salt, world_size), each hash under the request's extra key
    (`keys.with_extra_key`).

    Kept per session and extended as it grows: a repeated lookup of a long prompt builds no
    new keys. Each cache entry holds the hashes its keys were built from, and is used only as
    far as they agree with `hashes`, the caller's own: hashes are chained (each covers every
    token before it), so where the two agree at the last position they share, they agree at
    every earlier one (the guarantee chunk names rest on anyway), and otherwise the keys are
    rebuilt. Entries are replaced, never changed in place, so two threads naming one session
    at once, even with two prompts, each get the names of their own hashes.
    """
    cache: dict[tuple[str, str, int, bytes], tuple[list[bytes], list[ChunkKey]]] = (
        session.extras.setdefault(_CACHE, {})
    )
    slot = (model, salt, world_size, extra_key)
    n = len(hashes)
    built, keys = cache.get(slot, ([], []))
    m = min(len(built), n)
    if m and built[m - 1] != hashes[m - 1]:
        m = 0  # another prompt's names: rebuild
    elif len(built) >= n:
        return keys if len(keys) == n else keys[:n]  # a shorter range of a prompt named
    named = hashes[m:]
    if extra_key:
        named = [with_extra_key(h, extra_key) for h in named]
    # tuple.__new__ over a zip builds the keys without a Python call per key (a NamedTuple's
    # `_make` is one): half the cost of `_make`, a quarter of ChunkKey(...) each, for every
    # chunk of a new prompt
    fields = zip(repeat(model), repeat(salt), repeat(world_size), named)
    keys = (keys if m == len(keys) else keys[:m]) + list(map(_new, repeat(ChunkKey), fields))
    cache[slot] = (hashes, keys)
    return keys

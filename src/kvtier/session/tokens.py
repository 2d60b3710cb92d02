"""A session's tokens as packed little-endian uint32: packing (checked) and comparing."""

from __future__ import annotations

import array
import sys

import numpy as np

from kvtier.hashing import TokenIds, token_bytes

TOKEN_BYTES = 4  # tokens are held as packed little-endian uint32


def pack_list(tokens: list[int]) -> array.array[int] | bytes | memoryview:
    """Python ints as packed little-endian uint32, checked: array('I').fromlist converts a short
    list several times faster than numpy; anything it refuses goes through token_bytes, which
    raises kvtier's error naming the bad value."""
    if _NATIVE_U32:
        packed = array.array("I")
        try:
            packed.fromlist(tokens)
            return packed
        except (OverflowError, TypeError):
            pass
    return token_bytes(tokens)


_NATIVE_U32 = sys.byteorder == "little" and array.array("I").itemsize == TOKEN_BYTES


def pack_bytes(token_ids: TokenIds) -> bytes:
    """The tokens packed as immutable bytes (a copy of a mutable buffer: the caller may reuse
    it); raises kvtier's error naming a bad value."""
    new = token_bytes(token_ids)
    return new if isinstance(new, bytes) else bytes(new)


def common_prefix_tokens(a: bytes | bytearray, b: bytes, limit: int) -> int:
    """Length, in tokens, of the common prefix of two packed token buffers within `limit` bytes."""
    count = min(limit, len(a), len(b)) // TOKEN_BYTES
    x = np.frombuffer(a, dtype="<u4", count=count)
    y = np.frombuffer(b, dtype="<u4", count=count)
    differs = x != y
    return int(np.argmax(differs)) if differs.any() else count

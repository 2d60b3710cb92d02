"""Key-addressed chunks: chunks the caller names itself (SGLang's page hashes) instead of tokens.

A caller's name is bytes (a str is taken as its UTF-8 bytes). The stored chunk hash is derived
from the name with BLAKE3 in key-derivation mode under a context of its own, so a named chunk can
never alias a token-addressed chunk (whose hash comes from `TokenHasher`), whatever the hash
algorithm. The derived hash then goes into the usual `ChunkKey` with model, salt and world size,
so L1, pins, leases, eviction, integrity checks and every L2 tier treat both kinds alike.

The bounds exist so one request can neither hold the server's lock for long nor grow its
memory without limit; client and server check them both (the client to fail early, the server
because a client may be anything).
"""

from __future__ import annotations

from collections.abc import Sequence

from blake3 import blake3

from kvtier.errors import InvalidArgumentError
from kvtier.keys import ChunkKey, with_extra_key

__all__ = [
    "MAX_NAMES",
    "MAX_NAME_BYTES",
    "ChunkName",
    "as_name",
    "check_names",
    "name_hash",
    "named_chunk_keys",
]

#: longest accepted chunk name, in bytes (SGLang's page keys are 64 hex characters)
MAX_NAME_BYTES = 1024
#: most names in one request (SGLang sends at most 128 pages per storage call)
MAX_NAMES = 4096

#: what a caller may pass as a name
ChunkName = bytes | str

_CONTEXT = "kvtier 2026-12 key-addressed chunk name v1"


def as_name(name: object) -> bytes:
    """One caller-supplied name as bytes; raises InvalidArgumentError for anything else."""
    if isinstance(name, str):
        raw = name.encode()
    elif isinstance(name, bytes | bytearray | memoryview):
        raw = bytes(name)
    else:
        raise InvalidArgumentError(f"a chunk name must be bytes or str, got {type(name).__name__}")
    if not raw:
        raise InvalidArgumentError("a chunk name must not be empty")
    if len(raw) > MAX_NAME_BYTES:
        raise InvalidArgumentError(
            f"chunk name of {len(raw)} bytes ({raw[:32]!r}...) is longer than the limit of "
            f"{MAX_NAME_BYTES} bytes (kvtier.names.MAX_NAME_BYTES): hash long names first"
        )
    return raw


def check_names(names: Sequence[object]) -> list[bytes]:
    """Validate a request's names (type, length, count); returns them as bytes."""
    if isinstance(names, str | bytes):
        raise InvalidArgumentError(
            "names must be a sequence of names, not one str or bytes: wrap it in a list"
        )
    if len(names) > MAX_NAMES:
        raise InvalidArgumentError(
            f"{len(names)} names in one request exceed the limit of {MAX_NAMES} "
            "(kvtier.names.MAX_NAMES): split the batch"
        )
    return [as_name(n) for n in names]


def name_hash(name: bytes) -> bytes:
    """The chunk hash a named chunk is stored under: 32 bytes, disjoint from token hashes."""
    return blake3(name, derive_key_context=_CONTEXT).digest()


def named_chunk_keys(
    names: Sequence[object],
    *,
    model: str,
    cache_salt: str,
    world_size: int,
    extra_key: bytes = b"",
) -> list[ChunkKey]:
    """The `ChunkKey`s of named chunks under (model, salt, world_size) and the request's extra
    key (`keys.with_extra_key`), names validated."""
    if world_size < 1:
        raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
    return [
        ChunkKey(model, cache_salt, world_size, with_extra_key(name_hash(n), extra_key))
        for n in check_names(names)
    ]

"""kvtier.names: validation of caller-supplied chunk names and their own hash namespace."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import InvalidArgumentError
from kvtier.hashing import HASH_ALGORITHMS, TokenHasher
from kvtier.keys import ChunkKey
from kvtier.names import (
    MAX_NAME_BYTES,
    MAX_NAMES,
    as_name,
    check_names,
    name_hash,
    named_chunk_keys,
)


def test_str_names_are_their_utf8_bytes() -> None:
    assert as_name("päge") == "päge".encode()
    assert as_name(b"page") == b"page"
    assert as_name(bytearray(b"page")) == b"page"
    assert check_names(["a", b"b"]) == [b"a", b"b"]


@pytest.mark.parametrize(
    ("names", "match"),
    [
        ([""], "empty"),
        ([b""], "empty"),
        (["x" * (MAX_NAME_BYTES + 1)], str(MAX_NAME_BYTES)),
        ([1], "bytes or str"),
        ([None], "bytes or str"),
        ("abc", "sequence"),
        (b"abc", "sequence"),
        (["n"] * (MAX_NAMES + 1), str(MAX_NAMES)),
    ],
)
def test_bad_names_are_refused_with_the_limit(names: object, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        check_names(names)  # type: ignore[arg-type]


def test_the_limits_themselves_are_accepted() -> None:
    assert len(check_names(["x" * MAX_NAME_BYTES])[0]) == MAX_NAME_BYTES
    assert len(check_names(["n"] * MAX_NAMES)) == MAX_NAMES


def test_name_hashes_are_fixed_across_processes_and_releases() -> None:
    # a changed derivation would orphan every named chunk already in L2
    assert name_hash(b"page-0").hex() == (
        "f838638468b3b41dc409d74070dcb2b6c81abc2f0d131c75b23ce1cfa304b3e5"
    )


@given(st.binary(min_size=1, max_size=64), st.binary(min_size=1, max_size=64))
def test_distinct_names_get_distinct_hashes(a: bytes, b: bytes) -> None:
    assert (name_hash(a) == name_hash(b)) == (a == b)


@pytest.mark.parametrize("algorithm", sorted(HASH_ALGORITHMS))
def test_a_name_never_equals_a_token_chunk_hash(algorithm: str) -> None:
    seed = 0 if algorithm == "sha256_cbor" else None
    hasher = TokenHasher(4, algorithm, seed=seed)
    token_hashes = [bytes(h) for h in hasher.compute_chunk_hashes(list(range(64)))]
    # not even when the caller names a chunk by a token chunk's hash
    assert not {name_hash(h) for h in token_hashes} & set(token_hashes)


def test_named_chunk_keys_carry_model_salt_and_world_size() -> None:
    keys = named_chunk_keys(["p0", "p1"], model="m", cache_salt="s", world_size=2)
    assert keys == [
        ChunkKey("m", "s", 2, name_hash(b"p0")),
        ChunkKey("m", "s", 2, name_hash(b"p1")),
    ]
    with pytest.raises(InvalidArgumentError, match="world_size"):
        named_chunk_keys(["p0"], model="m", cache_salt="", world_size=0)

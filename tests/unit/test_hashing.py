"""Tests for kvtier.hashing: the chain definition, encodings, contracts and vLLM compatibility."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import cbor2
import numpy as np
import pytest
import xxhash
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import hashing
from kvtier.hashing import (
    HASH_ALGORITHMS,
    TokenHasher,
    as_token_array,
    token_bytes,
)

ALGORITHMS = sorted(HASH_ALGORITHMS)
SEED_FOR = {"sha256_cbor": "0"}  # the one algorithm that refuses seed=None

token_id = st.integers(min_value=0, max_value=2**32 - 1)
token_lists = st.lists(token_id, max_size=40)
small_chunk = st.integers(min_value=1, max_value=8)
algorithm = st.sampled_from(ALGORITHMS)


def make(chunk_size: int, name: str, **kwargs: object) -> TokenHasher:
    kwargs.setdefault("seed", SEED_FOR.get(name))
    return TokenHasher(chunk_size, name, **kwargs)  # type: ignore[arg-type]


def reference_chain(name: str, parent: bytes, tokens: list[int], chunk_size: int) -> list[bytes]:
    """The chain written out from the definitions, without the module's fast paths."""
    out = []
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + chunk_size])
        if name == "blake3":
            parent = blake3(parent + data).digest()
        elif name == "xxh3_128":
            parent = xxhash.xxh3_128(parent + data).digest()
        elif name == "sha256":
            parent = hashlib.sha256(parent + data).digest()
        else:
            chunk = tuple(tokens[start : start + chunk_size])
            parent = hashlib.sha256(cbor2.dumps((parent, chunk, None), canonical=True)).digest()
        out.append(parent)
    return out


# --- the chain -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(name=algorithm, chunk_size=small_chunk, tokens=token_lists)
def test_chain_matches_definition(name: str, chunk_size: int, tokens: list[int]) -> None:
    hasher = make(chunk_size, name)
    expected = reference_chain(name, hasher.none_hash, tokens, chunk_size)
    assert hasher.compute_chunk_hashes(tokens) == expected
    assert all(len(h) == hasher.digest_size for h in expected)


@settings(max_examples=60, deadline=None)
@given(name=algorithm, chunk_size=small_chunk, tokens=token_lists)
def test_full_chunk_only(name: str, chunk_size: int, tokens: list[int]) -> None:
    hasher = make(chunk_size, name)
    full = hasher.compute_chunk_hashes(tokens)
    with_partial = hasher.compute_chunk_hashes(tokens, full_chunk_only=False)
    assert len(full) == len(tokens) // chunk_size
    assert with_partial[: len(full)] == full
    rest = len(tokens) % chunk_size
    if rest:
        assert len(with_partial) == len(full) + 1
        parent = full[-1] if full else None
        assert with_partial[-1] == hasher.hash_tokens(tokens[-rest:], prefix_hash=parent)
    else:
        assert with_partial == full


@settings(max_examples=60, deadline=None)
@given(name=algorithm, chunk_size=small_chunk, tokens=token_lists, data=st.data())
def test_prefix_continuation_equals_from_scratch(
    name: str, chunk_size: int, tokens: list[int], data: st.DataObject
) -> None:
    hasher = make(chunk_size, name)
    k = data.draw(st.integers(min_value=0, max_value=len(tokens) // chunk_size), label="k")
    split = k * chunk_size
    head = hasher.compute_chunk_hashes(tokens[:split])
    tail = hasher.compute_chunk_hashes(tokens[split:], prefix_hash=head[-1] if head else None)
    assert head + tail == hasher.compute_chunk_hashes(tokens)


def test_hash_tokens_is_one_link_of_the_chain() -> None:
    hasher = TokenHasher(4)
    tokens = list(range(12))
    hashes = hasher.compute_chunk_hashes(tokens)
    assert hasher.hash_tokens(tokens[:4]) == hashes[0]
    assert hasher.hash_tokens(tokens[4:8], prefix_hash=hashes[0]) == hashes[1]
    assert hasher.hash_tokens(tokens[4:8]) != hashes[1]  # the parent matters
    assert hasher.hash_tokens([]) == blake3(hasher.none_hash).digest()


def test_changing_any_earlier_token_changes_every_later_name() -> None:
    hasher = TokenHasher(4)
    tokens = list(range(16))
    base = hasher.compute_chunk_hashes(tokens)
    tokens[1] = 999
    changed = hasher.compute_chunk_hashes(tokens)
    assert all(a != b for a, b in zip(base, changed, strict=True))


def test_empty_input_and_bad_prefix_hash() -> None:
    hasher = TokenHasher(4)
    assert hasher.compute_chunk_hashes([]) == []
    assert hasher.compute_chunk_hashes(b"", full_chunk_only=False) == []
    assert hasher.compute_chunk_hashes([1, 2, 3, 4], prefix_hash=b"") == (
        hasher.compute_chunk_hashes([1, 2, 3, 4])
    )
    with pytest.raises(ValueError, match="prefix_hash is 8 bytes"):
        hasher.compute_chunk_hashes([1, 2, 3, 4], prefix_hash=b"\x00" * 8)
    with pytest.raises(TypeError, match="prefix_hash"):
        hasher.compute_chunk_hashes([1, 2, 3, 4], prefix_hash=5)  # type: ignore[arg-type]


# --- token encodings -----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    name=algorithm,
    chunk_size=small_chunk,
    tokens=token_lists,
    dtype=st.sampled_from(["<u4", ">u4", "<i8", "<u8", "<i4"]),
    signed_bytes=st.booleans(),
)
def test_encodings_agree(
    name: str, chunk_size: int, tokens: list[int], dtype: str, signed_bytes: bool
) -> None:
    if dtype == "<i4":  # int32 holds only ids below 2**31
        tokens = [t % 2**31 for t in tokens]
    hasher = make(chunk_size, name)
    expected = hasher.compute_chunk_hashes(tokens, full_chunk_only=False)
    array = np.array(tokens, dtype=dtype)
    # packed int32 of ids >= 2**31 is the same 4 bytes as their uint32: bytes read as uint32
    packed_dtype = "<i4" if signed_bytes else "<u4"
    packed = np.array(tokens, dtype="<u4").view(packed_dtype).tobytes()
    for form in (array, packed, bytearray(packed), memoryview(packed), tuple(tokens)):
        assert hasher.compute_chunk_hashes(form, full_chunk_only=False) == expected
    assert as_token_array(array).tolist() == tokens
    assert bytes(token_bytes(tokens)) == packed


def test_small_and_strided_arrays() -> None:
    hasher = TokenHasher(2)
    tokens = [1, 2, 250, 7]
    expected = hasher.compute_chunk_hashes(tokens)
    for dtype in (np.uint8, np.int16, np.uint16, np.int32):
        assert hasher.compute_chunk_hashes(np.array(tokens, dtype=dtype)) == expected
    strided = np.array([1, 0, 2, 0, 250, 0, 7, 0], dtype=np.int64)[::2]
    assert hasher.compute_chunk_hashes(strided) == expected
    assert hasher.compute_chunk_hashes(iter(tokens)) == expected


def test_token_bytes_and_array_are_zero_copy() -> None:
    packed = np.arange(8, dtype="<u4").tobytes()
    assert token_bytes(packed) is packed
    array = as_token_array(packed)
    assert array.dtype == np.dtype("<u4") and array.ndim == 1
    assert np.shares_memory(array, np.frombuffer(packed, np.uint8))
    source = np.arange(8, dtype="<u4")
    assert as_token_array(source) is source
    assert np.shares_memory(np.frombuffer(token_bytes(source), np.uint8), source)


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        ([1, -1], "token id -1 at position 1"),
        ([0, 0, 2**32], "token id 4294967296 at position 2"),
        ([5, 2**64 + 3], "token id 18446744073709551619 at position 1"),
        (np.array([3, -7], dtype=np.int64), "token id -7 at position 1"),
        (np.array([-1], dtype=np.int8), "token id -1 at position 0"),
        (np.array([1, 2**40], dtype=np.uint64), "token id 1099511627776 at position 1"),
    ],
)
def test_out_of_range_ids_raise(bad: object, where: str) -> None:
    with pytest.raises(ValueError, match=where):
        TokenHasher(2).compute_chunk_hashes(bad)  # type: ignore[arg-type]


def test_out_of_range_id_from_an_iterator_is_located() -> None:
    with pytest.raises(ValueError, match="token id -1 at position 2"):
        TokenHasher(2).compute_chunk_hashes(iter([0, 1, -1]))


def test_portable_list_path_matches_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The int64 route used where array('I') is not little-endian uint32 gives the same ids."""
    tokens = [0, 5, 2**32 - 1, 2**31]
    native = as_token_array(tokens)
    monkeypatch.setattr(hashing, "_NATIVE_U4", False)
    assert as_token_array(tokens).tolist() == native.tolist() == tokens
    with pytest.raises(ValueError, match="token id 4294967296 at position 1"):
        as_token_array([0, 2**32])
    with pytest.raises(TypeError, match="float"):
        as_token_array([0, 1.5])  # type: ignore[list-item]


@pytest.mark.parametrize("bad", [[1, 2.5], ["3"], np.array([1.0, 2.0]), "abc"])
def test_non_integer_tokens_raise(bad: object) -> None:
    with pytest.raises(TypeError):
        TokenHasher(2).compute_chunk_hashes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [1, 2, 3, 5, 7])
def test_odd_byte_lengths_raise(length: int) -> None:
    for form in (b"\x01" * length, bytearray(length), memoryview(b"\x02" * length)):
        with pytest.raises(ValueError, match=f"length {length}, not a multiple of 4"):
            TokenHasher(2).compute_chunk_hashes(form)
        with pytest.raises(ValueError, match="multiple of 4"):
            as_token_array(form)


def test_two_dimensional_array_raises() -> None:
    with pytest.raises(ValueError, match="1-D"):
        TokenHasher(2).compute_chunk_hashes(np.zeros((2, 2), dtype=np.uint32))


# --- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 2.0, "256", True, None])
def test_chunk_size_must_be_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        TokenHasher(bad)  # type: ignore[arg-type]


def test_unknown_algorithm_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown hash_algorithm 'md5'") as info:
        TokenHasher(hash_algorithm="md5")
    for name in ALGORITHMS:
        assert name in str(info.value)


def test_attributes() -> None:
    hasher = TokenHasher(16, "xxh3_128", seed=7)
    assert (hasher.chunk_size, hasher.hash_algorithm, hasher.seed) == (16, "xxh3_128", 7)
    assert hasher.digest_size == len(hasher.none_hash) == 16
    assert TokenHasher().chunk_size == 256 and TokenHasher().hash_algorithm == "blake3"
    assert {n: HASH_ALGORITHMS[n].digest_size for n in ALGORITHMS} == {
        "blake3": 32,
        "sha256": 32,
        "sha256_cbor": 32,
        "xxh3_128": 16,
    }


def test_none_hash_is_deterministic_and_depends_on_every_setting() -> None:
    assert TokenHasher().none_hash == TokenHasher().none_hash
    variants = [
        TokenHasher(),
        TokenHasher(128),
        TokenHasher(seed=1),
        TokenHasher(seed="x"),
        TokenHasher(hash_algorithm="sha256"),
    ]
    assert len({h.none_hash for h in variants}) == len(variants)
    # an int seed is its PYTHONHASHSEED text
    assert TokenHasher(seed=42).none_hash == TokenHasher(seed="42").none_hash
    assert TokenHasher(seed=42).none_hash == TokenHasher(seed=b"42").none_hash


def test_bad_seed_type() -> None:
    with pytest.raises(TypeError, match="seed"):
        TokenHasher(seed=1.5)  # type: ignore[arg-type]


def test_hash_to_bytes() -> None:
    assert TokenHasher.hash_to_bytes(-1) == b"\xff" * 8
    assert TokenHasher.hash_to_bytes(0) == b"\x00" * 8
    assert TokenHasher.hash_to_bytes(1) == b"\x00" * 7 + b"\x01"
    assert TokenHasher.hash_to_bytes(2**63 - 1) == b"\x7f" + b"\xff" * 7
    assert TokenHasher.hash_to_bytes(-(2**63)) == b"\x80" + b"\x00" * 7
    digest = bytes(range(32))
    assert TokenHasher.hash_to_bytes(digest) is digest
    assert TokenHasher.hash_to_bytes(bytearray(b"ab")) == b"ab"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="signed 64-bit"):
        TokenHasher.hash_to_bytes(2**63)
    with pytest.raises(TypeError):
        TokenHasher.hash_to_bytes("ab")  # type: ignore[arg-type]


# --- contract ------------------------------------------------------------------------------


def test_contract_equal_for_equal_settings() -> None:
    a, b = TokenHasher(64, "sha256", seed="s"), TokenHasher(64, "sha256", seed="s")
    assert a.contract() == b.contract()
    assert len(a.contract()) == 16 and int(a.contract(), 16) >= 0
    assert a.contract_info() == {
        "hash_algorithm": "sha256",
        "chunk_size": 64,
        "seed": "'s'",
        "token_encoding": "uint32-le",
    }
    assert TokenHasher().contract_info()["seed"] == ""


@pytest.mark.parametrize(
    "other",
    [
        {"chunk_size": 128},
        {"chunk_size": 100_000},
        {"hash_algorithm": "xxh3_128"},
        {"hash_algorithm": "sha256"},
        {"seed": 1},
        {"seed": ""},
    ],
)
def test_contract_differs_when_any_setting_differs(other: dict[str, object]) -> None:
    base = {"chunk_size": 256, "hash_algorithm": "blake3", "seed": None}
    changed = TokenHasher(**{**base, **other})  # type: ignore[arg-type]
    assert changed.contract() != TokenHasher(**base).contract()  # type: ignore[arg-type]
    differing = {
        k for k, v in changed.contract_info().items() if TokenHasher().contract_info()[k] != v
    }
    assert differing == {next(iter(other))}


def test_sha256_cbor_contract_covers_chunk_size() -> None:
    # vLLM's NONE_HASH ignores the block size; the contract must not.
    small = TokenHasher(100_000, "sha256_cbor", seed="0")
    large = TokenHasher(200_000, "sha256_cbor", seed="0")
    assert small.none_hash == large.none_hash
    assert small.contract() != large.contract()
    assert small.contract() != TokenHasher(100_000, "sha256_cbor", seed="1").contract()


# --- vLLM compatibility --------------------------------------------------------------------


def vllm_block_hashes(token_ids: list[int], block_size: int, pythonhashseed: str) -> list[bytes]:
    """vLLM v1's prefix-cache block hashes for sha256_cbor, written from its formula.

    NONE_HASH = sha256_cbor(os.getenv("PYTHONHASHSEED")) (kv_cache_utils.init_none_hash);
    block hash = sha256_cbor((parent_hash_bytes, tuple(block_token_ids), extra_keys=None)).
    """

    def sha256_cbor(obj: object) -> bytes:
        return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

    parent = sha256_cbor(pythonhashseed)
    hashes = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = sha256_cbor((parent, tuple(token_ids[start : start + block_size]), None))
        hashes.append(parent)
    return hashes


def test_sha256_cbor_reproduces_vllm_block_hashes() -> None:
    tokens = [(i * 7919 + 3) % 151_000 for i in range(3 * 16 + 5)]
    tokens[5] = 2**32 - 1
    expected = vllm_block_hashes(tokens, 16, "12345")
    assert len(expected) == 3
    hasher = TokenHasher(16, "sha256_cbor", seed="12345")
    assert hasher.compute_chunk_hashes(tokens) == expected
    assert hasher.compute_chunk_hashes(np.array(tokens, dtype="<u4").tobytes()) == expected
    # an int seed means the same PYTHONHASHSEED string
    assert TokenHasher(16, "sha256_cbor", seed=12345).compute_chunk_hashes(tokens) == expected


def test_sha256_cbor_regression_value() -> None:
    hasher = TokenHasher(4, "sha256_cbor", seed="0")
    assert hasher.compute_chunk_hashes(list(range(12)))[-1].hex() == (
        "1b7047f472ffe29f9649139ce64bf3c05228f5a99bb7792568bb68f2d7410c30"
    )


def test_sha256_cbor_requires_seed() -> None:
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        TokenHasher(hash_algorithm="sha256_cbor")
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        TokenHasher(hash_algorithm="sha256_cbor", seed=b"\xff")


# --- determinism across processes --------------------------------------------------------

REGRESSION = {
    "blake3": "8947f50e508a5fc4ef17cff7beeb49c337caf7d7ec795e5859ba9edf8a8c1b3b",
    "xxh3_128": "518dfeeb93a1694b2afbd99c60948528",
    "sha256": "d87b612d620b64e54c4907b0e9130cc605ea45be8000a301b4c55c41163cb3d5",
    "sha256_cbor": "1b7047f472ffe29f9649139ce64bf3c05228f5a99bb7792568bb68f2d7410c30",
}

_PRINT_HASHES = """
import json
from kvtier.hashing import HASH_ALGORITHMS, TokenHasher
seeds = {"sha256_cbor": "0"}
print(json.dumps({
    name: [h.hex() for h in TokenHasher(4, name, seed=seeds.get(name)).compute_chunk_hashes(
        list(range(12)))]
    for name in sorted(HASH_ALGORITHMS)
}))
"""


def test_hashes_are_pinned_and_identical_in_fresh_processes() -> None:
    here = {
        name: [h.hex() for h in make(4, name).compute_chunk_hashes(list(range(12)))]
        for name in ALGORITHMS
    }
    assert {name: hashes[-1] for name, hashes in here.items()} == REGRESSION
    src = str(Path(kvtier.__file__).resolve().parents[1])
    for python_hash_seed in ("random", "1", "2"):
        env = {**os.environ, "PYTHONPATH": src, "PYTHONHASHSEED": python_hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", _PRINT_HASHES],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert json.loads(done.stdout) == here

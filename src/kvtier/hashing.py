"""Chunk naming: token ids cut into fixed-size chunks, each named by a prefix-chained hash.

h_i = H(h_{i-1}, tokens of chunk i) with h_{-1} = `none_hash`, so a chunk's name stands for the
chunk and every token before it. Tokens are hashed in one canonical form, packed little-endian
uint32, so a list, a numpy array and packed bytes of the same ids get the same names.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NewType, TypeAlias

import cbor2
import numpy as np
import numpy.typing as npt
import xxhash
from blake3 import blake3

ChunkHash = NewType("ChunkHash", bytes)

TokenIds: TypeAlias = bytes | bytearray | memoryview | npt.NDArray[np.integer[Any]] | Iterable[int]
Seed: TypeAlias = int | str | bytes | None

TOKEN_ENCODING = "uint32-le"
TOKEN_DTYPE = np.dtype("<u4")
MAX_TOKEN_ID = 2**32 - 1
_TOKEN_WIDTH = 4
_NATIVE_U4 = sys.byteorder == "little" and array.array("I").itemsize == _TOKEN_WIDTH

_NONE_HASH_DOMAIN = b"kvtier-none-hash\x00"
_CONTRACT_DOMAIN = b"kvtier-contract-v1\x00"
# Fixed forever: changing it changes every contract. 515 = 2 * 256 + 3, so with the default chunk
# size the probe covers two full chunks and a partial one; ids above 2**31 catch signedness bugs.
_CONTRACT_PROBE = np.array([(i * 2654435761 + 12345) % 2**32 for i in range(515)], TOKEN_DTYPE)

# (parent hash, packed '<u4' token bytes) -> digest of one chunk.
HashOne: TypeAlias = Callable[[bytes, bytes | memoryview], bytes]
# (h_{-1}, packed tokens whose length is a multiple of step, step in bytes) -> one hash per chunk.
Chain: TypeAlias = Callable[[bytes, memoryview, int], list[bytes]]
# (canonical seed bytes or None, algorithm name, chunk size) -> h_{-1}.
NoneHash: TypeAlias = Callable[[bytes | None, str, int], bytes]


@dataclass(frozen=True, slots=True)
class HashAlgorithm:
    """One entry of `HASH_ALGORITHMS`: how an algorithm hashes one chunk, a chain, and h_{-1}."""

    name: str
    digest_size: int
    hash_one: HashOne
    chain: Chain
    none_hash: NoneHash
    requires_seed: bool = False
    summary: str = ""  # one line for `kvtier serve --help`


def _blake3_one(parent: bytes, data: bytes | memoryview) -> bytes:
    h = blake3(parent)
    h.update(data)
    return bytes(h.digest())


def _blake3_chain(parent: bytes, buf: memoryview, step: int) -> list[bytes]:
    # One hasher fed parent then slice and reset per chunk measured fastest: no 1 KiB copy for
    # parent + slice, and no new hasher object per chunk.
    out: list[bytes] = []
    append = out.append
    h = blake3()
    update, digest, reset = h.update, h.digest, h.reset
    for start in range(0, len(buf), step):
        update(parent)
        update(buf[start : start + step])
        parent = digest()
        reset()
        append(parent)
    return out


def _xxh3_one(parent: bytes, data: bytes | memoryview) -> bytes:
    return bytes(xxhash.xxh3_128_digest(parent + data))


def _xxh3_chain(parent: bytes, buf: memoryview, step: int) -> list[bytes]:
    # One call over parent + slice measured ~2x faster than an incremental xxh3_128 object.
    out: list[bytes] = []
    append = out.append
    digest = xxhash.xxh3_128_digest
    for start in range(0, len(buf), step):
        parent = digest(parent + buf[start : start + step])
        append(parent)
    return out


def _sha256_one(parent: bytes, data: bytes | memoryview) -> bytes:
    h = hashlib.sha256(parent)
    h.update(data)
    return h.digest()


def _sha256_chain(parent: bytes, buf: memoryview, step: int) -> list[bytes]:
    out: list[bytes] = []
    append = out.append
    new = hashlib.sha256
    for start in range(0, len(buf), step):
        h = new(parent)
        h.update(buf[start : start + step])
        parent = h.digest()
        append(parent)
    return out


def _kvtier_none_hash(hash_one: HashOne) -> NoneHash:
    """h_{-1} = H(domain, algorithm, chunk size, seed): deterministic, distinct per setting."""

    def none_hash(seed: bytes | None, name: str, chunk_size: int) -> bytes:
        seed_field = b"\x00" if seed is None else b"\x01" + len(seed).to_bytes(8, "little") + seed
        payload = (
            _NONE_HASH_DOMAIN
            + name.encode()
            + b"\x00"
            + chunk_size.to_bytes(8, "little")
            + seed_field
        )
        return hash_one(b"", payload)

    return none_hash


def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _sha256_cbor_one(parent: bytes, data: bytes | memoryview) -> bytes:
    """vLLM v1's block hash (vllm/v1/core/kv_cache_utils.py `hash_block_tokens`, no extra keys).

    sha256 over canonical CBOR of (parent hash bytes, tuple of int token ids, None).
    """
    tokens = tuple(np.frombuffer(data, TOKEN_DTYPE).tolist())
    return _sha256_cbor((parent, tokens, None))


def _sha256_cbor_chain(parent: bytes, buf: memoryview, step: int) -> list[bytes]:
    ids: list[int] = np.frombuffer(buf, TOKEN_DTYPE).tolist()
    n = step // _TOKEN_WIDTH
    out: list[bytes] = []
    for start in range(0, len(ids), n):
        parent = _sha256_cbor((parent, tuple(ids[start : start + n]), None))
        out.append(parent)
    return out


def _sha256_cbor_none_hash(seed: bytes | None, name: str, chunk_size: int) -> bytes:
    """vLLM's NONE_HASH: sha256_cbor of the PYTHONHASHSEED *string*; chunk size plays no part.

    Mirrors vllm/v1/core/kv_cache_utils.py `init_none_hash` (NONE_HASH = hash_fn(hash_seed),
    hash_seed = os.getenv("PYTHONHASHSEED")), with hash_fn = vllm/utils/hashing.py `sha256_cbor`.
    """
    assert seed is not None, "TokenHasher refuses sha256_cbor without a seed"
    try:
        seed_text = seed.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(
            f"seed={seed!r} is not valid for hash_algorithm={name!r}: vLLM reads its seed from"
            " the PYTHONHASHSEED environment variable, so it must be text"
        ) from None
    return _sha256_cbor(seed_text)


HASH_ALGORITHMS: Mapping[str, HashAlgorithm] = MappingProxyType(
    {
        "blake3": HashAlgorithm(
            "blake3",
            32,
            _blake3_one,
            _blake3_chain,
            _kvtier_none_hash(_blake3_one),
            summary="fast, cryptographic (the default)",
        ),
        "xxh3_128": HashAlgorithm(
            "xxh3_128",
            16,
            _xxh3_one,
            _xxh3_chain,
            _kvtier_none_hash(_xxh3_one),
            summary="fastest, not cryptographic",
        ),
        "sha256": HashAlgorithm(
            "sha256",
            32,
            _sha256_one,
            _sha256_chain,
            _kvtier_none_hash(_sha256_one),
            summary="cryptographic, everywhere available",
        ),
        "sha256_cbor": HashAlgorithm(
            "sha256_cbor",
            32,
            _sha256_cbor_one,
            _sha256_cbor_chain,
            _sha256_cbor_none_hash,
            requires_seed=True,
            summary="vLLM's prefix-cache block hashes; needs the seed",
        ),
    }
)


def _buffer_view(tokens: bytes | bytearray | memoryview) -> memoryview:
    """A flat byte view of packed tokens; its length must be a whole number of uint32s."""
    view = memoryview(tokens)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise ValueError("packed token bytes must be a C-contiguous buffer")
        view = view.cast("B")
    if len(view) % _TOKEN_WIDTH:
        raise ValueError(
            f"packed token bytes have length {len(view)}, not a multiple of {_TOKEN_WIDTH}"
            " (tokens are little-endian uint32)"
        )
    return view


def _out_of_range(values: npt.NDArray[Any]) -> ValueError:
    bad = np.flatnonzero((values < 0) | (values > MAX_TOKEN_ID))
    assert bad.size, "called only when some value is out of range"
    i = int(bad[0])
    return ValueError(
        f"token id {int(values[i])} at position {i} is out of range [0, {MAX_TOKEN_ID}]"
        " (tokens are uint32)"
    )


def _from_ndarray(tokens: npt.NDArray[np.generic]) -> npt.NDArray[np.uint32]:
    if tokens.ndim != 1:
        raise ValueError(f"token array must be 1-D, got shape {tokens.shape}")
    if tokens.dtype.kind not in "iu":
        raise TypeError(f"token array must have an integer dtype, got {tokens.dtype}")
    if tokens.dtype == TOKEN_DTYPE:
        return np.ascontiguousarray(tokens)
    if tokens.size:
        if tokens.dtype.kind == "i" and tokens.min() < 0:
            raise _out_of_range(tokens.astype(np.int64))
        if tokens.dtype.itemsize > _TOKEN_WIDTH and tokens.max() > MAX_TOKEN_ID:
            raise _out_of_range(tokens.astype(np.int64) if tokens.dtype.kind == "i" else tokens)
    return tokens.astype(TOKEN_DTYPE)


def _packed_ints(tokens: Iterable[int]) -> array.array[int]:
    """Python ints packed as native uint32 (this machine is little-endian: `_NATIVE_U4`);
    OverflowError or TypeError for a value that is no uint32."""
    # array.array packs in C, ~3x faster than np.asarray(list, dtype=int64), and is strict where
    # numpy is lax: it refuses floats and strings (numpy truncates 1.5 to 1 and parses "5"). 'I'
    # refuses negative ids and ids above 2**32 - 1 itself. A list goes through fromlist, which
    # reads the list's items directly: 8k ids in ~35 us against ~55 us for array("I", list).
    if type(tokens) is list:
        packed = array.array("I")
        packed.fromlist(tokens)
        return packed
    return array.array("I", tokens)


def _from_ints(tokens: Iterable[int]) -> npt.NDArray[np.uint32]:
    if not isinstance(tokens, list | tuple | range):
        tokens = list(tokens)  # iterated twice when an error has to be located
    try:
        if _NATIVE_U4:
            return np.frombuffer(_packed_ints(tokens), TOKEN_DTYPE)
        values = np.frombuffer(array.array("q", tokens), np.int64)
    except (OverflowError, TypeError):
        raise _bad_token(tokens) from None
    if values.size and (values.min() < 0 or values.max() > MAX_TOKEN_ID):
        raise _out_of_range(values)
    return values.astype(TOKEN_DTYPE)


def _bad_token(tokens: Iterable[int]) -> Exception:
    """The error naming the first id that array.array refused."""
    for i, value in enumerate(tokens):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            return TypeError(
                f"token ids must be ints, got {type(value).__name__} {value!r} at position {i}"
            )
        if not 0 <= value <= MAX_TOKEN_ID:
            return ValueError(
                f"token id {value} at position {i} is out of range [0, {MAX_TOKEN_ID}]"
                " (tokens are uint32)"
            )
    raise AssertionError("array.array refused a sequence of in-range ints")


def as_token_array(tokens: TokenIds) -> npt.NDArray[np.uint32]:
    """Tokens as a 1-D '<u4' array: zero-copy from packed bytes and from '<u4' arrays."""
    if isinstance(tokens, bytes | bytearray | memoryview):
        return np.frombuffer(_buffer_view(tokens), TOKEN_DTYPE)
    if isinstance(tokens, np.ndarray):
        return _from_ndarray(tokens)
    if isinstance(tokens, str):
        raise TypeError("token ids must be ints, bytes or an integer array, not str")
    return _from_ints(tokens)


def _token_view(tokens: TokenIds) -> memoryview:
    if isinstance(tokens, bytes | bytearray | memoryview):
        return _buffer_view(tokens)
    return as_token_array(tokens).view(np.uint8).data


def token_bytes(tokens: TokenIds) -> bytes | memoryview:
    """The canonical packed little-endian uint32 form of tokens; zero-copy where possible."""
    if isinstance(tokens, bytes):
        _buffer_view(tokens)  # validates the length
        return tokens
    if type(tokens) is list and _NATIVE_U4:
        # a list (what most callers pass): packed straight to bytes, no numpy views between
        try:
            return _packed_ints(tokens).tobytes()
        except (OverflowError, TypeError):
            raise _bad_token(tokens) from None
    return _token_view(tokens)


def _canonical_seed(seed: Seed) -> bytes | None:
    """Seed as bytes; an int is its decimal text, as in PYTHONHASHSEED, so 0, "0", b"0" agree."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int | str | bytes):
        raise TypeError(f"seed must be an int, str, bytes or None, got {type(seed).__name__}")
    if isinstance(seed, bytes):
        return seed
    return str(seed).encode()


class TokenHasher:
    """Names chunks of `chunk_size` tokens by prefix-chained hashes under one algorithm and seed."""

    def __init__(
        self, chunk_size: int = 256, hash_algorithm: str = "blake3", *, seed: Seed = None
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        spec = HASH_ALGORITHMS.get(hash_algorithm)
        if spec is None:
            raise ValueError(
                f"unknown hash_algorithm {hash_algorithm!r}; valid names: "
                + ", ".join(sorted(HASH_ALGORITHMS))
            )
        canonical_seed = _canonical_seed(seed)
        if spec.requires_seed and canonical_seed is None:
            raise ValueError(
                f"hash_algorithm={hash_algorithm!r} reproduces vLLM's prefix-cache hashes, whose"
                " first parent is derived from PYTHONHASHSEED: pass seed=<the PYTHONHASHSEED"
                " value the engine runs with> (vLLM hashes are random per process without it)"
            )
        self.chunk_size = chunk_size
        self.hash_algorithm = hash_algorithm
        self.seed = seed
        self.digest_size = spec.digest_size
        self._spec = spec
        self._seed_bytes = canonical_seed
        self.none_hash = spec.none_hash(canonical_seed, hash_algorithm, chunk_size)
        self._contract: str | None = None

    def __repr__(self) -> str:
        return (
            f"TokenHasher(chunk_size={self.chunk_size}, hash_algorithm={self.hash_algorithm!r},"
            f" seed={self.seed!r})"
        )

    def _parent(self, prefix_hash: bytes | None) -> bytes:
        if not prefix_hash:
            return self.none_hash
        if not isinstance(prefix_hash, bytes | bytearray | memoryview):
            raise TypeError(f"prefix_hash must be bytes or None, got {type(prefix_hash).__name__}")
        parent = bytes(prefix_hash)
        if len(parent) != self.digest_size:
            raise ValueError(
                f"prefix_hash is {len(parent)} bytes but {self.hash_algorithm} hashes are"
                f" {self.digest_size}: it was not made by a hasher with these settings"
            )
        return parent

    def hash_tokens(self, tokens: TokenIds, prefix_hash: bytes | None = None) -> bytes:
        """H(prefix_hash or none_hash, tokens) for one chunk's tokens, of any length."""
        return self._spec.hash_one(self._parent(prefix_hash), _token_view(tokens))

    def compute_chunk_hashes(
        self,
        token_ids: TokenIds,
        full_chunk_only: bool = True,
        prefix_hash: bytes | None = None,
    ) -> list[bytes]:
        """The chained hash of each full chunk (and of a trailing partial one if asked).

        The chain starts from prefix_hash, so hashing a continuation with the last hash of the
        tokens before it gives the same names as hashing everything from scratch.
        """
        parent = self._parent(prefix_hash)
        view = _token_view(token_ids)
        step = self.chunk_size * _TOKEN_WIDTH
        full = len(view) - len(view) % step
        hashes = self._spec.chain(parent, view[:full], step) if full else []
        if not full_chunk_only and full < len(view):
            hashes.append(self._spec.hash_one(hashes[-1] if hashes else parent, view[full:]))
        return hashes

    def extend_chain(self, hashes: list[bytes], packed: memoryview) -> None:
        """Append to `hashes`, a chain this hasher made (or []), the hashes of the chunks in
        `packed`: a flat byte view of little-endian uint32 tokens, a whole number of chunks.

        The unchecked fast path of `compute_chunk_hashes` for callers that keep their tokens
        packed and their chain whole (`Session`).
        """
        step = self.chunk_size * _TOKEN_WIDTH
        assert len(packed) % step == 0, "extend_chain takes whole chunks only"
        hashes += self._spec.chain(hashes[-1] if hashes else self.none_hash, packed, step)

    @staticmethod
    def hash_to_bytes(hash_val: bytes | int) -> bytes:
        """A hash as bytes: bytes pass through, ints become 8 bytes big-endian signed."""
        if isinstance(hash_val, bytes):
            return hash_val
        if isinstance(hash_val, bytearray | memoryview):
            return bytes(hash_val)
        if isinstance(hash_val, bool) or not isinstance(hash_val, int):
            raise TypeError(f"a hash must be bytes or an int, got {type(hash_val).__name__}")
        try:
            return hash_val.to_bytes(8, "big", signed=True)
        except OverflowError:
            raise ValueError(
                f"hash {hash_val} does not fit a signed 64-bit int [-2**63, 2**63 - 1]"
            ) from None

    def contract(self) -> str:
        """A 16-hex-char fingerprint of how this hasher names chunks, for client/server checks.

        It hashes a fixed probe with this hasher, together with the settings, so two hashers
        that would name any chunk differently get different contracts.
        """
        if self._contract is None:
            probe_hashes = self.compute_chunk_hashes(_CONTRACT_PROBE, full_chunk_only=False)
            h = blake3(_CONTRACT_DOMAIN)
            h.update(self.hash_algorithm.encode() + b"\x00")
            h.update(self.chunk_size.to_bytes(8, "little"))
            h.update(TOKEN_ENCODING.encode() + b"\x00")
            h.update(self.none_hash)
            for chunk_hash in probe_hashes:
                h.update(chunk_hash)
            self._contract = str(h.hexdigest(length=8))
        return self._contract

    def contract_info(self) -> dict[str, str | int]:
        """The settings behind `contract()`, to say which one differs on a mismatch."""
        seed = self._seed_bytes
        if seed is None:
            seed_text = ""
        else:
            try:
                seed_text = repr(seed.decode("utf-8"))
            except UnicodeDecodeError:
                seed_text = repr(seed)
        return {
            "hash_algorithm": self.hash_algorithm,
            "chunk_size": self.chunk_size,
            "seed": seed_text,
            "token_encoding": TOKEN_ENCODING,
        }

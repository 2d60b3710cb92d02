"""The object format both L2 tiers store: a self-describing header, then the payload.

Header (little-endian): magic b"KVTO", u16 version, u16 key length, u16 layout length,
u16 flags, u64 payload length, 16-byte xxh3-128 digest of the payload, then the key text
(`ObjectKey.to_str()`, ASCII) and the layout string (UTF-8). The key is stored so that a value
found under the wrong name (a renamed file, a mis-set Redis key) is caught, not served.

Flag `ALIGNED` (the disk tier's files): zero bytes follow the texts up to the next multiple of
`ALIGN`, so the payload starts page-aligned in the file. The kernel then copies it from the
page cache into a page-aligned buffer (an L1 slot) at full speed: reading 4 MiB from offset
200 ran at 5.5 GB/s here, from offset 4096 at 6.6 GB/s, like offset 0. Redis values carry no
padding (flags 0). Files written before the flag existed (flags 0) are still read.

Flag `UNRESUMABLE`: the shard is no point an engine can resume from (a chunk whose Mamba state
the engine did not materialize; see `protocol.Reserve.resumable`). A read of such an object
says so (`Verdict.UNRESUMABLE`, `Hit.UNRESUMABLE`), so a chunk loaded back into L1 keeps the
mark. Objects written before the flag existed read as resume points.

Flag `CODED`: the payload is stored through a codec (`kvtier.storage.tiers.codecs`): a codec
record follows the texts (before any padding): u8 codec id, 3 zero bytes, u64 length of the
decoded payload. The digest and the payload length are those of the stored (encoded) bytes, so
damage is caught before anything is decoded. A tier stores a coded object only when it is
smaller than the plain one, so a read that expects the plain size never takes a coded object
for a plain one. Readers before the flag existed see such an object as unreadable.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from typing import NamedTuple

import xxhash
from typing_extensions import Buffer

MAGIC = b"KVTO"
VERSION = 1
_FIXED = struct.Struct("<4sHHHHQ16s")
FIXED_SIZE = _FIXED.size  # 36 bytes
DIGEST_AT = slice(FIXED_SIZE - 16, FIXED_SIZE)  # where an encoded header holds the digest
MAX_TEXT = 0xFFFF  # key and layout lengths are u16
ALIGNED = 1  # flag: the header is padded to a multiple of ALIGN
UNRESUMABLE = 2  # flag: the shard is no resume point
CODED = 4  # flag: a codec record follows the texts; the payload is encoded
_CODEC = struct.Struct("<B3xQ")
ALIGN = 4096


class Header(NamedTuple):
    """A decoded header; `size` is its length in bytes, i.e. where the payload starts."""

    key_text: str
    layout: str
    payload_len: int
    digest: bytes
    size: int
    resumable: bool = True
    codec: int = 0  # the codec id of a CODED object (0: plain)
    raw_len: int = -1  # the decoded payload's length (a plain object's: payload_len)

    @property
    def decoded_len(self) -> int:
        return self.payload_len if self.raw_len < 0 else self.raw_len


class Verdict(enum.Enum):
    """What a read may do with a stored object, judged from its header."""

    OK = "ok"  # header matches the request; the payload digest is still to be checked
    CODED = "coded"  # as OK, but the payload is encoded: digest it, then decode it
    UNRESUMABLE = "unresumable"  # as OK, digest checked, and the shard is no resume point
    LAYOUT_MISMATCH = "layout"  # a sound object with another layout: a miss, kept
    SIZE_MISMATCH = "size"  # a sound object whose payload is not the caller's buffer size: kept
    CORRUPT = "corrupt"  # unreadable, or stored under another key's name: delete it


class Hit(enum.IntEnum):
    """A read's outcome as a tier returns it: false for a miss of any kind."""

    MISS = 0
    RESUMABLE = 1  # served; the shard is a resume point
    UNRESUMABLE = 2  # served; the shard is no resume point


#: reads hash their payload in blocks this large right after each block lands: the block is
#: still in the CPU cache, so the check costs much less than hashing the whole payload after it
#: (measured on a busy 2-core machine: 0.63 of plain readinto -> 0.8-1.0)
BLOCK = 512 << 10


def byte_view(buf: Buffer) -> memoryview:
    """`buf` as a flat unsigned-byte view (no copy)."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def digest(payload: Buffer) -> bytes:
    """The payload's xxh3-128 digest (16 bytes)."""
    return xxhash.xxh3_128_digest(payload)


def read_hashed(out: memoryview, fill: Callable[[memoryview, int], None]) -> bytes:
    """Fill `out` block by block with `fill(block, offset)` and return its digest, each block
    hashed right after it was filled (see BLOCK)."""
    hasher = xxhash.xxh3_128()
    for offset in range(0, len(out), BLOCK):
        block = out[offset : offset + BLOCK]
        fill(block, offset)
        hasher.update(block)
    return hasher.digest()


def _padded(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def header_size(key_text: str, layout: str, *, aligned: bool = False, coded: bool = False) -> int:
    """The header length for this key and layout (the payload starts right after it)."""
    size = FIXED_SIZE + len(key_text) + len(layout.encode()) + (_CODEC.size if coded else 0)
    return _padded(size) if aligned else size


def encode_header(
    key_text: str,
    layout: str,
    payload: Buffer,
    *,
    aligned: bool = False,
    payload_digest: bytes | None = None,
    resumable: bool = True,
    codec: int = 0,
    raw_len: int = 0,
) -> bytes:
    """The header for `payload` stored under `key_text` with `layout`; `aligned` pads it so the
    payload starts at a multiple of `ALIGN`. `payload_digest`: `digest(payload)`, when the
    caller computed it already. `resumable` False sets `UNRESUMABLE`. A `codec` id other than
    0 sets `CODED`: `payload` is that codec's encoding of `raw_len` bytes."""
    key_b = key_text.encode("ascii")
    layout_b = layout.encode()
    if len(key_b) > MAX_TEXT or len(layout_b) > MAX_TEXT:
        raise ValueError(f"key or layout longer than {MAX_TEXT} bytes: layout={layout[:80]!r}")
    n = memoryview(payload).nbytes
    flags = (ALIGNED if aligned else 0) | (0 if resumable else UNRESUMABLE)
    flags |= CODED if codec else 0
    dig = digest(payload) if payload_digest is None else payload_digest
    fixed = _FIXED.pack(MAGIC, VERSION, len(key_b), len(layout_b), flags, n, dig)
    header = fixed + key_b + layout_b + (_CODEC.pack(codec, raw_len) if codec else b"")
    return header + bytes(_padded(len(header)) - len(header)) if aligned else header


def decode_header(buf: Buffer) -> Header | None:
    """The header at the start of `buf`, or None when `buf` does not start with a valid one."""
    view = memoryview(buf).cast("B")
    if len(view) < FIXED_SIZE:
        return None
    magic, version, key_len, layout_len, flags, payload_len, dig = _FIXED.unpack_from(view)
    if magic != MAGIC or version != VERSION or flags & ~(ALIGNED | UNRESUMABLE | CODED):
        return None
    texts = FIXED_SIZE + key_len + layout_len
    end = texts + (_CODEC.size if flags & CODED else 0)
    if len(view) < end:
        return None
    codec, raw_len = _CODEC.unpack_from(view, texts) if flags & CODED else (0, -1)
    if flags & CODED and not codec:
        return None
    try:
        key_text = bytes(view[FIXED_SIZE : FIXED_SIZE + key_len]).decode("ascii")
        layout = bytes(view[FIXED_SIZE + key_len : texts]).decode()
    except UnicodeDecodeError:
        return None
    size = _padded(end) if flags & ALIGNED else end
    return Header(key_text, layout, payload_len, dig, size, not flags & UNRESUMABLE, codec, raw_len)


def judge(header: Header | None, key_text: str, layout: str, out_len: int, total: int) -> Verdict:
    """Whether a stored object of `total` bytes with `header` may serve a read of `out_len` bytes.

    A header whose payload length disagrees with the object's real size is corrupt (truncated or
    padded); a sound object that only differs in layout or (decoded) size is a plain miss and is
    kept. A sound coded object is `Verdict.CODED`: the caller digests and decodes its payload
    (`codecs.TierCodec.decode_into`).
    """
    if header is None or header.key_text != key_text or header.size + header.payload_len != total:
        return Verdict.CORRUPT
    if header.layout != layout:
        return Verdict.LAYOUT_MISMATCH
    if header.decoded_len != out_len:
        return Verdict.SIZE_MISMATCH
    return Verdict.CODED if header.codec else Verdict.OK


def decode_split_header(head: Buffer, payload: Buffer) -> Header | None:
    """The header of an object read as `head` (the expected header length) then `payload`.

    When `head` alone does not decode, the object may be a sound one with a longer header (of
    another layout) and the same total size: look past `head` into the start of `payload`.
    """
    header = decode_header(head)
    if header is None:
        header = decode_header(bytes(head) + bytes(memoryview(payload)[: 2 * MAX_TEXT]))
    return header


def verify(
    header: Header | None,
    key_text: str,
    layout: str,
    out: Buffer,
    total: int,
    payload_digest: bytes | None = None,
) -> Verdict:
    """The verdict on a read of `out` from an object of `total` bytes with `header`: `judge`,
    then the payload digest (`payload_digest` when the reader computed it while reading, see
    `read_hashed`) for an object that may serve the read: OK, or UNRESUMABLE for a shard that
    is no resume point. Every tier's read path of plain objects ends here; a coded object read
    as if plain (a size no tier writes) is a kept miss."""
    view = memoryview(out)
    verdict = judge(header, key_text, layout, view.nbytes, total)
    if verdict is Verdict.CODED:
        return Verdict.SIZE_MISMATCH
    if verdict is Verdict.OK:
        assert header is not None
        actual = digest(view) if payload_digest is None else payload_digest
        if actual != header.digest:
            return Verdict.CORRUPT
        if not header.resumable:
            return Verdict.UNRESUMABLE
    return verdict

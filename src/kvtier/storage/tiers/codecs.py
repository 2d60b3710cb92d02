"""KV compression per L2 tier: the codecs a tier URL's `codec=` names, and what a tier does
with them on its write and read paths (`TierCodec`).

- `none` (default): objects are stored as L1 holds them.
- `zstd`: lossless, through the `zstandard` package (level 1); every dtype. The bytes of float
  elements are split into byte planes first (all first bytes, then all second bytes...).
- `fp8`: e4m3 with a power-of-two scale per block of 128 elements (`kvtier.storage.tiers.fp8`),
  for chunks registered as float16, bfloat16 or float32; within the element-wise bound
  `fp8.error_bound`. A chunk of any other dtype (the packed uint8 chunks of hybrid, MLA and
  sliding-window models, whose pieces it cannot tell apart), or one holding a value that is not
  finite, is stored plain: never wrong bytes.

An object that a codec does not make smaller is stored plain too. The stored form records its
codec (`format.CODED`), so a read decodes whatever codec wrote the object: a tier whose codec
changed across a restart still serves what it stored before. A read checks the digest of the
stored bytes before it decodes anything, so damage is a miss and the object is deleted.

Encoding runs on the L2 writer thread (the tiers' `put_many`), off the request path; decoding
runs in the tier's read, straight into the L1 slot, so the load throughput the hit gate measures
(`kvtier.storage.loadrate`) is in decoded bytes per second, decoding included.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import zstandard

from kvtier.layouts import DTYPE_SIZES
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers import fp8
from kvtier.storage.tiers.base import CodecStats

__all__ = ["CODECS", "Codec", "Prepared", "TierCodec", "dtype_of", "parse_codec"]

ZSTD_LEVEL = 1  # the fastest level: on KV it compressed as well as level 3 (docs/benchmarks.md)


@dataclass(frozen=True)
class Codec:
    """One way to store a payload: `encode(data, dtype)` gives the stored bytes, or None to
    store the payload plain; `decode(stored, out, dtype)` fills `out` or raises ValueError."""

    name: str
    id: int  # recorded in each object's header; never reused
    lossless: bool
    encode: Callable[[memoryview, str], bytes | None]
    decode: Callable[[memoryview, memoryview, str], None]


def _planes(dtype: str) -> int:
    """Byte planes `zstd` splits a payload of `dtype` into (1: none)."""
    return DTYPE_SIZES.get(dtype, 1) if dtype.startswith(("float", "bfloat")) else 1


def _zstd_encode(data: memoryview, dtype: str) -> bytes:
    planes = _planes(dtype)
    if planes > 1 and data.nbytes % planes == 0:
        # byte i of every element together: the sign and exponent bytes of floats repeat a
        # lot, their low mantissa bytes hardly (bfloat16 KV: 1.44x against 1.29x in one stream)
        data = memoryview(np.frombuffer(data, np.uint8).reshape(-1, planes).T.tobytes())
    return _zstd()[0].compress(data)


def _zstd_decode(stored: memoryview, out: memoryview, dtype: str) -> None:
    try:
        got = _zstd()[1].decompress(stored, max_output_size=out.nbytes)
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd: {exc}") from None
    if len(got) != out.nbytes:
        raise ValueError(f"zstd: decoded {len(got)} bytes, expected {out.nbytes}")
    planes = _planes(dtype)
    if planes > 1 and out.nbytes % planes == 0:
        target = np.frombuffer(out, np.uint8).reshape(-1, planes)
        target[:] = np.frombuffer(got, np.uint8).reshape(planes, -1).T
    else:
        out[:] = got


_LOCAL = threading.local()  # zstandard's contexts are not for concurrent use: one per thread


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair: tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor] | None = getattr(
        _LOCAL, "zstd", None
    )
    if pair is None:
        pair = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()
        _LOCAL.zstd = pair
    return pair


def _plain(data: memoryview, dtype: str) -> None:
    return None


def _refuse(stored: memoryview, out: memoryview, dtype: str) -> None:
    raise ValueError("codec none stores plain objects only")


#: codec name -> codec; ids are stored in objects: a new codec takes a new one
CODECS: dict[str, Codec] = {
    "none": Codec("none", 0, True, _plain, _refuse),
    "zstd": Codec("zstd", 1, True, _zstd_encode, _zstd_decode),
    "fp8": Codec("fp8", 2, False, fp8.encode, fp8.decode),
}
_BY_ID = {codec.id: codec for codec in CODECS.values()}


def parse_codec(text: str) -> str:
    """A tier URL's `codec=` value, checked (the URL option parser)."""
    if text not in CODECS:
        raise ValueError(f"unknown codec (known: {', '.join(CODECS)})")
    return text


def dtype_of(layout: str) -> str:
    """The dtype of a layout text such as "bfloat16[32,2,256,8,128]"."""
    return layout.partition("[")[0]


class Prepared(NamedTuple):
    """A payload as a tier stores it: its bytes, their digest, and its codec."""

    payload: memoryview
    digest: bytes
    codec: int  # 0: plain
    raw_len: int  # the payload's length as L1 holds it


class TierCodec:
    """One tier's codec and what it did (`stats`): the tier prepares each payload it writes
    through `prepare` and `header`, and hands each coded object it reads to `decode_into`
    (or a whole object to `read_whole`). Thread-safe."""

    def __init__(self, name: str = "none") -> None:
        self.codec = CODECS[parse_codec(name)]
        self._lock = threading.Lock()
        self._n = dict.fromkeys(
            ("raw_bytes", "stored_bytes", "encoded", "stored_raw", "decoded", "decoded_bytes"), 0
        )
        self._encode_s = 0.0
        self._decode_s = 0.0

    @property
    def name(self) -> str:
        return self.codec.name

    def prepare(
        self, data: memoryview, layout: str, payload_digest: bytes | None = None
    ) -> Prepared:
        """`data` as the tier stores it: encoded when the codec takes it and it shrinks, else
        plain (`payload_digest`, when given, is the plain payload's digest)."""
        view = fmt.byte_view(data)
        stored: bytes | None = None
        if self.codec.id:
            start = time.perf_counter()
            stored = self.codec.encode(view, dtype_of(layout))
            seconds = time.perf_counter() - start
            if stored is not None and len(stored) < len(view):
                with self._lock:
                    self._n["encoded"] += 1
                    self._n["raw_bytes"] += len(view)
                    self._n["stored_bytes"] += len(stored)
                    self._encode_s += seconds
                return Prepared(memoryview(stored), fmt.digest(stored), self.codec.id, len(view))
        with self._lock:
            self._n["raw_bytes"] += len(view)
            self._n["stored_bytes"] += len(view)
            if self.codec.id:
                self._n["stored_raw"] += 1
        digest = fmt.digest(view) if payload_digest is None else payload_digest
        return Prepared(view, digest, 0, len(view))

    @staticmethod
    def header(
        key_text: str, layout: str, prepared: Prepared, *, aligned: bool = False, resumable: bool
    ) -> bytes:
        """The object header of a prepared payload."""
        return fmt.encode_header(
            key_text,
            layout,
            prepared.payload,
            aligned=aligned,
            payload_digest=prepared.digest,
            resumable=resumable,
            codec=prepared.codec,
            raw_len=prepared.raw_len,
        )

    def decode_into(self, header: fmt.Header, stored: memoryview, out: memoryview) -> fmt.Verdict:
        """The verdict on a coded object `judge` found fit for this read (`Verdict.CODED`), its
        stored payload read as `stored`: its digest checked, then decoded into `out`. Damage is
        CORRUPT; a codec this kvtier does not know is a kept miss (written by a newer one)."""
        if fmt.digest(stored) != header.digest:
            return fmt.Verdict.CORRUPT
        codec = _BY_ID.get(header.codec)
        if codec is None:
            return fmt.Verdict.SIZE_MISMATCH
        start = time.perf_counter()
        try:
            codec.decode(stored, fmt.byte_view(out), dtype_of(header.layout))
        except ValueError:
            return fmt.Verdict.CORRUPT
        seconds = time.perf_counter() - start
        with self._lock:
            self._n["decoded"] += 1
            self._n["decoded_bytes"] += out.nbytes
            self._decode_s += seconds
        return fmt.Verdict.OK if header.resumable else fmt.Verdict.UNRESUMABLE

    def read_whole(
        self, value: memoryview, key_text: str, layout: str, out: memoryview
    ) -> fmt.Verdict:
        """The verdict on a whole stored object `value` for a read into `out`: a fitting coded
        object is decoded into `out`, a fitting plain one copied; anything else is judged as
        `format.judge` does (`out` untouched)."""
        header = fmt.decode_header(value)
        verdict = fmt.judge(header, key_text, layout, out.nbytes, len(value))
        if header is None or verdict not in (fmt.Verdict.OK, fmt.Verdict.CODED):
            return verdict
        payload = value[header.size :]
        if verdict is fmt.Verdict.CODED:
            return self.decode_into(header, payload, out)
        if fmt.digest(payload) != header.digest:
            return fmt.Verdict.CORRUPT
        fmt.byte_view(out)[:] = payload
        return fmt.Verdict.OK if header.resumable else fmt.Verdict.UNRESUMABLE

    def stats(self) -> CodecStats:
        with self._lock:
            return CodecStats(
                name=self.codec.name,
                encode_s=self._encode_s,
                decode_s=self._decode_s,
                **self._n,
            )

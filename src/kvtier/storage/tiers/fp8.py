"""FP8 (e4m3) with per-block power-of-two scales: the lossy codec's arithmetic, in numpy.

A chunk of float16, bfloat16 or float32 values is cut into blocks of `BLOCK` consecutive
elements. Each block gets one scale 2**k, the smallest power of two with max|block| <= 448 * 2**k
(448 is e4m3's largest finite value), and each element x is stored as the e4m3 value nearest
to x / 2**k (round to nearest even; one that would decode past the dtype's largest value takes
the e4m3 value below). The stored form is one byte per block (k, offset) followed by one code
byte per element, so a 2-byte dtype shrinks to (1 + 1/128) / 2 of its size and float32 to a
quarter of that again.

Accuracy, element-wise (`error_bound`): |decoded - x| <= |x| / 16 + max|block| / 2**17 + tiny,
where tiny is 2**-25 for float16, 2**-134 for bfloat16, 2**-145 for float32. The first term is
e4m3's 3-bit mantissa (half a step is at most 1/16 of the value), the second its subnormal
range, where the step is 2**(k-9) and 2**k < max|block| / 224. A power-of-two scale divides
exactly, and every e4m3 value times 2**k is exactly a value of the dtype (4 significant bits)
apart from float16's subnormals (tiny: half their step); float32 blocks below 448 * 2**-135 share
the lowest scale (tiny: half e4m3's step there). Zeros (with their sign) stay exact.

Speed comes from table lookups: encoding a 2-byte dtype maps each element's 16 bits to its code
through a 64 KiB table per scale; decoding maps each pair of codes to the pair of decoded values
through a 256 KiB table per scale (float32: one value per code). The tables of the scales a
chunk uses sit side by side, so one `numpy.take` serves every block; tables are built on first
use and kept (`functools.lru_cache`).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

__all__ = ["BLOCK", "DTYPES", "decode", "encode", "encoded_size", "error_bound"]

BLOCK = 128  # elements per scale
E4M3_MAX = 448.0
F8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
#: dtype name -> (numpy dtype, lowest scale exponent, highest): the exponents of the scales a
#: finite block of that dtype can need, stored as one byte each (k - lowest), so at most 256
#: of them: float32 blocks below 448 * 2**-135 (all subnormal) use 2**-135
DTYPES: dict[str, tuple[np.dtype[np.generic], int, int]] = {
    "float16": (np.dtype(np.float16), -32, 8),
    "bfloat16": (BF16, -135, 120),
    "float32": (np.dtype(np.float32), -135, 120),
}
#: the absolute error left below the lowest scale: half the smallest subnormal step of float16
#: and bfloat16 (the decoded value's own rounding), half e4m3's step at 2**-135 for float32
_TINY = {"float16": 2.0**-25, "bfloat16": 2.0**-134, "float32": 2.0**-145}
_MAX_CLASSES = 16  # scales whose tables one lookup puts side by side (16 x 256 KiB at most)
_CODES = np.arange(256, dtype=np.uint8).view(F8).astype(np.float64)

Array = npt.NDArray[np.generic]

assert sys.byteorder == "little", "the pair tables assume little-endian memory"


def encoded_size(nbytes: int, dtype: str) -> int | None:
    """The stored size of `nbytes` of `dtype`, or None when this codec cannot take them."""
    known = DTYPES.get(dtype)
    if known is None or nbytes % known[0].itemsize:
        return None
    n = nbytes // known[0].itemsize
    return -(-n // BLOCK) + n


def error_bound(original: Array, dtype: str) -> npt.NDArray[np.float64]:
    """The largest |decoded - original| the codec allows, element by element (see module)."""
    x = np.asarray(original).astype(np.float64).reshape(-1)
    n = len(x)
    padded = np.zeros(-(-n // BLOCK) * BLOCK)
    padded[:n] = np.abs(x)
    block_max = padded.reshape(-1, BLOCK).max(axis=1).repeat(BLOCK)[:n]
    bound: npt.NDArray[np.float64] = np.abs(x) / 16 + block_max / 2.0**17 + _TINY[dtype]
    return bound


# -- tables ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _values(dtype: str) -> npt.NDArray[np.float64]:
    """Every 16-bit pattern of a 2-byte dtype as its value (float64)."""
    bits = np.arange(65536, dtype=np.uint32)
    with np.errstate(all="ignore"):  # the NaN patterns
        if dtype == "float16":
            return bits.astype(np.uint16).view(np.float16).astype(np.float64)
        return (bits << 16).view(np.float32).astype(np.float64)


@functools.lru_cache(maxsize=512)
def _limit(dtype: str, k: int) -> int:
    """The largest e4m3 magnitude code whose value times 2**k is finite in `dtype`: a value
    near the dtype's largest rounds down to it, not up to infinity (65504 -> 61440 in float16,
    within the bound: one e4m3 step)."""
    top = float(ml_dtypes.finfo(DTYPES[dtype][0]).max)  # type: ignore[no-untyped-call]
    return int(np.flatnonzero(_CODES[:0x7F] * 2.0**k <= top)[-1])


def _cap(codes: npt.NDArray[np.uint8], limit: int) -> None:
    """Lower codes whose magnitude is above `limit` to it, sign kept (in place)."""
    over = (codes & 0x7F) > limit
    codes[over] = (codes[over] & 0x80) | limit


@functools.lru_cache(maxsize=64)
def _encode_table(dtype: str, k: int) -> npt.NDArray[np.uint8]:
    """16-bit pattern -> e4m3 code of its value / 2**k (entries above 448 * 2**k unused)."""
    with np.errstate(all="ignore"):
        codes = (_values(dtype) * 2.0**-k).astype(F8).view(np.uint8)
    _cap(codes, _limit(dtype, k))
    return codes


def _decoded_bits(dtype: str, k: int) -> npt.NDArray[np.uint32]:
    """Code -> the bits of its value times 2**k in `dtype` (as uint32)."""
    with np.errstate(all="ignore"):
        values: Array = (_CODES * 2.0**k).astype(DTYPES[dtype][0])
    bits: npt.NDArray[np.uint32] = (
        values.view(np.uint32) if dtype == "float32" else values.view(np.uint16).astype(np.uint32)
    )
    return bits


@functools.lru_cache(maxsize=64)
def _decode_table(dtype: str, k: int) -> npt.NDArray[np.uint32]:
    """Two codes (as one little-endian uint16) -> their two decoded values (one uint32);
    float32: code -> decoded value."""
    one = _decoded_bits(dtype, k)
    if dtype == "float32":
        return one
    pair = np.arange(65536, dtype=np.uint32)
    table: npt.NDArray[np.uint32] = one[pair & 0xFF] | (one[pair >> 8] << 16)
    return table


@functools.lru_cache(maxsize=16)
def _side_by_side(kind: str, dtype: str, lo: int, hi: int) -> Array:
    """The tables of scales lo..hi, one after the other."""
    make = _encode_table if kind == "encode" else _decode_table
    parts: list[Array] = [make(dtype, k) for k in range(lo, hi + 1)]
    return np.concatenate(parts)


def _lookup(kind: str, dtype: str, keys: Array, ks: npt.NDArray[np.int16], out: Array) -> None:
    """out[b] = table(ks[b])[keys[b]] for every block row b, in as few lookups as the spread
    of scales allows."""
    lo, hi = int(ks.min()), int(ks.max())
    for start in range(lo, hi + 1, _MAX_CLASSES):
        end = min(start + _MAX_CLASSES - 1, hi)
        table = _side_by_side(kind, dtype, start, end)
        per_class = len(table) // (end - start + 1)
        if start == lo and end == hi:  # every block in one lookup, straight into `out`
            idx = keys.astype(np.intp)
            idx += ((ks.astype(np.intp) - start) * per_class)[:, None]
            np.take(table, idx, out=out)
            return
        rows = np.flatnonzero((ks >= start) & (ks <= end))
        if len(rows):
            idx = keys[rows].astype(np.intp)
            idx += ((ks[rows].astype(np.intp) - start) * per_class)[:, None]
            out[rows] = np.take(table, idx)


# -- the codec ---------------------------------------------------------------------------------


def _exponents(block_max: npt.NDArray[np.float64], lo: int, hi: int) -> npt.NDArray[np.int16]:
    """The smallest k with block_max <= 448 * 2**k per block, at least `lo` (an all-zero
    block: `lo`)."""
    with np.errstate(divide="ignore"):
        k = np.ceil(np.log2(block_max / E4M3_MAX))
    k = np.where(block_max > 0, k, float(lo))
    # log2 may land one off at exact powers of two: settle it exactly
    k = np.where(block_max > E4M3_MAX * np.exp2(k), k + 1, k)
    k = np.where((block_max > 0) & (block_max <= E4M3_MAX * np.exp2(k - 1)), k - 1, k)
    return np.clip(k, lo, hi).astype(np.int16)


def encode(data: memoryview, dtype: str) -> bytes | None:
    """The stored form of `data` (values of `dtype`), or None when it must be stored raw: a
    dtype this codec does not take, or a value that is not finite."""
    known = DTYPES.get(dtype)
    size = encoded_size(data.nbytes, dtype)
    if known is None or size is None or not data.nbytes:
        return None
    np_dtype, lo, hi = known
    n = data.nbytes // np_dtype.itemsize
    nb = -(-n // BLOCK)
    flat: npt.NDArray[np.unsignedinteger[Any]] = np.frombuffer(
        data, dtype=np.uint32 if dtype == "float32" else np.uint16
    )
    if n % BLOCK:
        flat = np.concatenate([flat, np.zeros(nb * BLOCK - n, flat.dtype)])
    bits = flat.reshape(nb, BLOCK)
    out = np.empty(nb + nb * BLOCK, np.uint8)
    codes = out[nb:].reshape(nb, BLOCK)
    if dtype == "float32":
        x = bits.view(np.float32)
        block_max = np.abs(x).max(axis=1).astype(np.float64)
        if not np.isfinite(block_max).all():
            return None
        ks = _exponents(block_max, lo, hi)
        # x / 2**k in float32, exactly: in two steps where 2**-k itself is past float32's range
        first = np.clip(-ks, -126, 126)
        with np.errstate(all="ignore"):
            scaled = x * np.exp2(first.astype(np.float32))[:, None]
            if (first != -ks).any():
                scaled *= np.exp2((-ks - first).astype(np.float32))[:, None]
        codes[:] = scaled.astype(F8).view(np.uint8)
        for k in np.unique(ks[ks >= hi - 8]):  # where rounding up could overflow float32
            rows = np.flatnonzero(ks == k)
            part = codes[rows]
            _cap(part, _limit(dtype, int(k)))
            codes[rows] = part
    else:
        top = (bits & 0x7FFF).max(axis=1)  # |x| orders like its bits
        if int(top.max()) >= (0x7C00 if dtype == "float16" else 0x7F80):  # inf or NaN
            return None
        block_max = _values(dtype)[top]
        ks = _exponents(block_max, lo, hi)
        _lookup("encode", dtype, bits, ks, codes)
    out[:nb] = (ks - lo).astype(np.uint8)
    return out[: nb + n].tobytes()


def decode(stored: memoryview, out: memoryview, dtype: str) -> None:
    """Decode `stored` (from `encode`) into `out`; ValueError when it cannot be this dtype's
    stored form of `out.nbytes` bytes."""
    known = DTYPES.get(dtype)
    size = encoded_size(out.nbytes, dtype)
    if known is None or size is None or stored.nbytes != size:
        raise ValueError(f"not an fp8 form of {out.nbytes} bytes of {dtype}")
    np_dtype, lo, hi = known
    n = out.nbytes // np_dtype.itemsize
    nb = -(-n // BLOCK)
    raw = np.frombuffer(stored, np.uint8)
    ks = raw[:nb].astype(np.int16) + lo
    if int(ks.max()) > hi:
        raise ValueError(f"scale exponent out of range for {dtype}")
    codes = raw[nb:]
    if n % BLOCK:
        codes = np.concatenate([codes, np.zeros(nb * BLOCK - n, np.uint8)])
    unit = 1 if dtype == "float32" else 2  # codes per lookup
    keys = codes.view(np.uint8 if unit == 1 else np.uint16).reshape(nb, BLOCK // unit)
    target = np.frombuffer(out, np.uint8)
    if n % BLOCK == 0:
        _lookup("decode", dtype, keys, ks, target.view(np.uint32).reshape(nb, BLOCK // unit))
        return
    result = np.empty((nb, BLOCK // unit), np.uint32)
    _lookup("decode", dtype, keys, ks, result)
    target[:] = result.view(np.uint8).reshape(-1)[: out.nbytes]

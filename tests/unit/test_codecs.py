"""The codecs themselves: fp8's element-wise bound over awkward values, what each codec refuses
(and so stores plain), the coded object header, and that the hit gate's load rate counts decoded
bytes. Every tier's use of them: tests/integration/test_tier_codecs.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvtier.keys import ObjectKey
from kvtier.storage.manager import TierManager
from kvtier.storage.tiers import codecs, fp8, open_tier
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.codecs import TierCodec

DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}


def round_trip(values: np.ndarray, dtype: str) -> np.ndarray:
    stored = fp8.encode(values.view(np.uint8).data, dtype)
    assert stored is not None and len(stored) == fp8.encoded_size(values.nbytes, dtype)
    out = bytearray(values.nbytes)
    fp8.decode(memoryview(stored), memoryview(out), dtype)
    return np.frombuffer(out, values.dtype)


def assert_within_bound(values: np.ndarray, dtype: str) -> None:
    decoded = round_trip(values, dtype)
    error = np.abs(decoded.astype(np.float64) - values.astype(np.float64))
    bound = fp8.error_bound(values, dtype)
    bad = np.flatnonzero(error > bound)
    assert not len(bad), (
        f"{dtype}: {values[bad[:5]]} decoded as {decoded[bad[:5]]} (bound {bound[bad[:5]]})"
    )
    zeros = values == 0
    assert (decoded[zeros] == 0).all() and (
        np.signbit(decoded[zeros]) == np.signbit(values[zeros])
    ).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_bound_holds_over_every_magnitude_and_block_shape(dtype: str) -> None:
    rng = np.random.default_rng(7)
    np_dtype = DTYPES[dtype]
    info = np.finfo(np_dtype)
    smallest = float(info.smallest_subnormal)
    cases = [
        rng.standard_normal(4096),  # ordinary KV
        rng.standard_normal(4096) * 10.0 ** rng.uniform(-6, 4, 4096),  # mixed within blocks
        np.repeat(10.0 ** rng.uniform(-30, 30, 32), fp8.BLOCK) * rng.standard_normal(4096),
        np.array([float(info.max), -float(info.max), float(info.max) / 2, 1.0] * 64),
        np.array([smallest, -smallest, 3 * smallest, 0.0] * 40),  # subnormals
        np.array([448.0, 464.0, 456.0, 455.9, -448.0, 1 / 512, 1 / 1024, 3 / 2048] * 20),
        np.exp2(np.arange(-20, 20, 0.25)),  # powers of two and between
        rng.standard_normal(fp8.BLOCK * 3 + 17),  # a last block cut short
        rng.standard_normal(1),
    ]
    for case in cases:
        with np.errstate(over="ignore"):
            values = np.clip(case, -float(info.max), float(info.max)).astype(np_dtype)
        values[::7][: len(values) // 50] = 0
        if len(values) > 3:
            values[3] = -0.0
        assert_within_bound(values, dtype)


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.integers(1, 700),
        elements=st.floats(allow_nan=False, allow_infinity=False, width=32),
    )
)
def test_fp8_bound_holds_for_arbitrary_float32(values: np.ndarray) -> None:
    assert_within_bound(values, "float32")
    top = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)  # type: ignore[no-untyped-call]
    assert_within_bound(np.clip(values, -top, top).astype(ml_dtypes.bfloat16), "bfloat16")
    with np.errstate(over="ignore"):
        halves = np.clip(values, -65504, 65504).astype(np.float16)
    assert_within_bound(halves, "float16")


def test_fp8_takes_only_finite_floats_and_rejects_malformed_input() -> None:
    ints = np.arange(512, dtype=np.int32)
    assert fp8.encode(ints.view(np.uint8).data, "int32") is None
    assert fp8.encode(memoryview(bytes(64)), "uint8") is None
    assert fp8.encode(memoryview(bytes(63)), "float16") is None  # not whole elements
    for dtype, np_dtype in DTYPES.items():
        values = np.ones(300, np_dtype)
        values[200] = np.inf
        assert fp8.encode(values.view(np.uint8).data, dtype) is None
        values[200] = np.nan
        assert fp8.encode(values.view(np.uint8).data, dtype) is None
    good = np.ones(256, np.float16)
    stored = bytearray(fp8.encode(good.view(np.uint8).data, "float16") or b"")
    out = memoryview(bytearray(good.nbytes))
    with pytest.raises(ValueError):
        fp8.decode(memoryview(stored[:-1]), out, "float16")
    stored[0] = 100  # a scale exponent no float16 block can have
    with pytest.raises(ValueError):
        fp8.decode(memoryview(stored), out, "float16")


def test_fp8_halves_16_bit_kv_and_quarters_float32() -> None:
    assert fp8.encoded_size(2 * 128 * 1024, "bfloat16") == 128 * 1024 + 1024
    assert fp8.encoded_size(4 * 128 * 1024, "float32") == 128 * 1024 + 1024
    assert fp8.encoded_size(100, "uint8") is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "uint8", "int64"])
@pytest.mark.parametrize("n", [1, 255, 4096])
def test_zstd_gives_every_dtype_back_byte_for_byte(dtype: str, n: int) -> None:
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n * 8, dtype=np.uint8)
    data[: len(data) // 2] = 0  # something to compress
    zstd = codecs.CODECS["zstd"]
    stored = zstd.encode(data.data, dtype)
    assert stored is not None
    out = memoryview(bytearray(data.nbytes))
    zstd.decode(memoryview(stored), out, dtype)
    assert bytes(out) == data.tobytes()
    with pytest.raises(ValueError):
        zstd.decode(memoryview(stored[:-3]), out, dtype)


def test_unknown_codec_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"bad disk tier URL option codec='lz4'.*zstd, fp8"):
        open_tier("disk:///tmp/kvtier-never?codec=lz4")
    with pytest.raises(ValueError, match="codec="):
        open_tier("redis://127.0.0.1:6379/0?codec=gzip")


def test_coded_header_records_codec_and_decoded_length() -> None:
    payload = b"z" * 100
    header = fmt.encode_header("k", "float16[256]", payload, codec=2, raw_len=512, resumable=False)
    decoded = fmt.decode_header(header)
    assert decoded is not None
    assert (decoded.codec, decoded.raw_len, decoded.payload_len, decoded.decoded_len) == (
        2, 512, 100, 512
    )  # fmt: skip
    assert decoded.size == len(header) == fmt.header_size("k", "float16[256]", coded=True)
    total = len(header) + 100
    assert fmt.judge(decoded, "k", "float16[256]", 512, total) is fmt.Verdict.CODED
    assert fmt.judge(decoded, "k", "float16[256]", 100, total) is fmt.Verdict.SIZE_MISMATCH
    assert fmt.judge(decoded, "k", "float16[9]", 512, total) is fmt.Verdict.LAYOUT_MISMATCH
    assert fmt.judge(decoded, "k", "float16[256]", 512, total + 1) is fmt.Verdict.CORRUPT
    # read as if it were plain (a size no tier writes): a kept miss, never its bytes
    assert fmt.verify(decoded, "k", "float16[256]", b"z" * 512, total) is fmt.Verdict.SIZE_MISMATCH
    plain = fmt.decode_header(fmt.encode_header("k", "uint8[4]", b"abcd"))
    assert plain is not None and plain.codec == 0 and plain.decoded_len == 4


def test_tier_codec_stores_plain_what_it_cannot_take_or_shrink() -> None:
    codec = TierCodec("zstd")
    noise = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    prepared = codec.prepare(noise.data, "uint8[4096]")  # random bytes do not shrink
    assert prepared.codec == 0 and bytes(prepared.payload) == noise.tobytes()
    fp = TierCodec("fp8")
    assert fp.prepare(noise.data, "uint8[4096]").codec == 0
    halves = np.ones(2048, np.float16)
    coded = fp.prepare(halves.view(np.uint8).data, "float16[2048]")
    assert coded.codec == codecs.CODECS["fp8"].id and coded.digest == fmt.digest(coded.payload)
    s = fp.stats()
    assert (s.encoded, s.stored_raw, s.raw_bytes) == (1, 1, 8192)
    assert s.stored_bytes == 4096 + (fp8.encoded_size(4096, "float16") or 0)


def test_a_codec_this_kvtier_does_not_know_is_a_kept_miss() -> None:
    payload = b"q" * 64
    header = fmt.decode_header(
        fmt.encode_header("k", "float16[64]", payload, codec=99, raw_len=128)
    )
    assert header is not None
    out = memoryview(bytearray(128))
    assert TierCodec().decode_into(header, memoryview(payload), out) is fmt.Verdict.SIZE_MISMATCH


def test_the_hit_gate_measures_a_coded_tier_in_decoded_bytes(tmp_path: Path) -> None:
    """The load rate the gate compares with recompute: bytes that landed in L1 (decoded) over
    the read's time, decoding included."""
    tier = open_tier(f"disk://{tmp_path}/l2?codec=fp8")
    manager = TierManager([tier])
    try:
        values = np.random.default_rng(1).standard_normal(64 * 1024).astype(np.float16)
        keys = [ObjectKey("m", "", 1, 0, hashlib.sha256(b"%d" % i).digest()) for i in range(4)]
        for k in keys:
            tier.put(k, values.view(np.uint8).data, "float16[65536]")
        outs = [memoryview(bytearray(values.nbytes)) for _ in keys]
        found = manager.get_many_into(
            [(k, o, "float16[65536]") for k, o in zip(keys, outs, strict=True)]
        )
        assert all(found)
        rate = manager.rates.get(tier.name)
        stored = tier.stats().codec.stored_bytes
        assert rate.bytes_read == 4 * values.nbytes and stored < rate.bytes_read / 1.9
    finally:
        manager.close()

"""kvtier.client.copying: copies by array and by address, on one thread and split over several,
through the native helper (kvtier.client.native) and without it (KVTIER_NATIVE_COPY=0)."""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.client import copying
from kvtier.client.copying import PARALLEL_MIN_BYTES, PIECE_BYTES, copy_addresses, copy_pairs
from kvtier.client.native import copy_library


@pytest.fixture(params=["native", "python"])
def copier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test once through the native helper and once through the pure-Python copies."""
    if request.param == "python":
        monkeypatch.setenv("KVTIER_NATIVE_COPY", "0")
    copy_library.cache_clear()
    yield request.param
    monkeypatch.undo()
    copy_library.cache_clear()


@pytest.fixture
def python_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The pure-Python copies only (the failure tests: their bad pairs fail mid-copy there)."""
    monkeypatch.setenv("KVTIER_NATIVE_COPY", "0")
    copy_library.cache_clear()
    yield
    monkeypatch.undo()
    copy_library.cache_clear()


def test_the_native_helper_is_built_and_loads() -> None:
    lib = copy_library()
    assert lib is not None, (
        "src/kvtier/client/native/libkvtier_copy.so is missing or stale: `pip install -e .` "
        "builds it, or `python src/kvtier/client/native/build.py`"
    )
    assert lib.variant in {"avx512", "avx2", "sse2", ""}


def _pieces(total: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """A source, a zeroed destination, and (offset, size) pieces of uneven sizes covering it."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, np.uint8)
    cuts = sorted({0, total, *rng.integers(1, total, 40).tolist()})
    return src, dst, [(lo, hi - lo) for lo, hi in itertools.pairwise(cuts)]


@pytest.mark.parametrize("total", [4096, 2 * PARALLEL_MIN_BYTES])
@pytest.mark.parametrize("threads", [1, 3])
def test_copy_addresses_copies_every_piece_exactly(total: int, threads: int, copier: str) -> None:
    src, dst, pieces = _pieces(total, total + threads)
    # destination pieces in reverse order, so a piece that lands in the wrong place shows
    order = list(reversed(pieces))
    offsets, at = {}, 0
    for lo, size in order:
        offsets[lo] = at
        at += size
    copies = [(dst.ctypes.data + offsets[lo], src.ctypes.data + lo, size) for lo, size in pieces]
    copy_addresses(copies, threads=threads)
    expected = np.concatenate([src[lo : lo + size] for lo, size in order])
    assert np.array_equal(dst, expected)


@pytest.mark.parametrize("threads", [1, 3])
def test_copy_pairs_and_copy_addresses_agree(threads: int, copier: str) -> None:
    src, dst, pieces = _pieces(2 * PARALLEL_MIN_BYTES, threads)
    copy_pairs([(dst[lo : lo + n], src[lo : lo + n]) for lo, n in pieces], threads=threads)
    by_address = np.zeros_like(dst)
    base_dst, base_src = by_address.ctypes.data, src.ctypes.data
    copy_addresses([(base_dst + lo, base_src + lo, n) for lo, n in pieces], threads=threads)
    assert np.array_equal(dst, src) and np.array_equal(by_address, src)


@pytest.mark.parametrize("stream_min", ["0", "-1"])
@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_copies_of_any_alignment_and_size_are_exact(
    stream_min: str, threads: int, copier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every transfer streamed (0) or none (-1): heads and tails around 64-byte lines, runs
    under 4 KiB, runs of 1 MiB and more (cut into pieces that threads share)."""
    monkeypatch.setenv("KVTIER_COPY_STREAM_MIN", stream_min)
    rng = np.random.default_rng(threads)
    src = rng.integers(0, 256, 24 << 20, dtype=np.uint8)
    dst = np.zeros(24 << 20, np.uint8)
    sizes = [1, 63, 64, 65, 4095, 4096, 4097, 131072 + 17, (1 << 20) + 5, (3 << 20) + 1]
    sizes += rng.integers(1, 300_000, 60).tolist()
    copies, expect, at = [], [], 0
    for size in sizes:
        at += int(rng.integers(0, 128))  # any destination alignment
        lo = int(rng.integers(0, src.nbytes - size))  # any source alignment
        copies.append((dst.ctypes.data + at, src.ctypes.data + lo, size))
        expect.append((at, lo, size))
        at += size
    copy_addresses(copies, threads=threads)
    for to, lo, size in expect:
        assert np.array_equal(dst[to : to + size], src[lo : lo + size]), (to, lo, size)
    assert not dst[at:].any(), "a copy wrote past its run"


def test_an_overlapping_run_copies_as_memmove(copier: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_COPY_STREAM_MIN", "0")
    buf = np.arange(1 << 16, dtype=np.uint8)
    expected = buf.copy()
    expected[100 : 100 + 60000] = buf[0:60000]
    copy_addresses([(buf.ctypes.data + 100, buf.ctypes.data, 60000)], threads=1)
    assert np.array_equal(buf, expected)


def test_copy_pairs_of_unequal_sizes_raise(copier: str) -> None:
    with pytest.raises(ValueError):
        copy_pairs([(np.zeros(10, np.uint8), np.zeros(20, np.uint8))], threads=1)


def test_copy_pairs_into_a_read_only_array_raise(copier: str) -> None:
    dst = np.zeros(8192, np.uint8)
    dst.flags.writeable = False
    with pytest.raises(ValueError):
        copy_pairs([(dst, np.ones(8192, np.uint8))], threads=1)
    assert not dst.any()


def test_copy_pairs_of_strided_arrays_copy_exactly(copier: str) -> None:
    src = np.arange(4 * 8192, dtype=np.uint8).reshape(4, 8192)
    dst = np.zeros((8192, 4), np.uint8).T  # the same shape, not contiguous
    copy_pairs([(dst, src)], threads=1)
    assert np.array_equal(dst, src)


def test_copy_addresses_of_nothing_is_a_no_op(copier: str) -> None:
    copy_addresses([], threads=2)
    one = (ctypes.c_char * 4)()
    copy_addresses([(ctypes.addressof(one), ctypes.addressof(one), 0)], threads=2)


# -- a copy that fails ---------------------------------------------------------------------------


def _occupy_pool() -> tuple[threading.Event, int]:
    """Every thread of the copy pool busy until the returned gate opens (and their number)."""
    pool = copying._get_pool()
    workers: int = pool._max_workers  # type: ignore[attr-defined]
    started = threading.Barrier(workers + 1)
    gate = threading.Event()

    def hold() -> None:
        started.wait(10)
        gate.wait(10)

    for _ in range(workers):
        pool.submit(hold)
    started.wait(10)
    return gate, workers


def _drain_pool(workers: int) -> None:
    """Return once every pool thread is free: all that was queued before has run."""
    everyone = threading.Barrier(workers + 1)
    for _ in range(workers):
        copying._get_pool().submit(everyone.wait, 10)
    everyone.wait(10)


def test_a_failed_copy_cancels_its_parts_that_did_not_start(python_copies: None) -> None:
    dst = np.zeros(2 * PIECE_BYTES, np.uint8)
    src = np.full(2 * PIECE_BYTES, 7, np.uint8)
    # pieces: 0 = the bad pair (the caller's share, first), 1 = dst[:4M] (the pool's share),
    # 2 = dst[4M:] (the caller's, never reached)
    pairs = [(np.zeros(10, np.uint8), np.zeros(20, np.uint8)), (dst, src)]
    gate, workers = _occupy_pool()  # so the pool's share is still queued when the caller fails
    try:
        with pytest.raises(ValueError):
            copy_pairs(pairs, threads=2)
    finally:
        gate.set()
    _drain_pool(workers)
    assert not dst.any(), "a part of the failed copy wrote after copy_pairs raised"


def test_a_failed_copy_returns_only_after_its_running_parts_end(python_copies: None) -> None:
    n_a, n_b = 16 * PIECE_BYTES, 64 * PIECE_BYTES
    dst_a, src_a = np.zeros(n_a, np.uint8), np.full(n_a, 3, np.uint8)
    dst_b, src_b = np.zeros(n_b, np.uint8), np.full(n_b, 5, np.uint8)
    # pieces 0-15 of a (even ones the caller's, odd ones the pool's), piece 16 the bad pair (the
    # caller's: it fails after copying 8 pieces, while the pool copies), then b (the pool's
    # share goes on with its odd pieces)
    pairs = [(dst_a, src_a), (np.zeros(10, np.uint8), np.zeros(20, np.uint8)), (dst_b, src_b)]
    with pytest.raises(ValueError):
        copy_pairs(pairs, threads=2)
    seen = dst_b.copy()
    time.sleep(0.3)  # on purpose, not a synchronization: a late write has nothing to wait on
    assert np.array_equal(dst_b, seen), "a part of the failed copy wrote after copy_pairs raised"


def test_a_part_that_fails_on_the_pool_is_raised_after_the_others_ended(
    python_copies: None,
) -> None:
    groups = 32
    dst = np.zeros(groups * PIECE_BYTES, np.uint8)
    src = np.full(groups * PIECE_BYTES, 9, np.uint8)
    tiny_dst, tiny_src = np.zeros(groups, np.uint8), np.ones(groups, np.uint8)
    pairs = []
    for g in range(groups):  # one piece per pair; with 3 threads piece i goes to share i % 3
        tiny = (tiny_dst[g : g + 1], tiny_src[g : g + 1])
        pairs.append(tiny)  # share 0, the caller's: done at once
        pairs.append((np.zeros(10, np.uint8), np.zeros(20, np.uint8)) if g == 0 else tiny)
        pairs.append((dst[g * PIECE_BYTES : (g + 1) * PIECE_BYTES],
                      src[g * PIECE_BYTES : (g + 1) * PIECE_BYTES]))  # fmt: skip
    # share 1 fails on its first piece; share 2 copies 128 MiB meanwhile
    with pytest.raises(ValueError):
        copy_pairs(pairs, threads=3)
    seen = dst.copy()
    time.sleep(0.3)  # on purpose, not a synchronization: a late write has nothing to wait on
    assert np.array_equal(dst, seen), "a part of the failed copy wrote after copy_pairs raised"

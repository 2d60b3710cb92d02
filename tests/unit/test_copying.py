"""kvtier.copying: copies by array and by address, on one thread and split over several."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvtier.copying import PARALLEL_MIN_BYTES, copy_addresses, copy_pairs


def _pieces(total: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """A source, a zeroed destination, and (offset, size) pieces of uneven sizes covering it."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, np.uint8)
    cuts = sorted({0, total, *rng.integers(1, total, 40).tolist()})
    return src, dst, [(lo, hi - lo) for lo, hi in itertools.pairwise(cuts)]


@pytest.mark.parametrize("total", [4096, 2 * PARALLEL_MIN_BYTES])
@pytest.mark.parametrize("threads", [1, 3])
def test_copy_addresses_copies_every_piece_exactly(total: int, threads: int) -> None:
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
def test_copy_pairs_and_copy_addresses_agree(threads: int) -> None:
    src, dst, pieces = _pieces(2 * PARALLEL_MIN_BYTES, threads)
    copy_pairs([(dst[lo : lo + n], src[lo : lo + n]) for lo, n in pieces], threads=threads)
    by_address = np.zeros_like(dst)
    base_dst, base_src = by_address.ctypes.data, src.ctypes.data
    copy_addresses([(base_dst + lo, base_src + lo, n) for lo, n in pieces], threads=threads)
    assert np.array_equal(dst, src) and np.array_equal(by_address, src)

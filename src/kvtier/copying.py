"""Copies of KV bytes between a caller's arrays and the shared-memory arena, over threads.

One thread copying from memory to memory reaches about 7 GB/s here; several reach what the
memory bus gives. numpy releases the GIL while it copies a large contiguous block, so a small
pool of threads, each copying its share of the pieces, runs truly in parallel. Small copies stay
on the caller's thread: handing them to a pool would cost more than the copy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

__all__ = ["copy_pairs", "copy_threads"]

Bytes = npt.NDArray[np.uint8]

#: below this many bytes in all, one thread copies (a pool round trip costs ~20-50 us)
PARALLEL_MIN_BYTES = 4 << 20
#: pieces are at most this big, so a few huge chunks still spread over every thread
PIECE_BYTES = 4 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def copy_threads() -> int:
    """Threads a large copy is split over: KVTIER_COPY_THREADS, else up to 8 (one per CPU)."""
    configured = os.environ.get("KVTIER_COPY_THREADS")
    if configured:
        return max(1, int(configured))
    return max(1, min(8, os.cpu_count() or 1))


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=copy_threads(), thread_name_prefix="kvtier-copy")
        return _pool


def _copy_all(pieces: Sequence[tuple[Bytes, Bytes]]) -> None:
    for dst, src in pieces:
        np.copyto(dst, src)


def copy_pairs(pairs: Sequence[tuple[Bytes, Bytes]], *, threads: int | None = None) -> None:
    """Copy each `(dst, src)` pair of equal-sized uint8 arrays, in parallel when large."""
    total = sum(src.nbytes for _, src in pairs)
    threads = copy_threads() if threads is None else threads
    if threads <= 1 or total < PARALLEL_MIN_BYTES:
        _copy_all(pairs)
        return
    pieces: list[tuple[Bytes, Bytes]] = []
    for dst, src in pairs:
        n = src.nbytes
        for lo in range(0, n, PIECE_BYTES):
            hi = min(n, lo + PIECE_BYTES)
            pieces.append((dst[lo:hi], src[lo:hi]))
    shares = [pieces[i::threads] for i in range(threads)]
    pool = _get_pool()
    futures = [pool.submit(_copy_all, share) for share in shares[1:] if share]
    _copy_all(shares[0])  # the caller's thread takes a share too
    for future in futures:
        future.result()

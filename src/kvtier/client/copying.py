"""Copies of KV bytes between a caller's arrays and the shared-memory arena, over threads.

One thread copying from memory to memory reaches about 7 GB/s here; several reach what the
memory bus gives. numpy releases the GIL while it copies a large contiguous block, so a small
pool of threads, each copying its share of the pieces, runs truly in parallel. Small copies stay
on the caller's thread: handing them to a pool would cost more than the copy.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["copy_addresses", "copy_pairs", "copy_threads"]

Bytes = npt.NDArray[np.uint8]
T = TypeVar("T")

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


def _split(copy: Callable[[Sequence[T]], None], shares: list[Sequence[T]]) -> None:
    """`copy` each share, the first on the caller's thread and the others on the pool.

    Returns or raises only once no part runs any more: when one part fails, those not started
    are cancelled and those running are waited for, so no pool thread writes into memory the
    caller may already have given back (arena slots it aborts or releases on the error).
    """
    pool = _get_pool()
    futures = [pool.submit(copy, share) for share in shares[1:] if share]
    try:
        copy(shares[0])  # the caller's thread takes a share too
        wait(futures, return_when=FIRST_EXCEPTION)
    finally:
        for future in futures:
            future.cancel()  # only those not started yet: the rest are waited for
        wait(futures)
    for future in futures:
        if not future.cancelled() and future.exception() is not None:
            future.result()  # raises the part's error


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
    _split(_copy_all, [pieces[i::threads] for i in range(threads)])


def _memmove_all(copies: Sequence[tuple[int, int, int]]) -> None:
    for dst, src, size in copies:
        ctypes.memmove(dst, src, size)  # a ctypes foreign call: it releases the GIL


def copy_addresses(copies: Sequence[tuple[int, int, int]], *, threads: int | None = None) -> None:
    """Copy each `(dst address, src address, size)`, in parallel when large.

    For memory known only by address (an engine's host KV pool lists its pages as pointers): one
    memmove per piece costs far less than wrapping each piece as an array first.
    """
    total = sum(size for _, _, size in copies)
    threads = copy_threads() if threads is None else threads
    if threads <= 1 or total < PARALLEL_MIN_BYTES:
        _memmove_all(copies)
        return
    _split(_memmove_all, [copies[i::threads] for i in range(threads)])

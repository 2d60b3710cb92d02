"""Copies of KV bytes between a caller's arrays and the shared-memory arena, over threads.

One thread copying from memory to memory reaches about 7 GB/s here; several reach what the
memory bus gives. numpy and ctypes release the GIL while they copy, so a small pool of threads,
each copying its share of the pieces, runs truly in parallel. Small copies stay on the caller's
thread: handing them to a pool would cost more than the copy.

Where the native helper is built (kvtier.client.native), a transfer's pieces go to it as one
array of (dst, src, size) runs, one foreign call per thread, and a transfer of at least
`stream_min_bytes()` is written with streaming stores: a page-sized memcpy reads every
destination line before writing it, so copying a KV cache far larger than the caches moves its
bytes over the memory bus three times instead of two (glibc streams only single copies larger
than most of the shared cache). Without the helper, each piece is one numpy copy or one
ctypes.memmove.
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

from kvtier.client.native import CopyLibrary, copy_library

__all__ = ["copy_addresses", "copy_pairs", "copy_threads", "stream_min_bytes"]

Bytes = npt.NDArray[np.uint8]
T = TypeVar("T")

#: below this many bytes in all, one thread copies (a pool round trip costs ~20-50 us)
PARALLEL_MIN_BYTES = 4 << 20
#: pieces are at most this big, so a few huge chunks still spread over every thread
PIECE_BYTES = 4 << 20
#: with the native helper, the pieces threads take one by one are at most this big
SHARE_PIECE_BYTES = 1 << 20
#: transfers of at least this many bytes in all bypass the caches (native helper only): smaller
#: ones are likely read again soon from the cache they were just written into
STREAM_MIN_BYTES = 16 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def copy_threads() -> int:
    """Threads a large copy is split over: KVTIER_COPY_THREADS, else up to 8 (one per CPU)."""
    configured = os.environ.get("KVTIER_COPY_THREADS")
    if configured:
        return max(1, int(configured))
    return max(1, min(8, os.cpu_count() or 1))


def stream_min_bytes() -> int:
    """Transfers this large or larger are written with streaming stores: KVTIER_COPY_STREAM_MIN
    (bytes; 0 streams every transfer, -1 none), else STREAM_MIN_BYTES."""
    configured = os.environ.get("KVTIER_COPY_STREAM_MIN")
    if configured:
        value = int(configured)
        return value if value >= 0 else 1 << 62
    return STREAM_MIN_BYTES


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=copy_threads(), thread_name_prefix="kvtier-copy")
        return _pool


def _split(copy: Callable[[T], None], shares: Sequence[T]) -> None:
    """`copy` each share, the first on the caller's thread and the others on the pool.

    Returns or raises only once no part runs any more: when one part fails, those not started
    are cancelled and those running are waited for, so no pool thread writes into memory the
    caller may already have given back (arena slots it aborts or releases on the error).
    """
    pool = _get_pool()
    futures = [pool.submit(copy, share) for share in shares[1:]]
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
    lib = copy_library()
    if lib is not None and all(d.flags.c_contiguous and s.flags.c_contiguous for d, s in pairs):
        for dst, src in pairs:  # as numpy's copyto would refuse them, before any byte moves
            if dst.nbytes != src.nbytes:
                raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
            if not dst.flags.writeable:
                raise ValueError("copy into a read-only array")
        runs = [(d.ctypes.data, s.ctypes.data, s.nbytes) for d, s in pairs]
        _copy_native(lib, runs, threads)
        return
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
    _split(_copy_all, [share for i in range(threads) if (share := pieces[i::threads])])


def _memmove_all(copies: Sequence[tuple[int, int, int]]) -> None:
    for dst, src, size in copies:
        ctypes.memmove(dst, src, size)  # a ctypes foreign call: it releases the GIL


def copy_addresses(copies: Sequence[tuple[int, int, int]], *, threads: int | None = None) -> None:
    """Copy each `(dst address, src address, size)`, in parallel when large.

    For memory known only by address (an engine's host KV pool lists its pages as pointers): one
    memmove per piece costs far less than wrapping each piece as an array first.
    """
    lib = copy_library()
    if lib is not None:
        _copy_native(lib, copies, threads)
        return
    total = sum(size for _, _, size in copies)
    threads = copy_threads() if threads is None else threads
    if threads <= 1 or total < PARALLEL_MIN_BYTES:
        _memmove_all(copies)
        return
    _split(_memmove_all, [share for i in range(threads) if (share := copies[i::threads])])


def _copy_native(
    lib: CopyLibrary, copies: Sequence[tuple[int, int, int]], threads: int | None
) -> None:
    """The runs through the native helper, in one call per thread. With several threads, the
    runs are cut into pieces of at most SHARE_PIECE_BYTES and the threads take them one by one
    from a shared counter: one whose core is busy with other work copies fewer pieces, instead of
    holding up the transfer with a fixed half."""
    if not copies:
        return
    runs = np.array(copies, dtype=np.uint64).reshape(-1, 3)
    total = int(runs[:, 2].sum())
    streaming = int(total >= stream_min_bytes())
    threads = copy_threads() if threads is None else threads
    if threads <= 1 or total < PARALLEL_MIN_BYTES:
        lib.copy_runs(runs.ctypes.data, len(runs), streaming, None)
        return
    if int(runs[:, 2].max()) > SHARE_PIECE_BYTES:
        runs = _cut(runs, SHARE_PIECE_BYTES)
    counter = ctypes.c_size_t(0)
    next_run = ctypes.addressof(counter)

    def copy() -> None:
        lib.copy_runs(runs.ctypes.data, len(runs), streaming, next_run)

    pool = _get_pool()
    helpers = [pool.submit(copy) for _ in range(min(threads, len(runs)) - 1)]
    try:
        copy()  # returns once every run is taken: helpers not started by then have nothing to do
    finally:
        for helper in helpers:
            helper.cancel()  # not started (a busy machine had not run that thread yet)
        wait(helpers)  # those that started finish the runs they took
    for helper in helpers:
        if not helper.cancelled():
            helper.result()  # raises a helper's error, if one had any


def _cut(runs: npt.NDArray[np.uint64], piece: int) -> npt.NDArray[np.uint64]:
    """`runs` with each run larger than `piece` bytes cut into pieces of at most that size."""
    out: list[tuple[int, int, int]] = []
    for dst, src, size in runs.tolist():
        for lo in range(0, size, piece):
            out.append((dst + lo, src + lo, min(piece, size - lo)))
    return np.array(out, dtype=np.uint64)

"""What the Mooncake tier needs around Mooncake's client: buffer addresses, the registered
staging area, and calls bounded by a deadline.

Mooncake's transfer engine moves bytes only between registered memory. kvtier registers its
arena once, so payloads move between arena slots and the pool with no copy; the staging area is
a second registered range for what is not in the arena: every object's header, and payloads a
caller passes in its own memory (copied through it).

A call to a stalled master blocks for Mooncake's RPC timeout (30 s, measured with the master
stopped). Calls that write only into the staging area or read memory run on a small pool and
are abandoned at the tier's deadline: their staging space is given back when Mooncake returns,
never before, and a put abandoned while it reads an arena slot that is then reused stores bytes
that fail the header's digest, so they are a miss, never served.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import numpy as np
from typing_extensions import Buffer

from kvtier.storage.allocator import Allocator

_T = TypeVar("_T")

#: staging ranges start at multiples of this (a cache line)
STAGING_ALIGN = 64


def address_of(buf: Buffer) -> int:
    """The address of the first byte of a C-contiguous buffer (read-only ones too)."""
    return int(np.frombuffer(memoryview(buf), dtype=np.uint8).ctypes.data)


class Registered:
    """The address ranges registered with the transfer engine (arena, staging)."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []

    def add(self, start: int, size: int) -> None:
        self._ranges.append((start, start + size))

    def covers(self, start: int, size: int) -> bool:
        """Whether [start, start + size) lies inside one registered range."""
        end = start + size
        return any(lo <= start and end <= hi for lo, hi in self._ranges)


class Staging:
    """A registered buffer carved into short-lived ranges (thread-safe first fit)."""

    def __init__(self, size: int) -> None:
        self._buf = bytearray(max(size, STAGING_ALIGN))
        self._view = memoryview(self._buf)
        self.address = address_of(self._buf)
        self.size = len(self._buf)
        self._alloc = Allocator(self.size, alignment=STAGING_ALIGN)
        self._lock = threading.Lock()

    def take(self, size: int) -> int | None:
        """The offset of `size` free bytes, or None when the area has no such range now."""
        with self._lock:
            return self._alloc.alloc(max(size, 1))

    def give(self, offsets: list[tuple[int, int]]) -> None:
        """Give back (offset, size) ranges from `take`."""
        with self._lock:
            for offset, size in offsets:
                self._alloc.free(offset, max(size, 1))

    def view(self, offset: int, size: int) -> memoryview:
        return self._view[offset : offset + size]


class CallTimeout(Exception):
    """A pool call passed the tier's deadline (it goes on; its result is dropped)."""


class Deadlines:
    """Runs calls on a few threads and waits for each at most `timeout` seconds.

    A call past its deadline keeps its thread until Mooncake returns; while every thread holds
    one, new calls fail at once (CallTimeout) rather than queue behind them.
    """

    def __init__(self, timeout: float, workers: int = 4, name: str = "mooncake") -> None:
        self.timeout = timeout
        self._workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"kvtier-{name}")
        self._lock = threading.Lock()
        self._late = 0

    @property
    def late(self) -> int:
        """Calls past their deadline that Mooncake has not answered yet."""
        with self._lock:
            return self._late

    def run(
        self,
        fn: Callable[[], _T],
        after: Callable[[], None] | None = None,
        *,
        extra_s: float = 0.0,
    ) -> _T:
        """`fn()`'s result within the deadline (`timeout` + `extra_s`), else CallTimeout.
        `after()` runs once the call has really ended, on time or late (it gives back the
        staging the call writes into)."""
        with self._lock:
            if self._late >= self._workers:
                raise CallTimeout(f"{self._late} earlier calls are still unanswered")
        future: Future[_T] = self._pool.submit(fn)
        try:
            result = future.result(self.timeout + extra_s)
        except FutureTimeout:
            with self._lock:
                self._late += 1
            future.add_done_callback(lambda _: self._landed(after))
            raise CallTimeout(f"no answer within {self.timeout + extra_s:g} s") from None
        except BaseException:
            if after is not None:
                after()
            raise
        if after is not None:
            after()
        return result

    def _landed(self, after: Callable[[], None] | None) -> None:
        with self._lock:
            self._late -= 1
        if after is not None:
            after()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

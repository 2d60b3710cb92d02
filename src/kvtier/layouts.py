"""The KV layouts workers register: what one chunk of one rank's shard looks like.

A layout is registered per (model, world_size) and must be the same for every rank, so the
server can size slots, check every store and retrieve against it, and label L2 objects with it.

A layout is kept while a connected client that registered it lives, then for a time to live
without use (`expire`): a registry that only grows would let clients that come and go fill it.
Registering, releasing and expiring each cost what they touch (dict and ordered-dict steps).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.errors import (
    BadArrayError,
    InvalidArgumentError,
    LayoutMismatchError,
    NoSpaceError,
    NotRegisteredError,
)
from kvtier.keys import shown

__all__ = ["DTYPE_SIZES", "Layout", "LayoutRegistry"]

#: bytes per element of the dtypes a KV layout may use (torch names without "torch.")
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class Layout:
    """One chunk of one rank's shard."""

    chunk_shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @classmethod
    def of(cls, chunk_shape: Sequence[int], dtype: str) -> Layout:
        itemsize = DTYPE_SIZES.get(dtype)
        if itemsize is None:
            raise BadArrayError(
                f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPE_SIZES)}"
            )
        if not chunk_shape or any(d <= 0 for d in chunk_shape):
            raise BadArrayError(f"chunk shape {list(chunk_shape)} must be non-empty and positive")
        return cls(tuple(chunk_shape), dtype, math.prod(chunk_shape) * itemsize)

    @property
    def text(self) -> str:
        """The form stored with L2 objects and shown in errors, e.g. "float16[32,2,256,4,128]"."""
        return f"{self.dtype}[{','.join(map(str, self.chunk_shape))}]"


def _check_rank(worker_id: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= worker_id < world_size:
        raise InvalidArgumentError(
            f"worker_id {worker_id} is outside range(world_size={world_size})"
        )


class LayoutRegistry:
    """Layouts by (model, world_size): registered by workers, checked on every data request."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._layouts: dict[tuple[str, int], Layout] = {}
        self._users: dict[tuple[str, int], set[str]] = {}  # the clients that registered it
        self._by_user: dict[str, set[tuple[str, int]]] = {}
        #: layouts no connected client registered, oldest idle first: when it became idle
        self._idle: dict[tuple[str, int], float] = {}

    def __len__(self) -> int:
        return len(self._layouts)

    def _used(self, key: tuple[str, int]) -> None:
        """An idle layout was used: its time to live starts again."""
        if key in self._idle:
            del self._idle[key]
            self._idle[key] = self._clock()

    def release(self, user: str) -> None:
        """Client `user` is gone: a layout no other client registered starts its time to live."""
        for key in self._by_user.pop(user, ()):
            users = self._users.get(key)
            if users is None:
                continue
            users.discard(user)
            if not users:
                del self._users[key]
                self._idle[key] = self._clock()

    def expire(self, ttl: float) -> int:
        """Forget the layouts idle for `ttl` seconds; how many."""
        now = self._clock()
        gone = 0
        while self._idle:
            key, since = next(iter(self._idle.items()))
            if now - since < ttl:
                break
            del self._idle[key]
            self._layouts.pop(key, None)
            gone += 1
        return gone

    def register(
        self,
        model: str,
        world_size: int,
        worker_id: int,
        chunk_shape: Sequence[int],
        dtype: str,
        *,
        max_group_bytes: int | None = None,
        user: str | None = None,
    ) -> Layout:
        """Record a rank's layout; every rank of (model, world_size) must register the same,
        and one chunk of all ranks must fit `max_group_bytes` (the L1) when given.

        Every check comes before the record: a refused layout is never kept, so it cannot make
        a later, correct registration of the same model a LAYOUT_MISMATCH.
        """
        _check_rank(worker_id, world_size)
        layout = Layout.of(chunk_shape, dtype)
        if max_group_bytes is not None and layout.nbytes * world_size > max_group_bytes:
            raise NoSpaceError(
                f"one chunk of {shown(model)!r} needs {layout.nbytes * world_size} bytes "
                f"({world_size} ranks of {layout.nbytes}), more than the whole L1 of "
                f"{max_group_bytes} bytes: restart the server with a larger --l1-size"
            )
        key = (model, world_size)
        known = self._layouts.setdefault(key, layout)
        if known != layout:
            raise LayoutMismatchError(
                f"model {shown(model)!r} with world_size {world_size} is registered with chunk "
                f"layout {known.text}; rank {worker_id} sent {layout.text}"
            )
        if user is not None:  # kept while this client lives
            self._idle.pop(key, None)
            self._users.setdefault(key, set()).add(user)
            self._by_user.setdefault(user, set()).add(key)
        else:
            self._used(key)
        return layout

    def get(self, model: str, world_size: int) -> Layout | None:
        """The layout of (model, world_size) (a use: an idle one's time to live restarts)."""
        self._used((model, world_size))
        return self._layouts.get((model, world_size))

    def check(
        self, model: str, world_size: int, worker_id: int, chunk_shape: Sequence[int], dtype: str
    ) -> Layout:
        """The registered layout, if an array of `chunk_shape` and `dtype` matches it."""
        layout = self.get(model, world_size)
        if layout is None:
            raise NotRegisteredError(
                f"no worker registered a layout for model {model!r} with world_size "
                f"{world_size}: call Client.register(model=..., world_size=..., ...) first"
            )
        _check_rank(worker_id, world_size)
        if tuple(chunk_shape) != layout.chunk_shape or dtype != layout.dtype:
            raise BadArrayError(
                f"array chunks are {dtype}{list(chunk_shape)} but model {model!r} "
                f"(world_size {world_size}) is registered as {layout.text}"
            )
        return layout

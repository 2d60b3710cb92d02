"""The allocator of the arena's byte ranges: first fit, page aligned, coalescing on free."""

from __future__ import annotations

import bisect

from kvtier.storage.arena import PAGE_SIZE

__all__ = ["Allocator"]


class Allocator:
    """First-fit allocator of page-aligned byte ranges in [0, capacity).

    Free ranges are kept as two parallel lists sorted by offset, so freeing finds its neighbours
    by bisection and coalesces with them; allocation takes the lowest range that fits.
    """

    def __init__(self, capacity: int, alignment: int = PAGE_SIZE) -> None:
        """`capacity` is rounded down to the alignment (a partial page cannot be handed out)."""
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self._alignment = alignment
        self._capacity = capacity - capacity % alignment
        self._starts: list[int] = [0] if self._capacity else []
        self._sizes: list[int] = [self._capacity] if self._capacity else []
        self._free = self._capacity

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def free_bytes(self) -> int:
        return self._free

    @property
    def used_bytes(self) -> int:
        return self._capacity - self._free

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of every free range, by offset: for tests and diagnostics."""
        return list(zip(self._starts, self._sizes, strict=True))

    def rounded(self, size: int) -> int:
        """`size` rounded up to the alignment: the bytes an allocation of `size` really takes."""
        return -(-size // self._alignment) * self._alignment

    def alloc(self, size: int) -> int | None:
        """The offset of a new range of `size` bytes (rounded up), or None if none fits."""
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size}")
        need = -(-size // self._alignment) * self._alignment
        if need > self._free:
            return None
        sizes = self._sizes
        for i, have in enumerate(sizes):
            if have >= need:
                start = self._starts[i]
                if have == need:
                    del self._starts[i]
                    del sizes[i]
                else:
                    self._starts[i] = start + need
                    sizes[i] = have - need
                self._free -= need
                return start
        return None

    def free(self, offset: int, size: int) -> int:
        """Return [offset, offset + size) to the free list, merging it with free neighbours.

        Returns the size of the free range that now contains it, so a caller making room can
        tell when a request fits without retrying `alloc`.
        """
        need = -(-size // self._alignment) * self._alignment
        end = offset + need
        if size <= 0 or offset < 0 or offset % self._alignment or end > self._capacity:
            raise ValueError(
                f"cannot free [{offset}, {offset + size}): not an aligned range inside"
                f" [0, {self._capacity})"
            )
        starts, sizes = self._starts, self._sizes
        i = bisect.bisect_right(starts, offset)
        prev_end = starts[i - 1] + sizes[i - 1] if i else 0
        if (i and prev_end > offset) or (i < len(starts) and starts[i] < end):
            raise ValueError(f"double free: [{offset}, {end}) overlaps a free range")
        merge_prev = i > 0 and prev_end == offset
        merge_next = i < len(starts) and starts[i] == end
        if merge_prev and merge_next:
            sizes[i - 1] += need + sizes[i]
            del starts[i]
            del sizes[i]
            merged = sizes[i - 1]
        elif merge_prev:
            sizes[i - 1] += need
            merged = sizes[i - 1]
        elif merge_next:
            starts[i] = offset
            sizes[i] += need
            merged = sizes[i]
        else:
            starts.insert(i, offset)
            sizes.insert(i, need)
            merged = need
        self._free += need
        return merged

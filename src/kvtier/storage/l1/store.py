"""`L1Store`: the L1 index with its write path, read path and pins (see `kvtier.storage.l1`)."""

from __future__ import annotations

from kvtier.storage.l1.pins import L1Pins
from kvtier.storage.l1.reads import L1Reads
from kvtier.storage.l1.writes import L1Writes


class L1Store(L1Writes, L1Reads, L1Pins):
    """Allocation, shard states, pins and LRU eviction for the L1 arena's `capacity` bytes.

    Groups that hold no staging shard and no pin sit in an LRU order and are evicted whole,
    least recent first, when a reservation needs room. Not thread-safe: one owner at a time.
    """

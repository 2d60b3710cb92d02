"""What storage tells whoever follows it: a chunk group became complete in a tier, left one, or
a tier was cleared.

Every place the L1 or an L2 tier gains or loses a whole chunk group calls one `StorageObserver`
(the KV-event publisher, the miss-reason counters...). Calls come from the thread that made the
change, the L1's ones inside the engine lock: an observer only records what it is told (an
append to a queue) and never blocks, waits on I/O or calls back into storage. A group is
"stored" in a tier when all of its `world_size` pieces are there, "removed" when any piece
leaves it; a tier is named by its `name` (`L1_TIER` for the shared-memory L1).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvtier.keys import ChunkKey

__all__ = [
    "L1_TIER",
    "NO_OBSERVER",
    "ListsChunks",
    "Observers",
    "Removal",
    "ReportsRemovals",
    "StorageObserver",
]

logger = logging.getLogger(__name__)

#: the name the shared-memory L1 reports under (L2 tiers report under their own `name`)
L1_TIER = "l1"


class Removal(enum.Enum):
    """Why a chunk group left a tier."""

    EVICTED = "evicted"  # made room: the L1's LRU, the disk tier's capacity, a store's maxmemory
    EXPIRED = "expired"  # a shared store's TTL ran out
    CLEARED = "cleared"  # an operator's clear
    CORRUPT = "corrupt"  # a read found a piece damaged or misnamed, and it was deleted
    DELETED = "deleted"  # deleted on purpose, one object at a time
    DECLINED = "declined"  # evicted from L1 unannounced: the cache policy had declined it


class StorageObserver(Protocol):
    """Follows what each tier holds. Every method returns at once and never raises."""

    def stored(self, keys: Sequence[ChunkKey], tier: str) -> None:
        """These groups became complete in `tier`."""
        ...

    def removed(self, keys: Sequence[ChunkKey], tier: str, reason: Removal) -> None:
        """A piece of each of these groups left `tier` (the group is no longer a hit there)."""
        ...

    def cleared(self, tier: str, model: str | None, cache_salt: str | None) -> None:
        """Every group of `model` and `cache_salt` (None: any) left `tier`, which cannot list
        them one by one (a shared store cleared by pattern)."""
        ...


class Observers:
    """Fans each report out to the observers added; with none it does nothing (the null
    observer). An observer that raises is logged and does not stop the others or storage."""

    __slots__ = ("_observers",)

    def __init__(self, *observers: StorageObserver) -> None:
        self._observers: tuple[StorageObserver, ...] = observers

    def add(self, observer: StorageObserver) -> None:
        """Follow storage with one more observer (while the server is assembled)."""
        self._observers = (*self._observers, observer)

    def __bool__(self) -> bool:
        """Whether anyone listens: reports that cost work to build are skipped otherwise."""
        return bool(self._observers)

    def stored(self, keys: Sequence[ChunkKey], tier: str) -> None:
        for observer in self._observers:
            try:
                observer.stored(keys, tier)
            except Exception:
                logger.exception("storage observer %r failed on stored()", observer)

    def removed(self, keys: Sequence[ChunkKey], tier: str, reason: Removal) -> None:
        for observer in self._observers:
            try:
                observer.removed(keys, tier, reason)
            except Exception:
                logger.exception("storage observer %r failed on removed()", observer)

    def cleared(self, tier: str, model: str | None, cache_salt: str | None) -> None:
        for observer in self._observers:
            try:
                observer.cleared(tier, model, cache_salt)
            except Exception:
                logger.exception("storage observer %r failed on cleared()", observer)


#: the observer of storage nobody follows (a shared, empty fan-out: never add to it)
NO_OBSERVER = Observers()


@runtime_checkable
class ReportsRemovals(Protocol):
    """An L2 tier that sees its own removals (the disk tier's evictions and corrupt reads, a
    shared store's expiry notifications) and reports them, per piece, to `observer`."""

    def observe(self, observer: StorageObserver) -> None: ...


@runtime_checkable
class ListsChunks(Protocol):
    """An L2 tier that knows what it holds without asking a server (the disk tier's index): at
    start the tier manager reports its complete groups as stored, so a follower learns what
    survived a restart."""

    def complete_chunks(self) -> list[ChunkKey]: ...

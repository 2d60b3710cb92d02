"""A bounded memory of chunk groups by name: which tiers hold each, which tier one left last,
whose store lapsed, and the names stored under each chunk hash. What a miss is explained from.

It is a `StorageObserver` (storage/observers.py): fed from the storage's reports (a group became
complete in a tier, left one, a tier was cleared), and from the lease reaper (a store whose
staging lease lapsed). It holds at most
`capacity` names, least recently reported first out: a name forgotten is explained as never
stored, the one answer a memory cannot give wrongly the other way. Each name costs about 300
bytes (its key, its record and its place in the hash index), so the default 65536 names take
about 20 MiB.

Thread-safe with its own small lock: reports come from the engine (under its lock), the L2
writer and the tiers' own threads; each call touches the names it is given, except a clear,
which walks the memory once (bounded by `capacity`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvtier.keys import ChunkKey
from kvtier.storage.observers import L1_TIER, Removal

__all__ = ["ChunkMemory", "Whereabouts"]


class _Record:
    __slots__ = ("cleared", "lapsed", "left", "tiers")

    def __init__(self) -> None:
        self.tiers: set[str] = set()  # where the group is complete now
        self.left = ""  # the tier it left last, once no tier holds it
        self.cleared = False  # and it left that tier by a clear
        self.lapsed = False  # a store of it lapsed, and it was not stored since


class Whereabouts(NamedTuple):
    """What the memory knows of one name (see `ChunkMemory.whereabouts`)."""

    held_by: str  # an L2 tier the memory says holds it ("" none)
    left: str  # the tier it left last ("" none)
    cleared: bool  # it left by a clear
    lapsed: bool  # a store of it lapsed, and it was not stored since
    other_name: bool  # the same chunk hash is stored under another name


_UNKNOWN = Whereabouts("", "", False, False, False)
_UNKNOWN_OTHER = Whereabouts("", "", False, False, True)


class ChunkMemory:
    """At most `capacity` names with their record, most recently reported last."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity} (see --miss-memory)")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._records: OrderedDict[ChunkKey, _Record] = OrderedDict()
        # chunk hash -> the names under it that some tier holds (few: one per salt or model)
        self._by_hash: dict[bytes, set[ChunkKey]] = {}
        self.forgotten = 0  # names dropped to stay within capacity

    def __len__(self) -> int:
        return len(self._records)

    # -- reports -------------------------------------------------------------------------------

    def stored(self, keys: Sequence[ChunkKey], tier: str) -> None:
        """The groups of `keys` became complete in `tier`."""
        with self._lock:
            for key in keys:
                record = self._touch(key)
                record.tiers.add(tier)
                record.left = ""
                record.cleared = record.lapsed = False
                self._by_hash.setdefault(key.chunk_hash, set()).add(key)

    def removed(self, keys: Sequence[ChunkKey], tier: str, reason: Removal) -> None:
        """The groups of `keys` left `tier` (evicted, expired, cleared, found corrupt)."""
        with self._lock:
            for key in keys:
                record = self._records.get(key)
                if record is None:
                    record = self._touch(key)
                record.tiers.discard(tier)
                if not record.tiers:
                    record.left = tier
                    record.cleared = reason is Removal.CLEARED
                    self._unindex(key)

    def cleared(self, tier: str, model: str | None, cache_salt: str | None) -> None:
        """Every group of `model` and `cache_salt` (None: any) left `tier`."""
        with self._lock:
            gone = [
                key
                for key, record in self._records.items()
                if tier in record.tiers
                and (model is None or key.model == model)
                and (cache_salt is None or key.cache_salt == cache_salt)
            ]
        self.removed(gone, tier, Removal.CLEARED)

    def lapsed(self, keys: Iterable[ChunkKey]) -> None:
        """Stores of `keys` lapsed before their commit (their staging lease ran out)."""
        with self._lock:
            for key in keys:
                record = self._touch(key)
                if not record.tiers:
                    record.lapsed = True

    # -- reads ---------------------------------------------------------------------------------

    def whereabouts(self, keys: Sequence[ChunkKey]) -> list[Whereabouts]:
        """What is known of each of `keys` (one hold of the lock for all): an L2 tier holding
        it, the tier it left, a lapsed store, another name under its hash."""
        records, by_hash, make = self._records, self._by_hash, Whereabouts._make
        out: list[Whereabouts] = []
        with self._lock:
            for key in keys:
                record = records.get(key)
                others = by_hash.get(key.chunk_hash)
                other = others is not None and (len(others) > 1 or key not in others)
                if record is None:
                    out.append(_UNKNOWN_OTHER if other else _UNKNOWN)
                    continue
                held = ""
                for tier in record.tiers:  # one or two
                    if tier != L1_TIER:
                        held = tier
                        break
                left = record.left or (L1_TIER if L1_TIER in record.tiers else "")
                out.append(make((held, left, record.cleared, record.lapsed, other)))
        return out

    # -- internals -----------------------------------------------------------------------------

    def _touch(self, key: ChunkKey) -> _Record:
        record = self._records.get(key)
        if record is not None:
            self._records.move_to_end(key)
            return record
        record = self._records[key] = _Record()
        if len(self._records) > self.capacity:
            old, _ = self._records.popitem(last=False)
            self._unindex(old)
            self.forgotten += 1
        return record

    def _unindex(self, key: ChunkKey) -> None:
        names = self._by_hash.get(key.chunk_hash)
        if names is not None:
            names.discard(key)
            if not names:
                del self._by_hash[key.chunk_hash]

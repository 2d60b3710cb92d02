"""A bounded memory of chunk groups by name: which tiers hold each, which tier one left last,
whose store lapsed, and the names stored under each chunk hash. What a miss is explained from.

It is a `StorageObserver` (storage/observers.py): fed from the storage's reports (a group became
complete in a tier, left one, a tier was cleared), and from the lease reaper (a store whose
staging lease lapsed). It holds at most `capacity` names, least recently reported first out: a
name forgotten is explained as never stored, the one answer a memory cannot give wrongly the
other way. Each name costs about 300 bytes (its key, its record and its place in the hash
index), so the default 65536 names take about 20 MiB.

Names, records and the hash index are plain tuples of strings, bytes, ints and flags only
(not NamedTuples: the garbage collector stops tracking an exact tuple of such atoms after its
first look, never a tuple subclass), so a full memory adds almost nothing to every later
collection. Records as objects with a set each made 65536 names 260k tracked objects, and a
full collection of the server process 0.2 s on 2 busy CPUs.

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


#: a name's record: (the tiers where the group is complete now, the tier it left last once no
#: tier holds it, how it left that tier (None: not known to have left), whether a store of it
#: lapsed and it was not stored since)
_Record = tuple[tuple[str, ...], str, Removal | None, bool]
_Name = tuple[str, str, int, bytes]  # a ChunkKey as a plain tuple (equal, same hash)
_NEW: _Record = ((), "", None, False)


class Whereabouts(NamedTuple):
    """What the memory knows of one name (see `ChunkMemory.whereabouts`)."""

    held_by: str  # an L2 tier the memory says holds it ("" none)
    left: str  # the tier it left last ("" none)
    cleared: bool  # it left by a clear
    declined: bool  # it left L1 unkept: the cache policy had declined it
    lapsed: bool  # a store of it lapsed, and it was not stored since
    other_name: bool  # the same chunk hash is stored under another model of the same salt


_UNKNOWN = Whereabouts("", "", False, False, False, False)
_UNKNOWN_OTHER = Whereabouts("", "", False, False, False, True)


class ChunkMemory:
    """At most `capacity` names with their record, most recently reported last."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity} (see --miss-memory)")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._records: OrderedDict[_Name, _Record] = OrderedDict()
        # chunk hash -> the names under it that some tier holds (few: one per salt or model)
        self._by_hash: dict[bytes, tuple[_Name, ...]] = {}
        self.forgotten = 0  # names dropped to stay within capacity

    def __len__(self) -> int:
        return len(self._records)

    # -- reports -------------------------------------------------------------------------------

    def stored(self, keys: Sequence[ChunkKey], tier: str) -> None:
        """The groups of `keys` became complete in `tier`."""
        with self._lock:
            for key in keys:
                name: _Name = tuple(key)  # type: ignore[assignment]
                tiers = self._touch(name)[0]
                if tier not in tiers:
                    tiers = (*tiers, tier)
                self._records[name] = (tiers, "", None, False)
                names = self._by_hash.get(key.chunk_hash, ())
                if name not in names:
                    self._by_hash[key.chunk_hash] = (*names, name)

    def removed(self, keys: Sequence[ChunkKey], tier: str, reason: Removal) -> None:
        """The groups of `keys` left `tier` (evicted, expired, cleared, found corrupt)."""
        with self._lock:
            for key in keys:
                name: _Name = tuple(key)  # type: ignore[assignment]
                record = self._records.get(name) or self._touch(name)
                tiers = tuple(t for t in record[0] if t != tier)
                if tiers:
                    self._records[name] = (tiers, *record[1:])  # type: ignore[assignment]
                    continue
                self._records[name] = ((), tier, reason, record[3])
                self._unindex(name)

    def cleared(self, tier: str, model: str | None, cache_salt: str | None) -> None:
        """Every group of `model` and `cache_salt` (None: any) left `tier`."""
        with self._lock:
            gone = [
                ChunkKey(*name)
                for name, record in self._records.items()
                if tier in record[0]
                and (model is None or name[0] == model)
                and (cache_salt is None or name[1] == cache_salt)
            ]
        self.removed(gone, tier, Removal.CLEARED)

    def lapsed(self, keys: Iterable[ChunkKey]) -> None:
        """Stores of `keys` lapsed before their commit (their staging lease ran out)."""
        with self._lock:
            for key in keys:
                name: _Name = tuple(key)  # type: ignore[assignment]
                record = self._touch(name)
                if not record[0]:
                    self._records[name] = ((), record[1], record[2], True)

    # -- reads ---------------------------------------------------------------------------------

    def whereabouts(self, keys: Sequence[ChunkKey]) -> list[Whereabouts]:
        """What is known of each of `keys` (one hold of the lock for all): an L2 tier holding
        it, the tier it left, a lapsed store, another name under its hash in the same tenant
        and cache salt (another model or world size; never another tenant's or salt's)."""
        records, by_hash, make = self._records, self._by_hash, Whereabouts._make
        out: list[Whereabouts] = []
        with self._lock:
            for key in keys:
                record = records.get(key)  # type: ignore[call-overload]
                # Only the names of the lookup's own tenant and salt count (its composed salt
                # names both): whether another tenant or salt stored these tokens is theirs.
                salt = key.cache_salt
                other = any(o[1] == salt and o != key for o in by_hash.get(key.chunk_hash, ()))
                if record is None:
                    out.append(_UNKNOWN_OTHER if other else _UNKNOWN)
                    continue
                tiers, left, how, lapsed = record
                held = ""
                for tier in tiers:  # one or two
                    if tier != L1_TIER:
                        held = tier
                        break
                left = left or (L1_TIER if L1_TIER in tiers else "")
                cleared, declined = how is Removal.CLEARED, how is Removal.DECLINED
                out.append(make((held, left, cleared, declined, lapsed, other)))
        return out

    # -- internals -----------------------------------------------------------------------------

    def _touch(self, name: _Name) -> _Record:
        """The record of `name`, now the most recent (a new one for a name not known)."""
        record = self._records.get(name)
        if record is not None:
            self._records.move_to_end(name)
            return record
        self._records[name] = _NEW
        if len(self._records) > self.capacity:
            old, _ = self._records.popitem(last=False)
            self._unindex(old)
            self.forgotten += 1
        return _NEW

    def _unindex(self, name: _Name) -> None:
        names = self._by_hash.get(name[3])
        if names is None or name not in names:
            return
        rest = tuple(other for other in names if other != name)
        if rest:
            self._by_hash[name[3]] = rest
        else:
            del self._by_hash[name[3]]

"""The L1's index: its groups, their LRU order and eviction, per-tenant usage, clearing.

`L1Index` holds the state every part of `L1Store` works on (see `kvtier.storage.l1`); the write
path, the read path and pins are its subclasses, each in its own module.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvtier.errors import NoSpaceError
from kvtier.keys import ChunkKey
from kvtier.storage.admission import AdmissionPolicy
from kvtier.storage.allocator import Allocator
from kvtier.storage.l1.records import Group, Pin, Shard
from kvtier.storage.l1.stats import L1Stats, TenantUsage
from kvtier.storage.observers import L1_TIER, NO_OBSERVER, Removal, StorageObserver
from kvtier.storage.shares import Usage


class L1Index:
    """The groups of the L1 arena's `capacity` bytes, and what evicts them: groups that hold no
    staging shard and no pin sit in an LRU order and are evicted whole, least recent first,
    when a reservation needs room. Not thread-safe: one owner at a time.
    """

    def __init__(
        self,
        capacity: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[ChunkKey, int], None] | None = None,
        observer: StorageObserver = NO_OBSERVER,
        admission: AdmissionPolicy | None = None,
    ) -> None:
        """`on_evict(key, freed_bytes)` is called for each group evicted to make room;
        `observer` hears of every group that becomes complete (once every shard is a resume
        point, see `resume_prefix`) or stops being one (under the caller's lock: it must only
        record). `admission` decides which new groups are kept as cache (default: every one);
        the others are evicted first and never announced."""
        if capacity <= 0:
            raise ValueError(f"L1 capacity must be positive, got {capacity} (see --l1-size)")
        self._alloc = Allocator(capacity)
        self._clock = clock
        self._on_evict = on_evict
        self._observer = observer
        self._admission = admission if admission is not None else AdmissionPolicy()
        self._declined_evictions = 0
        self._groups: dict[ChunkKey, Group] = {}  # the live index: what readers find
        # Groups cleared while in use: out of the index, freed when their last user ends.
        self._doomed: set[Group] = set()
        # Evictable groups only (no staging shard, no hold), least recently used first.
        self._lru: OrderedDict[ChunkKey, Group] = OrderedDict()
        self._lru_bytes = 0
        # by (key, rank, owner): a cleared group's shard and a new one of its key may both stage
        self._staging: dict[tuple[ChunkKey, int, str], Shard] = {}
        self._staging_bytes = 0
        # The same shards by owner, so a client's end costs its own shards, not everyone's.
        self._by_owner: dict[str, dict[tuple[ChunkKey, int], Shard]] = {}
        self._usage: dict[str, Usage] = {}  # by tenant ("" anonymous)
        self._pins: dict[str, Pin] = {}
        # (deadline, seq, holder, pin), earliest first: what reclaim_pins looks at. A renewed
        # pin keeps its entry, which is put back with the new deadline when it comes up.
        self._pin_heap: list[tuple[float, int, str, Pin]] = []
        self._pin_seq = itertools.count()
        self._ready_groups = 0
        self._held_groups = 0
        self._evictions = 0
        self._evicted_bytes = 0
        self._fenced_slots = 0  # lapsed staging slots quarantined (see `fence`)
        self._fenced_bytes = 0

    # ---------------------------------------------------------------- sizes and stats

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    @property
    def num_groups(self) -> int:
        """Groups holding arena slots: those in the index and those cleared while in use."""
        return len(self._groups) + len(self._doomed)

    @property
    def num_ready_groups(self) -> int:
        return self._ready_groups

    def stats(self) -> L1Stats:
        """Counters for metrics and the status page."""
        return L1Stats(
            capacity_bytes=self._alloc.capacity,
            used_bytes=self._alloc.used_bytes,
            groups=len(self._groups) + len(self._doomed),
            ready_groups=self._ready_groups,
            staging_shards=len(self._staging),
            pinned_groups=self._held_groups,
            evictions=self._evictions,
            evicted_bytes=self._evicted_bytes,
            declined_evictions=self._declined_evictions,
            admission=self._admission.stats(),
            fenced_slots=self._fenced_slots,
            fenced_bytes=self._fenced_bytes,
            tenants=[
                self._tenant_usage(tenant, usage)
                for tenant, usage in sorted(self._usage.items())
                if usage.staging or usage.fenced or usage.pinned
            ],
        )

    def tenant_usage(self, tenant: str) -> TenantUsage:
        """The tenant's staging, quarantined and pinned bytes now."""
        usage = self._usage.get(tenant)
        return self._tenant_usage(tenant, usage or Usage())

    @staticmethod
    def _tenant_usage(tenant: str, usage: Usage) -> TenantUsage:
        return TenantUsage(
            tenant=tenant,
            staging_bytes=usage.staging,
            fenced_bytes=usage.fenced,
            pinned_bytes=usage.pinned,
        )

    def rounded(self, size: int) -> int:
        """The bytes a `size`-byte shard takes (whole pages): what a reserve charges."""
        return self._alloc.rounded(size)

    def _usage_of(self, tenant: str) -> Usage:
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = Usage()
        return usage

    # ---------------------------------------------------------------- maintenance

    def drop(self, key: ChunkKey) -> bool:
        """Remove a group unless it is pinned or has a staging shard; True if removed."""
        group = self._groups.get(key)
        if group is None or not self._lru_discard(group):
            return False
        if group.missing == 0 and group.admitted:
            self._observer.removed((key,), L1_TIER, Removal.DELETED)
        self._remove(group)
        return True

    def clear(self, *, model: str | None = None, cache_salt: str | None = None) -> int:
        """Remove every group of `model` and `cache_salt` (None: any) from view at once;
        returns how many. An idle group is freed now; one that is pinned, being read or written
        is invisible from now on and freed when the last of those ends (its slots stay put
        until then, so no reader or writer ever sees them reused)."""
        doomed = [
            group
            for key, group in self._groups.items()
            if not group.doomed
            and (model is None or key.model == model)
            and (cache_salt is None or key.cache_salt == cache_salt)
        ]
        complete = [group.key for group in doomed if group.missing == 0 and group.admitted]
        for group in doomed:
            if self._lru_discard(group):
                self._remove(group)
                continue
            if group.missing == 0:
                self._ready_groups -= 1
            # Out of the index, so that a new store of its key gets a new group and fresh
            # slots; this one keeps its slots for its pins, readers and writers until they end.
            del self._groups[group.key]
            group.doomed = True
            self._doomed.add(group)
        if complete:
            self._observer.removed(complete, L1_TIER, Removal.CLEARED)
        return len(doomed)

    def iter_keys(self) -> Iterator[ChunkKey]:
        """The keys of the live index (cleared groups left it), in its order: a plain dict
        iterator, which raises RuntimeError once the index changed size (see
        `server/observe/chunk_listing.py`, which walks it a slice per hold of the engine lock)."""
        return iter(self._groups)

    def iter_groups(self) -> Iterator[tuple[ChunkKey, int, bool]]:
        """(key, READY shards, pinned) for every group, over a snapshot of the index."""
        for group in list(self._groups.values()):
            yield group.key, group.key.world_size - group.missing, group.holds > 0

    # ---------------------------------------------------------------- internals

    def _lru_add(self, group: Group, *, most_recent: bool = True) -> None:
        self._lru[group.key] = group
        if not (most_recent and group.admitted):
            self._lru.move_to_end(group.key, last=False)
        self._lru_bytes += group.nbytes

    def _lru_discard(self, group: Group) -> bool:
        """Take the group out of the LRU order; False when it was not evictable."""
        if self._lru.pop(group.key, None) is None:
            return False
        self._lru_bytes -= group.nbytes
        return True

    def _hold(self, group: Group) -> None:
        if group.holds == 0:
            self._held_groups += 1
            self._lru_discard(group)
        group.holds += 1

    def _unhold(self, group: Group) -> None:
        group.holds -= 1
        if group.holds:
            return
        self._held_groups -= 1
        self._settle(group)

    def _settle(self, group: Group) -> None:
        """A group no longer held or staging goes back to the LRU order, or away when it has no
        shard left (all aborted while it was held) or was cleared meanwhile."""
        if group.staging or group.holds:
            return
        if group.doomed or group.missing == group.key.world_size:
            self._remove(group)
        else:
            self._lru_add(group)

    def _remove(self, group: Group) -> int:
        """Forget a group that is out of the LRU order and free its shards.

        Returns the size of the largest free range the freeing produced.
        """
        assert group.staging == 0 and group.holds == 0, "removing a busy group"
        if group.doomed:
            self._doomed.remove(group)
        else:
            del self._groups[group.key]
        if group.missing == 0 and not group.doomed:
            self._ready_groups -= 1
        largest = 0
        for shard in group.shards:
            if shard is not None:
                largest = max(largest, self._alloc.free(shard.offset, shard.nbytes))
        return largest

    def _make_room(self, size: int, nbytes: int) -> int:
        """Evict LRU groups until a contiguous `nbytes` range is free, and allocate it."""
        if nbytes <= self._alloc.free_bytes + self._lru_bytes:
            while self._lru:
                _, group = self._lru.popitem(last=False)
                self._lru_bytes -= group.nbytes
                largest = self._remove(group)
                self._evictions += 1
                self._evicted_bytes += group.nbytes
                self._declined_evictions += not group.admitted
                if group.missing == 0:
                    how = Removal.EVICTED if group.admitted else Removal.DECLINED
                    self._observer.removed((group.key,), L1_TIER, how)
                if self._on_evict is not None:
                    self._on_evict(group.key, group.nbytes)
                if largest >= nbytes:
                    offset = self._alloc.alloc(nbytes)
                    assert offset is not None
                    return offset
        raise NoSpaceError(self._no_space_message(size, nbytes))

    def _no_space_message(self, size: int, nbytes: int) -> str:
        # From running counts, not a scan: this is built under the engine lock, on the path a
        # flooding client makes busy. Held: ready shards out of the LRU order (pinned, being
        # read or written to L2, or in a group still waiting for another rank).
        staging, fenced = self._staging_bytes, self._fenced_bytes
        held = self._alloc.used_bytes - self._lru_bytes - staging - fenced
        return (
            f"L1 cannot hold a {size}-byte shard ({nbytes} bytes in pages): capacity"
            f" {self._alloc.capacity} bytes, {held} pinned or in use, {staging} staging,"
            f" {fenced} quarantined, {self._alloc.free_bytes} free (largest contiguous"
            f" {self._alloc.largest_free}) and nothing else to evict; raise --l1-size or lower"
            " the concurrency"
        )

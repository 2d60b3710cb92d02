"""The L1 index: which chunk shards live where in the shared-memory arena, and what to evict.

`L1Store` is bookkeeping only: it hands out arena offsets from an `Allocator` and tracks shard
states, pins and recency; clients copy the bytes themselves. It is single-owner and not
thread-safe: the server engine calls it only while holding its engine lock, so every method
costs in proportion to what it touches (an owner's shards, the pins that expire), never to the
whole index.

It also counts, per tenant, the bytes that no eviction can take back: staging slots, quarantined
(fenced) slots and pinned groups (`tenant_usage`). The server's shares (`server/stores.py`,
`server/lookups.py`) are checked against these counts.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

import msgspec

from kvtier.errors import NoSpaceError, UnknownReservationError
from kvtier.keys import ChunkKey
from kvtier.storage.admission import AdmissionPolicy, AdmissionStats
from kvtier.storage.allocator import Allocator
from kvtier.storage.observers import L1_TIER, NO_OBSERVER, Removal, StorageObserver
from kvtier.storage.shares import UNBOUNDED, TenantBounds, Usage, check_staging

__all__ = [
    "UNBOUNDED",
    "Held",
    "L1Store",
    "OwnerSeen",
    "ShardState",
    "TenantBounds",
    "stored_holder",
]

#: (pin holder, its owner) -> when the owner was last seen (the L1's clock), None when gone
OwnerSeen = Callable[[str, str], float | None]


def stored_holder(request_id: str) -> str:
    """The pin holder of the chunks a request stored that the cache policy declined (they stay
    readable for the request while it lives)."""
    return request_id + "\x00stored"


class TenantUsage(msgspec.Struct, frozen=True, kw_only=True):
    """What one tenant holds in L1 against its shares ("" is the anonymous tenant)."""

    tenant: str
    staging_bytes: int  # reserved, not committed (--tenant-staging-share)
    fenced_bytes: int  # quarantined (--tenant-quarantine-share, with staging_bytes)
    pinned_bytes: int  # groups its lookups pin (--tenant-pinned-share)


class L1Stats(msgspec.Struct, frozen=True, kw_only=True):
    """The shared-memory L1 at one instant."""

    capacity_bytes: int
    used_bytes: int
    groups: int  # chunk groups held (a group is one chunk's shards, one per rank)
    ready_groups: int  # groups whose every rank's shard is committed
    staging_shards: int  # shards reserved and not yet committed
    pinned_groups: int  # groups a lookup pinned against eviction
    evictions: int
    evicted_bytes: int
    declined_evictions: int = 0  # of those, groups the admission policy had declined
    admission: AdmissionStats | None = None  # the cache policy's decisions
    fenced_slots: int = 0  # lapsed slots quarantined until their owner can no longer touch them
    fenced_bytes: int = 0
    tenants: list[TenantUsage] = msgspec.field(default_factory=list)  # with anything held


class ShardState(enum.Enum):
    """STAGING: reserved and being written, invisible to readers. READY: readable."""

    STAGING = "staging"
    READY = "ready"


class _Shard:
    __slots__ = (
        "deadline",
        "group",
        "layout",
        "nbytes",
        "offset",
        "owner",
        "replaces",
        "resumable",
        "size",
        "state",
        "tenant",
    )

    def __init__(
        self,
        offset: int,
        size: int,
        nbytes: int,
        layout: str,
        owner: str,
        deadline: float,
        tenant: str,
        resumable: bool,
        group: _Group,
    ) -> None:
        self.group = group  # the group it belongs to (a cleared one too: see `L1Store.clear`)
        self.offset = offset
        self.size = size  # bytes asked for: what a reader copies
        self.nbytes = nbytes  # bytes allocated (page-rounded): what counts against capacity
        self.layout = layout
        self.owner = owner
        self.deadline = deadline
        self.tenant = tenant  # whose staging bytes it counts in while STAGING
        self.resumable = resumable  # a point the engine can resume from (see `resume_prefix`)
        # A READY shard that is no resume point, stepped aside for this one: freed when this one
        # commits, put back should it be aborted or fenced.
        self.replaces: _Shard | None = None
        self.state = ShardState.STAGING


class _Group:
    __slots__ = (
        "admitted",
        "charged",
        "doomed",
        "holds",
        "key",
        "missing",
        "nbytes",
        "pin_tenant",
        "pins",
        "refs",
        "shards",
        "staging",
        "unresumable",
    )

    def __init__(self, key: ChunkKey) -> None:
        self.admitted = True  # kept as cache (see storage/admission.py); else cold, unannounced
        self.key = key
        self.shards: list[_Shard | None] = [None] * key.world_size
        self.missing = key.world_size  # shards not READY; 0 means the group is a hit
        self.staging = 0
        self.unresumable = 0  # shards that are no resume point: the group is one when 0
        self.holds = 0  # holder pins plus anonymous refs; > 0 means never evicted
        self.refs = 0  # anonymous refs alone, to check release() against acquire()
        self.pins = 0  # pins holding it: the first charges its bytes to its tenant
        self.pin_tenant = ""
        self.charged = 0  # bytes charged to pin_tenant's pinned bytes while pins > 0
        self.nbytes = 0
        # Cleared while busy: out of the index at once (its key may be stored again, into a new
        # group), its slots kept until the last hold or staging shard ends, then freed.
        self.doomed = False


#: an anonymous hold on one group (`L1Store.acquire`), given back by `L1Store.release`
Held = _Group


class _Pin:
    __slots__ = (
        "deadline",
        "groups",
        "lease_s",
        "owner",
        "queued",
        "ranks",
        "readers",
        "tenant",
    )

    def __init__(
        self,
        groups: list[_Group],
        ranks: set[int],
        deadline: float,
        tenant: str,
        owner: str,
        lease_s: float,
    ) -> None:
        self.groups = groups
        self.ranks = ranks
        self.readers = len(ranks)  # the ranks it was made for: range(readers)
        self.deadline = deadline
        self.tenant = tenant
        self.owner = owner  # the client that made it: its pin lives while that client does
        self.lease_s = lease_s
        self.queued = deadline  # the deadline its entry in the expiry heap carries


class L1Store:
    """Allocation, shard states, pins and LRU eviction for the L1 arena's `capacity` bytes.

    Groups that hold no staging shard and no pin sit in an LRU order and are evicted whole,
    least recent first, when a reservation needs room. Not thread-safe: one owner at a time.
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
        `observer` hears of every group that becomes complete or stops being one (under the
        caller's lock: it must only record). `admission` decides which new groups are kept as
        cache (default: every one); the others are evicted first and never announced."""
        if capacity <= 0:
            raise ValueError(f"L1 capacity must be positive, got {capacity} (see --l1-size)")
        self._alloc = Allocator(capacity)
        self._clock = clock
        self._on_evict = on_evict
        self._observer = observer
        self._admission = admission if admission is not None else AdmissionPolicy()
        self._declined_evictions = 0
        self._groups: dict[ChunkKey, _Group] = {}  # the live index: what readers find
        # Groups cleared while in use: out of the index, freed when their last user ends.
        self._doomed: set[_Group] = set()
        # Evictable groups only (no staging shard, no hold), least recently used first.
        self._lru: OrderedDict[ChunkKey, _Group] = OrderedDict()
        self._lru_bytes = 0
        # by (key, rank, owner): a cleared group's shard and a new one of its key may both stage
        self._staging: dict[tuple[ChunkKey, int, str], _Shard] = {}
        self._staging_bytes = 0
        # The same shards by owner, so a client's end costs its own shards, not everyone's.
        self._by_owner: dict[str, dict[tuple[ChunkKey, int], _Shard]] = {}
        self._usage: dict[str, Usage] = {}  # by tenant ("" anonymous)
        self._pins: dict[str, _Pin] = {}
        # (deadline, seq, holder, pin), earliest first: what reclaim_pins looks at. A renewed
        # pin keeps its entry, which is put back with the new deadline when it comes up.
        self._pin_heap: list[tuple[float, int, str, _Pin]] = []
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

    # ---------------------------------------------------------------- write path

    def reserve(
        self,
        key: ChunkKey,
        worker_id: int,
        size: int,
        *,
        owner: str,
        lease_s: float,
        layout: str = "",
        tenant: str = "",
        bounds: TenantBounds = UNBOUNDED,
        resumable: bool = True,
        admit: bool | None = None,
    ) -> int | None:
        """Reserve a STAGING shard of `size` bytes and return its offset; its bytes count as
        `tenant`'s staging bytes until it is committed, aborted or fenced. `resumable`: whether
        the shard carries a resume point (see `resume_prefix`).

        Returns None when the shard already exists (staging or ready): there is nothing to
        write; except that a resume point replaces a READY shard that is none, when nothing
        holds its group (the old one serves again should the new one never commit).
        NoSpaceError when it would take the tenant past its `bounds` (then nothing is evicted
        for it), or when evicting LRU groups cannot make room. A new group is kept as cache
        when `admit` says so (None: when the admission policy does).
        """
        if size <= 0:
            raise ValueError(f"shard size must be positive, got {size}")
        if not 0 <= worker_id < key.world_size:
            raise ValueError(f"worker_id {worker_id} is outside range({key.world_size})")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        group = self._groups.get(key)
        old = None if group is None else group.shards[worker_id]
        if (key, worker_id, owner) in self._staging:  # it writes this rank of a cleared group
            return None
        if group is not None and old is not None and not self._replaceable(group, old, resumable):
            return None
        nbytes = self._alloc.rounded(size)
        if bounds is not UNBOUNDED:
            check_staging(self._usage.get(tenant) or Usage(), tenant, size, nbytes, bounds)
        offset = self._alloc.alloc(nbytes)
        if offset is None:
            # The group we add to must not be evicted to make room for its own shard.
            was_evictable = group is not None and self._lru_discard(group)
            try:
                offset = self._make_room(size, nbytes)
            except BaseException:  # NoSpaceError, or whatever on_evict raised
                if was_evictable:
                    assert group is not None
                    self._lru_add(group)
                raise
        elif group is not None:
            self._lru_discard(group)
        if group is None:
            group = self._groups[key] = _Group(key)
            chunks = self._alloc.capacity // (nbytes * key.world_size)
            if chunks != self._admission.capacity_chunks:
                self._admission.set_capacity(chunks)
            group.admitted = admit if admit is not None else self._admission.admits(key)
        shard = _Shard(
            offset, size, nbytes, layout, owner, self._clock() + lease_s, tenant, resumable, group
        )
        if old is not None:  # steps aside: the group is incomplete until the new one commits
            shard.replaces = old
            group.unresumable -= 1
            if group.missing == 0:
                self._ready_groups -= 1
            group.missing += 1
        group.shards[worker_id] = shard
        group.staging += 1
        group.unresumable += not resumable
        group.nbytes += nbytes
        self._staging[key, worker_id, owner] = shard
        self._staging_bytes += nbytes
        self._by_owner.setdefault(owner, {})[key, worker_id] = shard
        self._usage_of(tenant).staging += nbytes
        return offset

    @staticmethod
    def _replaceable(group: _Group, old: _Shard | None, resumable: bool) -> bool:
        """Whether a new shard may replace `old`: a resume point for a READY shard that is
        none, in a group nothing holds (no pin, retrieve or L2 write waits on its bytes)."""
        return (
            old is not None
            and resumable
            and not old.resumable
            and old.state is ShardState.READY
            and group.holds == 0
        )

    def _unstage(self, key: ChunkKey, worker_id: int, shard: _Shard) -> None:
        """Take a shard out of the staging index and its tenant's staging bytes."""
        del self._staging[key, worker_id, shard.owner]
        self._staging_bytes -= shard.nbytes
        owned = self._by_owner[shard.owner]
        del owned[key, worker_id]
        if not owned:
            del self._by_owner[shard.owner]
        self._usage_of(shard.tenant).staging -= shard.nbytes

    def commit(
        self, key: ChunkKey, worker_id: int, *, owner: str, resumable: bool | None = None
    ) -> bool:
        """Make a staging shard READY; True when that completed the whole group. `resumable`
        (None: as reserved) is for writers that learn it with the bytes (an L2 read).

        A shard whose lease expired but was not reclaimed yet still commits.
        """
        shard = self._staged(key, worker_id, owner)
        self._unstage(key, worker_id, shard)
        shard.state = ShardState.READY
        group = shard.group
        old, shard.replaces = shard.replaces, None
        if old is not None:
            self._alloc.free(old.offset, old.nbytes)
            group.nbytes -= old.nbytes
        if resumable is not None and resumable != shard.resumable:
            shard.resumable = resumable
            group.unresumable += -1 if resumable else 1
        group.staging -= 1
        group.missing -= 1
        complete = group.missing == 0 and not group.doomed
        if complete:
            self._ready_groups += 1
            if group.admitted:
                self._observer.stored((key,), L1_TIER)
        self._settle(group)
        return complete

    def abort(self, key: ChunkKey, worker_id: int, *, owner: str) -> None:
        """Drop a staging shard (the writer gave up) and free its range."""
        self._drop_staging(key, worker_id, self._staged(key, worker_id, owner))

    def fence(self, key: ChunkKey, worker_id: int, *, owner: str) -> tuple[int, int]:
        """Quarantine a lapsed staging shard whose writer may still be copying into it.

        The shard leaves its group (the chunk is not stored; another client may store it into a
        fresh slot), but its arena range stays allocated, so nothing else is placed where the
        late writer's bytes may land. Its bytes move from the tenant's staging bytes to its
        quarantined ones. Returns (offset, nbytes) for `unfence`.
        """
        shard = self._staged(key, worker_id, owner)
        self._detach_staging(key, worker_id, shard)
        self._fenced_slots += 1
        self._fenced_bytes += shard.nbytes
        self._usage_of(shard.tenant).fenced += shard.nbytes
        return shard.offset, shard.nbytes

    def unfence(self, offset: int, nbytes: int, *, tenant: str = "") -> None:
        """Free a quarantined slot of `tenant`: its writer acknowledged or its process is gone."""
        self._alloc.free(offset, nbytes)
        self._fenced_slots -= 1
        self._fenced_bytes -= nbytes
        self._usage_of(tenant).fenced -= nbytes

    def is_busy(self, key: ChunkKey, worker_id: int, owner: str | None = None) -> bool:
        """True while the shard is being written (staging), or `owner` still writes this rank
        of a group cleared meanwhile: a store of it now would not make it stored. A group
        cleared while in use is not busy otherwise: its key can be stored again at once."""
        if owner is not None and (key, worker_id, owner) in self._staging:
            return True
        group = self._groups.get(key)
        if group is None:
            return False
        shard = group.shards[worker_id] if 0 <= worker_id < key.world_size else None
        return shard is not None and shard.state is ShardState.STAGING

    def _staged(self, key: ChunkKey, worker_id: int, owner: str) -> _Shard:
        """The owner's staging shard of that rank; UnknownReservationError when it has none."""
        shard = self._staging.get((key, worker_id, owner))
        if shard is not None:
            return shard
        group = self._groups.get(key)
        other = group.shards[worker_id] if group and 0 <= worker_id < key.world_size else None
        staging = other if other is not None and other.state is ShardState.STAGING else None
        raise UnknownReservationError(self._unknown(key, worker_id, owner, staging))

    def reclaim_staging(self, owner: str | None = None) -> int:
        """Drop staging shards: all of `owner`'s, or with owner None every expired one.

        Returns how many were dropped.
        """
        if owner is None:
            now = self._clock()
            doomed = [((k, w), s) for (k, w, _), s in self._staging.items() if s.deadline <= now]
        else:  # the owner's own shards only (indexed), not a scan of everyone's
            doomed = list(self._by_owner.get(owner, {}).items())
        for (key, worker_id), shard in doomed:
            self._drop_staging(key, worker_id, shard)
        return len(doomed)

    # ---------------------------------------------------------------- read path

    def is_complete(self, key: ChunkKey) -> bool:
        """True when every rank's shard of the group is READY."""
        group = self._groups.get(key)
        return group is not None and group.missing == 0 and not group.doomed

    def count_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys of a hash chain are complete groups."""
        get = self._groups.get
        n = 0
        for key in keys:
            group = get(key)
            if group is None or group.missing or group.doomed:
                break
            n += 1
        return n

    def ready_shards(self, keys: Sequence[ChunkKey]) -> list[int]:
        """How many ranks' shards of each group are READY (0 when absent or cleared)."""
        get = self._groups.get
        out = []
        for key in keys:
            group = get(key)
            out.append(0 if group is None or group.doomed else key.world_size - group.missing)
        return out

    def resume_prefix(self, keys: Sequence[ChunkKey], complete: int | None = None) -> int:
        """How many leading keys an engine can resume after: the leading complete groups
        (`complete` of them, when the caller counted them), up to the last one whose every
        shard is a resume point."""
        n = self.count_prefix(keys) if complete is None else complete
        get = self._groups.get
        while n:
            group = get(keys[n - 1])
            if group is not None and not group.unresumable:
                break
            n -= 1
        return n

    def is_resumable(self, key: ChunkKey, worker_id: int) -> bool:
        """Whether the rank's shard is a resume point (False when there is none)."""
        group = self._groups.get(key)
        shard = None if group is None else group.shards[worker_id]
        return shard is not None and shard.resumable

    def complete_each(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Per key, whether it is a complete group (as `count_prefix`, past a gap too)."""
        get = self._groups.get
        out: list[bool] = []
        for key in keys:
            group = get(key)
            out.append(group is not None and not group.missing and not group.doomed)
        return out

    def get_shard(self, key: ChunkKey, worker_id: int) -> tuple[int, int, str] | None:
        """(offset, size, layout) of a READY shard, else None."""
        group = self._groups.get(key)
        if group is None or group.doomed or not 0 <= worker_id < key.world_size:
            return None
        shard = group.shards[worker_id]
        if shard is None or shard.state is not ShardState.READY:
            return None
        return shard.offset, shard.size, shard.layout

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark a hash chain [c0, c1, ...] used: c0 ends most recent, the tail is evicted first.

        Once chunk i is gone the chunks after it can never be hit, so the tail should go first.
        Keys not in L1, and pinned or staging groups, are skipped (they are not in the LRU order).
        Groups the admission policy declined stay where they are (evicted first).
        """
        lru = self._lru
        move = lru.move_to_end
        for key in reversed(keys):
            group = lru.get(key)
            if group is not None and group.admitted:
                move(key)

    def observe_lookup(self, keys: Sequence[ChunkKey], request_id: str | None = None) -> None:
        """A lookup (of `request_id`) asked for this hash chain: the admission policy learns of
        it, and declined groups it now admits become cache (announced when complete)."""
        self._admission.observe(keys, request_id)
        groups = self._groups
        for key in keys:
            group = groups.get(key)
            if group is None or group.admitted or not self._admission.would_admit(key):
                continue
            group.admitted = True
            if group.missing == 0 and not group.doomed:
                self._observer.stored((key,), L1_TIER)

    def is_admitted(self, key: ChunkKey) -> bool:
        """Whether the group is kept as cache (False: declined, or not in L1)."""
        group = self._groups.get(key)
        return group is not None and group.admitted

    def admission_stats(self) -> AdmissionStats:
        return self._admission.stats()

    # ---------------------------------------------------------------- pins

    def pin(
        self,
        holder: str,
        keys: Sequence[ChunkKey],
        *,
        ranks: Iterable[int],
        lease_s: float,
        tenant: str = "",
        max_bytes: int | None = None,
        owner: str = "",
    ) -> int:
        """Pin the groups of `keys` that are in L1 for `holder`, replacing its previous pin;
        returns how many groups it pins. `owner`: the client it is pinned for (see
        `reclaim_pins`).

        A group's bytes count once against the pinned bytes of the tenant that pinned it first,
        however many of its pins hold it. With `max_bytes`, only the leading groups that keep
        `tenant`'s pinned bytes within it are pinned (groups it pins already cost nothing).
        `ranks` are the workers that still have to retrieve; the pin is released when all of
        them called `mark_retrieved`, by `unpin`, or when the lease expires (`reclaim_pins`).
        """
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        pending = set(ranks)
        get = self._groups.get
        groups = [g for g in map(get, keys) if g is not None and not g.doomed]
        if max_bytes is not None:
            room = max_bytes - self._usage_of(tenant).pinned
            for n, group in enumerate(groups):
                if group.pins == 0:  # not yet charged to anyone
                    room -= group.nbytes
                    if room < 0:
                        del groups[n:]
                        break
        deadline = self._clock() + lease_s
        old = self._pins.get(holder)
        if old is not None and old.groups == groups:
            # A repeated lookup of the same prompt (the common case): the same groups are held
            # already, so only the pending ranks and the lease start over.
            old.ranks, old.readers = pending, len(pending)
            old.owner, old.lease_s = owner, lease_s
            self._set_deadline(holder, old, deadline)
            return len(groups)
        self._hold_pinned(groups, tenant)
        # Release the old groups after taking the new ones, so groups in both stay held.
        if old is None:
            pin = self._pins[holder] = _Pin(groups, pending, deadline, tenant, owner, lease_s)
            heapq.heappush(self._pin_heap, (deadline, next(self._pin_seq), holder, pin))
            self._compact_pin_heap()
        else:
            released, old.groups, old.ranks = old.groups, groups, pending
            old.readers, old.owner, old.lease_s = len(pending), owner, lease_s
            self._set_deadline(holder, old, deadline)
            self._release_groups(released)
        return len(groups)

    def mark_retrieved(self, holder: str, worker_id: int) -> bool:
        """Rank `worker_id` finished retrieving; True when that released the holder's pin."""
        pin = self._pins.get(holder)
        if pin is None:
            return False
        pin.ranks.discard(worker_id)
        if pin.ranks:
            return False
        del self._pins[holder]
        self._release_pin(pin)
        return True

    def pin_readers(self, holder: str) -> int:
        """How many ranks the holder's pin was made for (0: it holds none)."""
        pin = self._pins.get(holder)
        return 0 if pin is None else pin.readers

    def unpin(self, holder: str) -> bool:
        """Release the holder's pin; False when it holds none."""
        pin = self._pins.pop(holder, None)
        if pin is None:
            return False
        self._release_pin(pin)
        return True

    def renew(self, holder: str, lease_s: float) -> None:
        """Extend the holder's pin to `lease_s` from now; UnknownReservationError if it has none."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        pin = self._pins.get(holder)
        if pin is None:
            raise UnknownReservationError(f"holder {holder!r} has no pin (expired or released)")
        self._set_deadline(holder, pin, self._clock() + lease_s)

    def reclaim_pins(self, owner_seen: OwnerSeen | None = None) -> list[str]:
        """Release every pin whose lease expired; returns their holders.

        The lease counts from the owner's last sign of life: for a pin whose lease ran out,
        `owner_seen(holder, owner)` tells when its owner was last seen (None: gone), and a pin
        whose owner was seen less than its lease ago is kept until a lease after that. So what
        a lookup reported stays pinned while the client that asked lives, however long the
        request waits; a dead client's pins lapse a lease after its last sign of life.

        Costs the heap entries that came due (expired pins, renewed ones put back, released
        ones dropped), not the number of pins.
        """
        now = self._clock()
        heap = self._pin_heap
        lapsed: list[str] = []
        while heap and heap[0][0] <= now:
            due, _, holder, pin = heapq.heappop(heap)
            if self._pins.get(holder) is not pin or due != pin.queued:
                continue  # released or replaced, or a duplicate entry of a shortened lease
            if pin.deadline <= now and owner_seen is not None and pin.owner:
                seen = owner_seen(holder, pin.owner)
                if seen is not None:
                    pin.deadline = max(pin.deadline, seen + pin.lease_s)
            if pin.deadline <= now:
                del self._pins[holder]
                self._release_pin(pin)
                lapsed.append(holder)
            else:  # renewed since: due again at its new deadline
                pin.queued = pin.deadline
                heapq.heappush(heap, (pin.deadline, next(self._pin_seq), holder, pin))
        return lapsed

    def _set_deadline(self, holder: str, pin: _Pin, deadline: float) -> None:
        pin.deadline = deadline
        if deadline < pin.queued:  # earlier than its heap entry says: a new entry
            pin.queued = deadline
            heapq.heappush(self._pin_heap, (deadline, next(self._pin_seq), holder, pin))

    def _compact_pin_heap(self) -> None:
        """Drop the entries of released pins once they outnumber the live ones (amortized)."""
        if len(self._pin_heap) <= 2 * len(self._pins) + 1024:
            return
        self._pin_heap = [
            entry
            for entry in self._pin_heap
            if self._pins.get(entry[2]) is entry[3] and entry[0] == entry[3].queued
        ]
        heapq.heapify(self._pin_heap)

    def pinned_keys(self, holder: str) -> list[ChunkKey]:
        """The keys the holder's pin actually holds (those that were in L1 when pinned)."""
        pin = self._pins.get(holder)
        return [] if pin is None else [group.key for group in pin.groups]

    def acquire(self, key: ChunkKey) -> Held:
        """Take an anonymous hold on a group (e.g. an L2 write-through in flight); give it back
        with `release(held)`. The hold names the group, not its key: should the group be
        cleared meanwhile and its key stored again, the release still ends this group's."""
        group = self._groups.get(key)
        if group is None:
            raise KeyError(f"cannot acquire {key}: not in L1")
        group.refs += 1
        self._hold(group)
        return group

    def release(self, held: Held) -> None:
        """Drop one anonymous hold taken by `acquire`."""
        if held.refs == 0 or (held.doomed and held not in self._doomed):
            raise ValueError(f"release of {held.key} without a matching acquire")
        if not held.doomed and self._groups.get(held.key) is not held:
            raise ValueError(f"release of {held.key} without a matching acquire")
        held.refs -= 1
        self._unhold(held)

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

    def _lru_add(self, group: _Group, *, most_recent: bool = True) -> None:
        self._lru[group.key] = group
        if not (most_recent and group.admitted):
            self._lru.move_to_end(group.key, last=False)
        self._lru_bytes += group.nbytes

    def _lru_discard(self, group: _Group) -> bool:
        """Take the group out of the LRU order; False when it was not evictable."""
        if self._lru.pop(group.key, None) is None:
            return False
        self._lru_bytes -= group.nbytes
        return True

    def _hold(self, group: _Group) -> None:
        if group.holds == 0:
            self._held_groups += 1
            self._lru_discard(group)
        group.holds += 1

    def _unhold(self, group: _Group) -> None:
        group.holds -= 1
        if group.holds:
            return
        self._held_groups -= 1
        self._settle(group)

    def _settle(self, group: _Group) -> None:
        """A group no longer held or staging goes back to the LRU order, or away when it has no
        shard left (all aborted while it was held) or was cleared meanwhile."""
        if group.staging or group.holds:
            return
        if group.doomed or group.missing == group.key.world_size:
            self._remove(group)
        else:
            self._lru_add(group)

    def _release_pin(self, pin: _Pin) -> None:
        self._release_groups(pin.groups)

    def _release_groups(self, groups: list[_Group]) -> None:
        # Admitted groups reversed, so the chain head is released last and ends most recent
        # (see `touch`); declined ones go to the cold end head first, so their tail ends
        # coldest and leaves first there too.
        order = [g for g in groups if not g.admitted]
        order += [g for g in reversed(groups) if g.admitted]
        for group in order:
            group.pins -= 1
            if group.pins == 0:
                self._usage_of(group.pin_tenant).pinned -= group.charged
                group.charged = 0
            self._unhold(group)

    def _hold_pinned(self, groups: list[_Group], tenant: str) -> None:
        """Hold each group for one more pin (as `_hold`); one no pin held yet is charged to
        `tenant`. One loop without calls: a lookup pins every chunk of its prompt (64 groups for
        16k tokens), and two calls per group were a third of its pinning time."""
        usage = self._usage_of(tenant)
        discard = self._lru.pop
        for group in groups:
            if group.holds == 0:
                self._held_groups += 1
                if discard(group.key, None) is not None:
                    self._lru_bytes -= group.nbytes
            group.holds += 1
            if group.pins == 0:
                group.pin_tenant = tenant
                group.charged = group.nbytes
                usage.pinned += group.nbytes
            group.pins += 1

    def _drop_staging(self, key: ChunkKey, worker_id: int, shard: _Shard) -> None:
        self._detach_staging(key, worker_id, shard)
        self._alloc.free(shard.offset, shard.nbytes)

    def _detach_staging(self, key: ChunkKey, worker_id: int, shard: _Shard) -> None:
        """Take a staging shard out of its group (the caller frees or quarantines its range)."""
        self._unstage(key, worker_id, shard)
        group = shard.group
        group.shards[worker_id] = None
        group.staging -= 1
        group.unresumable -= not shard.resumable
        group.nbytes -= shard.nbytes
        old, shard.replaces = shard.replaces, None
        if old is not None:  # the shard it was to replace serves again
            group.shards[worker_id] = old
            group.unresumable += 1
            group.missing -= 1
            if group.missing == 0 and not group.doomed:
                self._ready_groups += 1
        if group.staging or group.holds:
            return
        if group.doomed or group.missing == key.world_size:
            self._remove(group)
        else:
            # Ready shards without this rank's cannot be hit until it is stored again.
            self._lru_add(group, most_recent=False)

    def _remove(self, group: _Group) -> int:
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

    @staticmethod
    def _unknown(key: ChunkKey, worker_id: int, owner: str, shard: _Shard | None) -> str:
        if shard is None:
            return f"no staging reservation for rank {worker_id} of {key} (expired or never made)"
        return (
            f"the reservation for rank {worker_id} of {key} belongs to {shard.owner!r},"
            f" not {owner!r}"
        )

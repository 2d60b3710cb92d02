"""The L1's write path: staging slots reserved, committed, aborted, fenced and reclaimed."""

from __future__ import annotations

from kvtier.errors import UnknownReservationError
from kvtier.keys import ChunkKey
from kvtier.storage.l1.index import L1Index
from kvtier.storage.l1.records import Group, Shard, ShardState
from kvtier.storage.observers import L1_TIER
from kvtier.storage.shares import UNBOUNDED, TenantBounds, Usage, check_staging


class L1Writes(L1Index):
    """Staging shards: reserved by a writer, READY once committed (see `L1Store`)."""

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
            group = self._groups[key] = Group(key)
            chunks = self._alloc.capacity // (nbytes * key.world_size)
            if chunks != self._admission.capacity_chunks:
                self._admission.set_capacity(chunks)
            group.admitted = admit if admit is not None else self._admission.admits(key)
        shard = Shard(
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
    def _replaceable(group: Group, old: Shard | None, resumable: bool) -> bool:
        """Whether a new shard may replace `old`: a resume point for a READY shard that is
        none, in a group nothing holds (no pin, retrieve or L2 write waits on its bytes)."""
        return (
            old is not None
            and resumable
            and not old.resumable
            and old.state is ShardState.READY
            and group.holds == 0
        )

    def _unstage(self, key: ChunkKey, worker_id: int, shard: Shard) -> None:
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
            # observers (KV events for routers) hear of a chunk a lookup can resume after: one
            # that is no resume point (a Mamba state missing at its end) stays unannounced
            # until a resume point replaces it
            if group.admitted and not group.unresumable:
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

    def _staged(self, key: ChunkKey, worker_id: int, owner: str) -> Shard:
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

    def _drop_staging(self, key: ChunkKey, worker_id: int, shard: Shard) -> None:
        self._detach_staging(key, worker_id, shard)
        self._alloc.free(shard.offset, shard.nbytes)

    def _detach_staging(self, key: ChunkKey, worker_id: int, shard: Shard) -> None:
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

    @staticmethod
    def _unknown(key: ChunkKey, worker_id: int, owner: str, shard: Shard | None) -> str:
        if shard is None:
            return f"no staging reservation for rank {worker_id} of {key} (expired or never made)"
        return (
            f"the reservation for rank {worker_id} of {key} belongs to {shard.owner!r},"
            f" not {owner!r}"
        )

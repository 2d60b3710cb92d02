"""The L1's read path: what lookups and retrieves ask of it, and what their asking teaches the
LRU order and the admission policy."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.keys import ChunkKey
from kvtier.storage.admission import AdmissionStats
from kvtier.storage.l1.index import L1Index
from kvtier.storage.l1.records import ShardState
from kvtier.storage.observers import L1_TIER


class L1Reads(L1Index):
    """Completeness, resume points and shard places (see `L1Store`)."""

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
            if group.missing == 0 and not group.doomed and not group.unresumable:
                self._observer.stored((key,), L1_TIER)

    def is_admitted(self, key: ChunkKey) -> bool:
        """Whether the group is kept as cache (False: declined, or not in L1)."""
        group = self._groups.get(key)
        return group is not None and group.admitted

    def admission_stats(self) -> AdmissionStats:
        return self._admission.stats()

"""Hand-off objects: the KV of one prompt that a prefill instance stores for one decode instance.

A hand-off is a set of named chunks (`ReserveKeys` / `StoreKeysInline` with `handoff`) under the
hand-off's id (the request's `request_id`). Its chunks are stored whatever the cache policy says,
and each commit pins them under the hand-off's holder for `--handoff-lease` seconds, counted from
the commit and never renewed by the writer's heartbeats (a decoder that never comes must not hold
memory for ever). `EndHandoff` (the decoder has read it) or the lease's lapse frees them: unpinned
and dropped from L1, and deleted from the L2 tiers (outside the lock). Their names are derived
from the hand-off id, so no prefix-cache lookup (token-addressed) can ever hit them.

Once a shared tier (Redis, Valkey, Mooncake: one another server can read) holds a chunk, the L1
pin on it is released: L1 keeps it as cache a local decoder still reads while it is resident,
and a decoder on another machine reads the shared tier anyway. The lease goes on (from the last
commit) for the deletion: the hand-off still ends when read or when its lease lapses.

Locking: `committed`, `end`, `lapsed` and `release_shared` run under the engine lock, which the
caller holds; `delete_l2` does tier I/O and runs outside it; `stored` (the storage observer's
call, from the L2 writer's thread) only appends to a queue.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.keys import ChunkKey, compose
from kvtier.storage.observers import Removal

if TYPE_CHECKING:  # type-only: metrics imports routes, which reach this book through the engine
    from kvtier.server.observe.metrics import Metrics
    from kvtier.storage.l1 import L1Store
    from kvtier.storage.manager import TierManager

__all__ = ["HANDOFF_PREFIX", "HandoffBook", "handoff_holder"]

#: the prefix of a hand-off's pin holder (session pins are composed ids, never this)
HANDOFF_PREFIX = "handoff:"


def handoff_holder(tenant: str, handoff_id: str) -> str:
    """The pin holder of hand-off `handoff_id` in `tenant`'s namespace."""
    return HANDOFF_PREFIX + compose(tenant, handoff_id)


@dataclass
class _Held:
    """One hand-off's chunks: all it stored (to delete at its end), those still pinned in L1
    (not yet in a shared tier), whose namespace pins them, and when its lease lapses."""

    tenant: str
    deadline: float
    chunks: list[ChunkKey] = field(default_factory=list)
    shared: set[ChunkKey] = field(default_factory=set)

    def pinned(self) -> list[ChunkKey]:
        return [k for k in self.chunks if k not in self.shared]


class HandoffBook:
    """The hand-offs a server holds: their pins, their end, their lapse, and their counts.

    It is also a storage observer (`stored`, `removed`, `cleared`): it hears which hand-off
    chunks reached a shared tier, to release their L1 pins (`release_shared`).
    """

    def __init__(
        self,
        *,
        l1: L1Store,
        tiers: TierManager,
        metrics: Metrics,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._l1 = l1
        self._tiers = tiers
        self._metrics = metrics
        self._lease_s = lease_s
        self._clock = clock
        self._held: dict[str, _Held] = {}  # holder -> its hand-off
        self._shared_tiers = frozenset(t.name for t in tiers.tiers if t.shared)
        self._in_shared: deque[ChunkKey] = deque()  # appended by the L2 writer's thread

    @staticmethod
    def holder(tenant: str, handoff_id: str) -> str:
        """The pin holder of hand-off `handoff_id` in `tenant`'s namespace."""
        return handoff_holder(tenant, handoff_id)

    @property
    def num_held(self) -> int:
        """Hand-offs stored and not yet read nor lapsed."""
        return len(self._held)

    def committed(self, holder: str, keys: Sequence[ChunkKey], *, tenant: str, nbytes: int) -> None:
        """Under the lock: a commit of the hand-off's chunks; they are pinned with the ones it
        committed before, for a lease from now."""
        deadline = self._clock() + self._lease_s
        held = self._held.get(holder)
        if held is None:
            held = self._held[holder] = _Held(tenant, deadline)
        held.deadline = deadline
        known = set(held.chunks)
        held.chunks.extend(k for k in keys if k not in known)
        self._l1.pin(holder, held.pinned(), ranks=(), lease_s=self._lease_s, tenant=tenant)
        self._metrics.count_handoff("stored", len(keys), nbytes)

    def end(self, holder: str, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Under the lock: the decoder read the hand-off; its chunks leave L1. Returns every
        chunk to delete from the L2 tiers (those named and those this server stored)."""
        held = self._held.pop(holder, None)
        self._l1.unpin(holder)
        gone = list(dict.fromkeys([*(held.chunks if held else ()), *keys]))
        for key in gone:
            self._l1.drop(key)  # one a retrieve still holds stays, as cold cache
        self._metrics.count_handoff("read", len(gone), 0)
        return gone

    def lapsed(self, holders: Sequence[str]) -> list[ChunkKey]:
        """Under the lock: these pins lapsed; the hand-offs among them leave L1. Returns their
        chunks, to delete from the L2 tiers."""
        gone: list[ChunkKey] = []
        for holder in holders:
            held = self._held.pop(holder, None) if holder.startswith(HANDOFF_PREFIX) else None
            if held is None:
                continue
            keys = held.chunks
            for key in keys:
                self._l1.drop(key)
            self._metrics.count_handoff("lapsed", len(keys), 0)
            gone.extend(keys)
        return gone

    # -- the storage observer: which hand-off chunks a shared tier holds ------------------------

    def stored(self, keys: Sequence[ChunkKey], tier: str) -> None:
        """A tier completed these groups (the L2 writer's thread: only queue them)."""
        if tier in self._shared_tiers and self._held:
            self._in_shared.extend(keys)

    def removed(self, keys: Sequence[ChunkKey], tier: str, reason: Removal) -> None:
        """Nothing to do: a hand-off chunk that left a shared tier stays as it is in L1."""

    def cleared(self, tier: str, model: str | None, cache_salt: str | None) -> None:
        """Nothing to do (as `removed`)."""

    def release_shared(self) -> int:
        """Under the lock: release the L1 pins of the hand-off chunks a shared tier now holds
        (their hand-off's lease runs on to its deadline); returns how many were released."""
        if not self._in_shared:
            return 0
        arrived: set[ChunkKey] = set()
        while self._in_shared:
            arrived.add(self._in_shared.popleft())
        released = 0
        now = self._clock()
        for holder, held in self._held.items():
            fresh = [k for k in held.chunks if k in arrived and k not in held.shared]
            if not fresh:
                continue
            held.shared.update(fresh)
            released += len(fresh)
            # the pin keeps its deadline: the lease is what ends an unread hand-off
            lease = max(held.deadline - now, 1e-3)
            self._l1.pin(holder, held.pinned(), ranks=(), lease_s=lease, tenant=held.tenant)
        if released:
            self._metrics.count_handoff("released", released, 0)
        return released

    def delete_l2(self, keys: Sequence[ChunkKey]) -> None:
        """Delete the chunks' shards from every L2 tier (tier I/O: outside the lock), and tell
        the tiers' observer (the chunk memory) they left. A tier that fails keeps the copy
        until its own eviction; nothing reads it again."""
        if not keys:
            return
        for tier in self._tiers.tiers:
            for key in keys:
                for worker_id in range(key.world_size):
                    try:
                        tier.delete(key.shard(worker_id))
                    except Exception:  # a failed delete costs only space
                        continue
            self._tiers.observer.removed(keys, tier.name, Removal.DELETED)

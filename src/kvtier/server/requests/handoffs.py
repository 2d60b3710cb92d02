"""Hand-off objects: the KV of one prompt that a prefill instance stores for one decode instance.

A hand-off is a set of named chunks (`ReserveKeys` / `StoreKeysInline` with `handoff`) under the
hand-off's id (the request's `request_id`). Its chunks are stored whatever the cache policy says,
and each commit pins them under the hand-off's holder for `--handoff-lease` seconds, counted from
the commit and never renewed by the writer's heartbeats (a decoder that never comes must not hold
memory for ever). `EndHandoff` (the decoder has read it) or the lease's lapse frees them: unpinned
and dropped from L1, and deleted from the L2 tiers (outside the lock). Their names are derived
from the hand-off id, so no prefix-cache lookup (token-addressed) can ever hit them.

Locking: `committed`, `end` and `lapsed` run under the engine lock, which the caller holds;
`delete_l2` does tier I/O and runs outside it.
"""

from __future__ import annotations

from collections.abc import Sequence
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


class HandoffBook:
    """The hand-offs a server holds: their pins, their end, their lapse, and their counts."""

    def __init__(
        self, *, l1: L1Store, tiers: TierManager, metrics: Metrics, lease_s: float
    ) -> None:
        self._l1 = l1
        self._tiers = tiers
        self._metrics = metrics
        self._lease_s = lease_s
        self._held: dict[str, list[ChunkKey]] = {}  # holder -> the chunks it stored

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
        held = self._held.setdefault(holder, [])
        known = set(held)
        held.extend(k for k in keys if k not in known)
        self._l1.pin(holder, held, ranks=(), lease_s=self._lease_s, tenant=tenant)
        self._metrics.count_handoff("stored", len(keys), nbytes)

    def end(self, holder: str, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Under the lock: the decoder read the hand-off; its chunks leave L1. Returns every
        chunk to delete from the L2 tiers (those named and those this server stored)."""
        held = self._held.pop(holder, [])
        self._l1.unpin(holder)
        gone = list(dict.fromkeys([*held, *keys]))
        for key in gone:
            self._l1.drop(key)  # one a retrieve still holds stays, as cold cache
        self._metrics.count_handoff("read", len(gone), 0)
        return gone

    def lapsed(self, holders: Sequence[str]) -> list[ChunkKey]:
        """Under the lock: these pins lapsed; the hand-offs among them leave L1. Returns their
        chunks, to delete from the L2 tiers."""
        gone: list[ChunkKey] = []
        for holder in holders:
            keys = self._held.pop(holder, None) if holder.startswith(HANDOFF_PREFIX) else None
            if keys is None:
                continue
            for key in keys:
                self._l1.drop(key)
            self._metrics.count_handoff("lapsed", len(keys), 0)
            gone.extend(keys)
        return gone

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

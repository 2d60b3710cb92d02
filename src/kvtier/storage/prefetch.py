"""Prefetch: bring the chunk groups that follow an L1 hit up from the L2 tiers into L1.

A group counts only when every rank's shard is in some tier and every shard actually loads
(its digest, key and layout check out on the way in); the first group that fails ends the run,
so a lookup never reports a hit it cannot serve.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvtier.errors import NoSpaceError
from kvtier.keys import ChunkKey
from kvtier.storage.arena import Arena
from kvtier.storage.l1 import L1Store
from kvtier.storage.manager import TierManager

__all__ = ["prefetch"]

_OWNER = "kvtier:l2-prefetch"  # the staging owner of slots being filled from L2


@contextmanager
def prefetch(
    l1: L1Store,
    arena: Arena,
    tiers: TierManager,
    keys: Sequence[ChunkKey],
    *,
    nbytes: int,
    layout: str,
    lease_s: float,
) -> Iterator[list[ChunkKey]]:
    """Load the leading groups of `keys` that are loadable from L2; yields those loaded.

    While the block runs the loaded groups are held in L1 (so the caller can pin them before
    anything else may evict them); they are released when it ends.
    """
    ws = keys[0].world_size if keys else 1
    present = tiers.contains_many([k.shard(w) for k in keys for w in range(ws)])
    loadable = 0
    while loadable < len(keys) and all(present[loadable * ws : (loadable + 1) * ws]):
        loadable += 1
    held: list[ChunkKey] = []
    try:
        for key in keys[:loadable]:
            if not _load_group(l1, arena, tiers, key, nbytes, layout, lease_s):
                break
            l1.acquire(key)  # keep it while later loads make room
            held.append(key)
        yield held
    finally:
        for key in held:
            l1.release(key)


def _load_group(
    l1: L1Store,
    arena: Arena,
    tiers: TierManager,
    key: ChunkKey,
    nbytes: int,
    layout: str,
    lease_s: float,
) -> bool:
    for worker_id in range(key.world_size):
        if l1.get_shard(key, worker_id) is not None:
            continue
        try:
            offset = l1.reserve(
                key, worker_id, nbytes, owner=_OWNER, lease_s=lease_s, layout=layout
            )
        except NoSpaceError:
            return False
        if offset is None:
            return False  # another client is writing this shard right now
        if tiers.get_into(key.shard(worker_id), arena.view(offset, nbytes), layout) is None:
            l1.abort(key, worker_id, owner=_OWNER)
            return False
        l1.commit(key, worker_id, owner=_OWNER)
    return True

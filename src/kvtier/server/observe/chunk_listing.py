"""The complete L1 groups the admin API's `/chunks` lists, found without holding the engine
lock for a scan of the L1.

The total comes from the L1's running count of complete groups (one read). The page of up to
`limit` keys is gathered in slices of at most `SLICE` groups: each slice is taken and checked
under one short hold of the engine lock, which is released between slices, so an engine's
lookup waits for one slice at most, however large the L1 or the limit. The L1's index is
walked in its own order; should it change size while the lock is released (a store or an
eviction), the walk starts over and skips the keys it has already listed, at most
`MAX_RESTARTS` times: past that the page holds what was found (shorter than `limit`, the
total still exact). A listing of a cache that keeps changing is a sample of it in any case.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from kvtier.keys import ChunkKey
from kvtier.server.locking import TimedLock
from kvtier.storage.l1 import L1Store

__all__ = ["MAX_RESTARTS", "SLICE", "complete_l1_groups"]

SLICE = 1024  # groups looked at per hold of the engine lock
MAX_RESTARTS = 8


def complete_l1_groups(l1: L1Store, lock: TimedLock, limit: int) -> tuple[int, list[ChunkKey]]:
    """(how many complete groups the L1 holds, the keys of up to `limit` of them)."""
    with lock.hold("chunks"):
        total = l1.num_ready_groups
    found: list[ChunkKey] = []
    listed: set[ChunkKey] = set()
    walk: Iterator[ChunkKey] | None = None
    restarts = 0
    while len(found) < min(limit, total):
        with lock.hold("chunks"):
            if walk is None:
                walk = l1.iter_keys()
            try:
                batch = list(itertools.islice(walk, SLICE))
            except RuntimeError:  # the index changed size while the lock was released
                batch = None
            complete = l1.complete_each(batch) if batch else []
        if batch is None:
            restarts += 1
            if restarts > MAX_RESTARTS:
                break
            walk = None
            continue
        if not batch:
            break  # walked it all
        for key, ok in zip(batch, complete, strict=True):
            if ok and key not in listed:
                listed.add(key)
                found.append(key)
    return total, found[:limit]

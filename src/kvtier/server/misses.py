"""Why a lookup missed: every token after its hit counted under exactly one reason.

A lookup's hit is a prefix of its prompt's chunks; the tokens after it are explained chunk by
chunk, from what is at hand under the engine lock without any I/O: the chunk's state in L1, what
the lookup's L2 load (if one ran) found for it, and the bounded `ChunkMemory`. Only the chunks
after the hit are looked at, a few dict reads each. A chunk that is itself complete somewhere
but comes after a missing one (a hit cannot skip a chunk) takes the reason of the chunk before
it: the reason the chain broke. The tail shorter than a chunk is never a chunk at all.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvtier.keys import ChunkKey
from kvtier.server.chunkmemory import ChunkMemory
from kvtier.storage.l1 import L1Store
from kvtier.storage.observers import L1_TIER, Removal
from kvtier.storage.prefetch import LoadOutcome, LoadStatus

__all__ = ["MissReason", "MissTally", "explain_misses"]


class MissReason(enum.StrEnum):
    """The reasons, as the `reason` label of `kvtier_lookup_miss_tokens_total` shows them."""

    NEVER_STORED = "never_stored"  # no tier holds it, none remembers it
    EVICTED = "evicted"  # it left the tier in the `tier` label last (eviction, TTL, corrupt)
    CLEARED = "cleared"  # an operator's clear took it out of the tier in the `tier` label
    OTHER_SALT_OR_MODEL = "other_salt_or_model"  # its tokens are stored under another name
    INCOMPLETE = "incomplete"  # some ranks' shards are stored, not all
    LEASE_LAPSED = "lease_lapsed"  # its store's staging lease lapsed before the commit
    LOAD_FAILED = "load_failed"  # an L2 read of it failed or found it corrupt
    SLOWER_THAN_RECOMPUTE = "slower_than_recompute"  # in L2, but recomputing it is faster
    NOT_LOADED = "not_loaded"  # in L2, but no load ran (prefetch slots busy, L1 full)
    TENANT_SHARE = "tenant_share"  # in L1, past the tenant's pinned share
    PARTIAL_CHUNK = "partial_chunk"  # the prompt's tail, shorter than a chunk


#: (reason, tier) -> tokens; tier is "" where the reason names none
MissTally = dict[tuple[str, str], int]

_FROM_LOAD: dict[LoadStatus, MissReason] = {
    LoadStatus.SLOW: MissReason.SLOWER_THAN_RECOMPUTE,
    LoadStatus.FAILED: MissReason.LOAD_FAILED,
    LoadStatus.NO_ROOM: MissReason.NOT_LOADED,
    LoadStatus.PARTIAL: MissReason.INCOMPLETE,
}


def explain_misses(
    keys: Sequence[ChunkKey],
    *,
    hit: int,
    l1_hit: int,
    num_tokens: int,
    chunk_size: int,
    l1: L1Store,
    memory: ChunkMemory,
    outcome: LoadOutcome | None = None,
    job_start: int = 0,
) -> MissTally:
    """Under the engine lock: the tokens of `keys[hit:]` and of the partial tail, by reason.

    `hit` chunks are reported; `l1_hit` were complete in L1 (more when the tenant's pinned
    share cut the hit); `outcome` is the lookup's L2 load of `keys[job_start:]`, if one ran.
    """
    tally: MissTally = {}
    tail = num_tokens - len(keys) * chunk_size
    if tail > 0:
        tally[MissReason.PARTIAL_CHUNK, ""] = tail
    previous: tuple[str, str] = (MissReason.NOT_LOADED, "")
    for i in range(hit, len(keys)):
        reason: tuple[str, str]
        if i < l1_hit:
            reason = (MissReason.TENANT_SHARE, L1_TIER)
        else:
            j = i - job_start
            loaded = outcome if outcome is not None and 0 <= j < len(outcome.statuses) else None
            if loaded is None:
                found = _explain(keys[i], None, "", l1, memory)
            else:
                found = _explain(keys[i], loaded.statuses[j], loaded.tiers[j], l1, memory)
            reason = previous if found is None else found
        tally[reason] = tally.get(reason, 0) + chunk_size
        previous = reason
    return tally


def _explain(
    key: ChunkKey, status: LoadStatus | None, tier: str, l1: L1Store, memory: ChunkMemory
) -> tuple[str, str] | None:
    """One chunk's reason; None when the chunk is complete somewhere (after a gap)."""
    if status is not None and status in _FROM_LOAD:
        return _FROM_LOAD[status], tier
    ready = l1.ready_shards(key)
    if ready == key.world_size:
        return None
    if ready:
        return MissReason.INCOMPLETE, L1_TIER
    if status is LoadStatus.LOADED or status is LoadStatus.BEHIND:
        return None
    seen = memory.whereabouts(key)
    if seen.held_by:
        if status is LoadStatus.ABSENT:  # it left that tier unreported (its own TTL)
            memory.removed([key], seen.held_by, Removal.EVICTED)
            return MissReason.EVICTED, seen.held_by
        return MissReason.NOT_LOADED, seen.held_by  # no load ran: the tier was not asked
    if seen.left:
        return (MissReason.CLEARED if seen.cleared else MissReason.EVICTED), seen.left
    if seen.lapsed:
        return MissReason.LEASE_LAPSED, L1_TIER
    if seen.other_name:
        return MissReason.OTHER_SALT_OR_MODEL, ""
    return MissReason.NEVER_STORED, ""

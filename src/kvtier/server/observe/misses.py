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
from kvtier.server.observe.chunkmemory import ChunkMemory, Whereabouts
from kvtier.storage.l1 import L1Store
from kvtier.storage.observers import L1_TIER, Removal
from kvtier.storage.prefetch import LoadOutcome, LoadStatus

__all__ = ["MissReason", "MissTally", "explain_misses"]


class MissReason(enum.StrEnum):
    """The reasons, as the `reason` label of `kvtier_lookup_miss_tokens_total` shows them."""

    NEVER_STORED = "never_stored"  # no tier holds it, none remembers it
    EVICTED = "evicted"  # it left the tier in the `tier` label last (eviction, TTL, corrupt)
    CLEARED = "cleared"  # an operator's clear took it out of the tier in the `tier` label
    # its tokens are stored under another model (or world size) of the same tenant and salt;
    # never said of another tenant's or salt's chunks, which a lookup must not learn of
    OTHER_SALT_OR_MODEL = "other_salt_or_model"
    INCOMPLETE = "incomplete"  # some ranks' shards are stored, not all
    LEASE_LAPSED = "lease_lapsed"  # its store's staging lease lapsed before the commit
    LOAD_FAILED = "load_failed"  # an L2 read of it failed or found it corrupt
    SLOWER_THAN_RECOMPUTE = "slower_than_recompute"  # in L2, but recomputing it is faster
    NOT_LOADED = "not_loaded"  # in L2, but no load ran (prefetch slots busy, L1 full)
    TENANT_SHARE = "tenant_share"  # in L1, past the tenant's pinned share
    NOT_RESUMABLE = "not_resumable"  # in L1, after the last chunk an engine can resume from
    PARTIAL_CHUNK = "partial_chunk"  # the prompt's tail, shorter than a chunk
    NOT_ADMITTED = "not_admitted"  # stored, declined by the cache policy, and evicted from L1


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
    resumable: int,
    l1_hit: int,
    num_tokens: int,
    chunk_size: int,
    l1: L1Store,
    memory: ChunkMemory,
    outcome: LoadOutcome | None = None,
    job_start: int = 0,
) -> MissTally:
    """Under the engine lock: the tokens of `keys[hit:]` and of the partial tail, by reason.

    `hit` chunks are reported; `l1_hit` were complete in L1, the first `resumable` of them up
    to the last resume point (the tenant's pinned share cuts `hit` from there); `outcome` is
    the lookup's L2 load of `keys[job_start:]`, if one ran.
    """
    tally: MissTally = {}
    tail = num_tokens - len(keys) * chunk_size
    if tail > 0:
        tally[MissReason.PARTIAL_CHUNK, ""] = tail
    # First what L1 and the load tell; the memory is asked once, about the chunks left.
    found: list[tuple[str, str] | None] = []
    for i in range(hit, min(l1_hit, len(keys))):
        found.append(_TENANT_SHARE if i < resumable else _NOT_RESUMABLE)
    start = hit + len(found)
    statuses = outcome.statuses if outcome is not None else []
    tiers = outcome.tiers if outcome is not None else []
    asked: list[int] = []
    absent: list[bool] = []  # per chunk asked: the load found no shard of it
    for i, ready in enumerate(l1.ready_shards(keys[start:]), start):
        j = i - job_start
        status = statuses[j] if 0 <= j < len(statuses) else None
        from_load = _FROM_LOAD.get(status) if status is not None else None
        if from_load is not None:
            found.append((from_load, tiers[j]))
        elif ready == keys[i].world_size or status is _LOADED or status is _BEHIND:
            found.append(None)  # complete somewhere, after a gap: the reason before it
        elif ready:
            found.append(_INCOMPLETE)
        else:
            asked.append(len(found))
            absent.append(status is _ABSENT)
            found.append(None)
    if asked:
        seen = memory.whereabouts([keys[hit + n] for n in asked])
        stale: dict[str, list[ChunkKey]] = {}
        for n, known, gone in zip(asked, seen, absent, strict=True):
            if gone and known.held_by:  # it left that tier unreported (its own TTL)
                found[n] = (MissReason.EVICTED, known.held_by)
                stale.setdefault(known.held_by, []).append(keys[hit + n])
            else:
                found[n] = _from_memory(known)
        for tier, left in stale.items():
            memory.removed(left, tier, Removal.EVICTED)
    previous: tuple[str, str] = (MissReason.NOT_LOADED, "")
    for reason in found:
        if reason is None:
            reason = previous
        tally[reason] = tally.get(reason, 0) + chunk_size
        previous = reason
    return tally


_TENANT_SHARE = (MissReason.TENANT_SHARE, L1_TIER)
_NOT_RESUMABLE = (MissReason.NOT_RESUMABLE, L1_TIER)
_INCOMPLETE = (MissReason.INCOMPLETE, L1_TIER)
_LOADED, _BEHIND, _ABSENT = LoadStatus.LOADED, LoadStatus.BEHIND, LoadStatus.ABSENT


def _from_memory(seen: Whereabouts) -> tuple[str, str]:
    """The reason of a chunk no tier had for the lookup, from what the memory knows of it."""
    if seen.held_by:  # an L2 tier holds it, but no load ran to get it
        return MissReason.NOT_LOADED, seen.held_by
    if seen.declined:
        return MissReason.NOT_ADMITTED, seen.left
    if seen.left:
        return (MissReason.CLEARED if seen.cleared else MissReason.EVICTED), seen.left
    if seen.lapsed:
        return MissReason.LEASE_LAPSED, L1_TIER
    if seen.other_name:
        return MissReason.OTHER_SALT_OR_MODEL, ""
    return MissReason.NEVER_STORED, ""

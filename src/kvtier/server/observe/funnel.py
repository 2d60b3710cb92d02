"""The hit funnel: of a lookup's tokens, those some tier held, those worth loading, those served.

Per tier, three stages, each a subset of the one before:

- ``present``: the tier held the chunk when the lookup asked (L1: complete in L1; an L2 tier:
  its load job found the chunk there).
- ``worth_loading``: present, and loading it is faster than recomputing it (always so in L1;
  an L2 chunk the hit gate judged slower than the engine's prefill is not).
- ``loaded``: served as part of the hit from that tier (loaded in time and pinned).

The gap between two stages says what to fix: present but not worth loading (a slow tier, or a
prefill so fast that loads do not pay), worth loading but not loaded (prefetch slots or L1 room,
a tenant's share, a failed read).
"""

from __future__ import annotations

from kvtier.storage.observers import L1_TIER
from kvtier.storage.prefetch import LoadOutcome, LoadStatus

__all__ = ["STAGES", "FunnelTally", "hit_funnel"]

#: (tier, stage) -> tokens
FunnelTally = dict[tuple[str, str], int]

STAGES = ("present", "worth_loading", "loaded")

_FOUND = frozenset(
    {LoadStatus.LOADED, LoadStatus.SLOW, LoadStatus.NO_ROOM, LoadStatus.FAILED, LoadStatus.BEHIND}
)


def hit_funnel(
    *,
    hit: int,
    l1_held: int,
    chunk_size: int,
    outcome: LoadOutcome | None = None,
    job_start: int = 0,
) -> FunnelTally:
    """The funnel of one lookup: `hit` leading chunks served, `l1_held` of them complete in L1
    when it asked (with a load job: the job's start), `outcome` the job's loads of the chunks
    from `job_start` on."""
    tally: FunnelTally = {}

    def add(tier: str, stage: str, chunks: int) -> None:
        if chunks:
            tally[tier, stage] = tally.get((tier, stage), 0) + chunks * chunk_size

    add(L1_TIER, "present", l1_held)
    add(L1_TIER, "worth_loading", l1_held)
    add(L1_TIER, "loaded", min(hit, l1_held))
    if outcome is not None:
        for j, (status, tier) in enumerate(zip(outcome.statuses, outcome.tiers, strict=False)):
            if status not in _FOUND or not tier:
                continue
            add(tier, "present", 1)
            if status is not LoadStatus.SLOW:
                add(tier, "worth_loading", 1)
            if status is LoadStatus.LOADED and job_start + j < hit:
                add(tier, "loaded", 1)
    return tally

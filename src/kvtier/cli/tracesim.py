"""Offline replays of a trace's block chains: LRU, Belady's MIN and an infinite cache.

What `kvtier replay` sets beside a real server's figures. All three count hits the way a lookup
does (prefix semantics): a request's blocks hit up to its first block not cached, and none after
it. Each returns the hit blocks of every request, in trace order.

- `lru`: store everything, evict the least recently used block; a request's chain ends most
  recent with its head first (as the server orders a chain: `L1Store.touch`), and no block of the
  request being stored is evicted for it (its hit is pinned, its new blocks are staging).
- `belady`: Belady's MIN, knowing the future: a block whose next use is farther than every cached
  block's is not stored at all, else the cached block used again farthest in the future is
  evicted (at equal next use, the one deepest in its chain, which that request could hit only
  after the other). The ceiling a policy of this capacity can reach.
- `infinite`: every block ever stored stays: the hits no capacity can add to.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Sequence

__all__ = ["NEVER", "belady", "infinite", "lru", "next_uses"]

#: The next use of a block that is never used again.
NEVER = 1 << 62

Chains = Sequence[Sequence[int]]


def _prefix_hits(chain: Sequence[int], cached: Container[int]) -> int:
    hit = 0
    for block in chain:
        if block not in cached:
            break
        hit += 1
    return hit


def infinite(chains: Chains) -> list[int]:
    """Hit blocks per request of a cache that never evicts."""
    seen: set[int] = set()
    hits = []
    for chain in chains:
        hits.append(_prefix_hits(chain, seen))
        seen.update(chain)
    return hits


def lru(chains: Chains, capacity: int) -> list[int]:
    """Hit blocks per request of an LRU cache of `capacity` blocks that stores everything."""
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1 block, got {capacity}")
    order: OrderedDict[int, None] = OrderedDict()  # evictable blocks, least recent first
    hits = []
    for chain in chains:
        hit = _prefix_hits(chain, order)
        hits.append(hit)
        held = set(chain[:hit])  # pinned by the lookup: out of the eviction order
        for block in held:
            del order[block]
        for block in chain[hit:]:
            if block in order or block in held:
                continue
            if len(order) + len(held) >= capacity:
                if not order:
                    break  # a prompt longer than the cache: the rest is not stored
                order.popitem(last=False)
            held.add(block)  # staging until the store commits
        for block in reversed(chain):
            if block in held:
                held.discard(block)
                order[block] = None
            elif block in order:
                order.move_to_end(block)
    return hits


def next_uses(chains: Chains) -> list[list[int]]:
    """For each request and each of its blocks, the index of the next request that names the
    block again (`NEVER` if none)."""
    upcoming: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in chains]
    for index in range(len(chains) - 1, -1, -1):
        chain = chains[index]
        out[index] = [upcoming.get(block, NEVER) for block in chain]
        for block in chain:
            upcoming[block] = index
    return out


def belady(chains: Chains, capacity: int) -> list[int]:
    """Hit blocks per request of Belady's MIN with `capacity` blocks (see the module's text)."""
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1 block, got {capacity}")
    due: dict[int, tuple[int, int]] = {}  # cached block -> (next use, depth)
    farthest: list[tuple[int, int, int]] = []  # (-next use, -depth, block), stale entries too
    hits = []
    for chain, uses in zip(chains, next_uses(chains), strict=True):
        hits.append(_prefix_hits(chain, due))
        for depth, (block, use) in enumerate(zip(chain, uses, strict=True)):
            rank = (use, depth)
            if block not in due:
                if use == NEVER:
                    continue  # never read again: not worth a place
                if len(due) >= capacity:
                    while due.get(farthest[0][2]) != (-farthest[0][0], -farthest[0][1]):
                        heapq.heappop(farthest)
                    worst, worst_depth, victim = farthest[0]
                    if (-worst, -worst_depth) <= rank:
                        continue  # every cached block is used again sooner
                    heapq.heappop(farthest)
                    del due[victim]
            due[block] = rank
            heapq.heappush(farthest, (-use, -depth, block))
    return hits

"""The L1 index: which chunk shards live where in the shared-memory arena, and what to evict.

`L1Store` is bookkeeping only: it hands out arena offsets from an `Allocator` and tracks shard
states, pins and recency; clients copy the bytes themselves. It is single-owner and not
thread-safe: the server engine calls it only while holding its engine lock, so every method
costs in proportion to what it touches (an owner's shards, the pins that expire), never to the
whole index.

It also counts, per tenant, the bytes that no eviction can take back: staging slots, quarantined
(fenced) slots and pinned groups (`tenant_usage`). The server's shares (`server/requests/stores.py`,
`server/requests/lookups.py`) are checked against these counts.

Its parts, one job each: `records` (a shard, a group, a pin), `stats` (what it reports),
`index` (the groups, their LRU order, eviction and clearing), `writes` (staging slots: reserve,
commit, abort, fence), `reads` (what lookups and retrieves ask), `pins` (holds against
eviction) and `store` (`L1Store`, all of them together).
"""

from kvtier.storage.l1.pins import OwnerSeen, stored_holder
from kvtier.storage.l1.records import Held, ShardState
from kvtier.storage.l1.stats import L1Stats, TenantUsage
from kvtier.storage.l1.store import L1Store
from kvtier.storage.shares import UNBOUNDED, TenantBounds

__all__ = [
    "UNBOUNDED",
    "Held",
    "L1Stats",
    "L1Store",
    "OwnerSeen",
    "ShardState",
    "TenantBounds",
    "TenantUsage",
    "stored_holder",
]

"""What the L1 reports: its counters and, per tenant, the bytes no eviction can take back."""

from __future__ import annotations

import msgspec

from kvtier.storage.admission import AdmissionStats


class TenantUsage(msgspec.Struct, frozen=True, kw_only=True):
    """What one tenant holds in L1 against its shares ("" is the anonymous tenant)."""

    tenant: str
    staging_bytes: int  # reserved, not committed (--tenant-staging-share)
    fenced_bytes: int  # quarantined (--tenant-quarantine-share, with staging_bytes)
    pinned_bytes: int  # groups its lookups pin (--tenant-pinned-share)


class L1Stats(msgspec.Struct, frozen=True, kw_only=True):
    """The shared-memory L1 at one instant."""

    capacity_bytes: int
    used_bytes: int
    groups: int  # chunk groups held (a group is one chunk's shards, one per rank)
    ready_groups: int  # groups whose every rank's shard is committed
    staging_shards: int  # shards reserved and not yet committed
    pinned_groups: int  # groups a lookup pinned against eviction
    evictions: int
    evicted_bytes: int
    declined_evictions: int = 0  # of those, groups the admission policy had declined
    admission: AdmissionStats | None = None  # the cache policy's decisions
    fenced_slots: int = 0  # lapsed slots quarantined until their owner can no longer touch them
    fenced_bytes: int = 0
    tenants: list[TenantUsage] = msgspec.field(default_factory=list)  # with anything held

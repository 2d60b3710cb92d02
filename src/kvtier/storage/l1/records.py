"""The L1 index's records: a shard (one rank's slot of a chunk), a group (a chunk's shards, one
per rank) and a pin (a holder's hold on the groups a lookup reported)."""

from __future__ import annotations

import enum

from kvtier.keys import ChunkKey


class ShardState(enum.Enum):
    """STAGING: reserved and being written, invisible to readers. READY: readable."""

    STAGING = "staging"
    READY = "ready"


class Shard:
    __slots__ = (
        "deadline",
        "group",
        "layout",
        "nbytes",
        "offset",
        "owner",
        "replaces",
        "resumable",
        "size",
        "state",
        "tenant",
    )

    def __init__(
        self,
        offset: int,
        size: int,
        nbytes: int,
        layout: str,
        owner: str,
        deadline: float,
        tenant: str,
        resumable: bool,
        group: Group,
    ) -> None:
        self.group = group  # the group it belongs to (a cleared one too: see `L1Store.clear`)
        self.offset = offset
        self.size = size  # bytes asked for: what a reader copies
        self.nbytes = nbytes  # bytes allocated (page-rounded): what counts against capacity
        self.layout = layout
        self.owner = owner
        self.deadline = deadline
        self.tenant = tenant  # whose staging bytes it counts in while STAGING
        self.resumable = resumable  # a point the engine can resume from (see `resume_prefix`)
        # A READY shard that is no resume point, stepped aside for this one: freed when this one
        # commits, put back should it be aborted or fenced.
        self.replaces: Shard | None = None
        self.state = ShardState.STAGING


class Group:
    __slots__ = (
        "admitted",
        "charged",
        "doomed",
        "holds",
        "key",
        "missing",
        "nbytes",
        "pin_tenant",
        "pins",
        "refs",
        "shards",
        "staging",
        "unresumable",
    )

    def __init__(self, key: ChunkKey) -> None:
        self.admitted = True  # kept as cache (see storage/admission.py); else cold, unannounced
        self.key = key
        self.shards: list[Shard | None] = [None] * key.world_size
        self.missing = key.world_size  # shards not READY; 0 means the group is a hit
        self.staging = 0
        self.unresumable = 0  # shards that are no resume point: the group is one when 0
        self.holds = 0  # holder pins plus anonymous refs; > 0 means never evicted
        self.refs = 0  # anonymous refs alone, to check release() against acquire()
        self.pins = 0  # pins holding it: the first charges its bytes to its tenant
        self.pin_tenant = ""
        self.charged = 0  # bytes charged to pin_tenant's pinned bytes while pins > 0
        self.nbytes = 0
        # Cleared while busy: out of the index at once (its key may be stored again, into a new
        # group), its slots kept until the last hold or staging shard ends, then freed.
        self.doomed = False


#: an anonymous hold on one group (`L1Store.acquire`), given back by `L1Store.release`
Held = Group


class Pin:
    __slots__ = (
        "deadline",
        "groups",
        "lease_s",
        "owner",
        "queued",
        "ranks",
        "readers",
        "tenant",
    )

    def __init__(
        self,
        groups: list[Group],
        ranks: set[int],
        deadline: float,
        tenant: str,
        owner: str,
        lease_s: float,
    ) -> None:
        self.groups = groups
        self.ranks = ranks
        self.readers = len(ranks)  # the ranks it was made for: range(readers)
        self.deadline = deadline
        self.tenant = tenant
        self.owner = owner  # the client that made it: its pin lives while that client does
        self.lease_s = lease_s
        self.queued = deadline  # the deadline its entry in the expiry heap carries

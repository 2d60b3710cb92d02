"""Per-tenant bounds on what the L1 cannot take back: staging, quarantined and pinned bytes.

The L1 counts each tenant's bytes (`Usage`) as it goes; the server turns its share options
into byte bounds (`TenantBounds`, see `server/limits.py`), which a reserve and a pin are checked
against. Kept apart from `l1/` so that package stays the index and its states.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import NoSpaceError

__all__ = ["UNBOUNDED", "TenantBounds", "Usage", "check_staging"]


@dataclass(frozen=True, slots=True)
class TenantBounds:
    """What one tenant may hold that eviction cannot take back, in bytes (None: no bound).

    `staging_bytes` bounds its staging slots; `quarantine_bytes` its staging plus quarantined
    slots together, since every staging slot becomes quarantined when its writer goes silent:
    so its quarantine never exceeds it. `pinned_bytes` bounds what its pins hold.
    """

    staging_bytes: int | None = None
    quarantine_bytes: int | None = None
    pinned_bytes: int | None = None
    staging_knob: str = "--tenant-staging-share"
    quarantine_knob: str = "--tenant-quarantine-share"


#: no bound on any tenant (a server whose clients are all one tenant)
UNBOUNDED = TenantBounds()


class Usage:
    """One tenant's bytes that eviction cannot take back (counted by the L1)."""

    __slots__ = ("fenced", "pinned", "staging")

    def __init__(self) -> None:
        self.staging = 0
        self.fenced = 0
        self.pinned = 0


def check_staging(usage: Usage, tenant: str, size: int, nbytes: int, bounds: TenantBounds) -> None:
    """NoSpaceError when a new `nbytes` staging slot would take `tenant` past its bounds."""
    who = f"tenant {tenant[:64]!r}" if tenant else "the anonymous tenant"
    limit = bounds.staging_bytes
    if limit is not None and usage.staging + nbytes > limit:
        raise NoSpaceError(
            f"{who} holds {usage.staging} bytes in staging slots; a {size}-byte shard"
            f" ({nbytes} in pages) would pass its {limit} bytes ({bounds.staging_knob}):"
            " commit or abort first, or store fewer chunks at once"
        )
    limit = bounds.quarantine_bytes
    if limit is not None and usage.staging + usage.fenced + nbytes > limit:
        raise NoSpaceError(
            f"{who} holds {usage.fenced} bytes quarantined (slots of its clients that went"
            f" silent while they may still write) and {usage.staging} staging; a"
            f" {size}-byte shard ({nbytes} in pages) would pass its {limit} bytes"
            f" ({bounds.quarantine_knob}): its stores fail until its clients commit, abort"
            " or exit"
        )

"""The L2 tier interface, URL-based tier construction and byte-size parsing.

An L2 tier stores one rank's shard of one chunk (an `ObjectKey`) with its layout string, in the
shared object format of `kvtier.storage.tiers.format`, so a reader can tell a sound object from a
corrupted or misnamed one and never serves the latter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from typing_extensions import Buffer

from kvtier.keys import ObjectKey

TierStats = dict[str, int | float | str]


@runtime_checkable
class L2Tier(Protocol):
    """A second-level store behind the shared-memory L1 (local disk, Redis/Valkey...).

    Reads never raise for a miss, a layout or size mismatch, a corrupted object (deleted and
    counted as `corrupt`) or an unreachable backend (counted as `errors`): they return False.
    On False the contents of `out` are unspecified.
    """

    name: str

    def put(self, key: ObjectKey, data: Buffer, layout: str) -> None:
        """Store `data` under `key` with `layout`, replacing any older object."""
        ...

    def put_many(self, items: Sequence[tuple[ObjectKey, Buffer, str]]) -> int:
        """Store several objects; returns how many were written."""
        ...

    def get_into(self, key: ObjectKey, out: memoryview, layout: str) -> bool:
        """Copy the payload into `out` (whose length must equal it); False on any kind of miss."""
        ...

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[bool]:
        """`get_into` for several objects, one flag per item."""
        ...

    def contains(self, key: ObjectKey) -> bool:
        """Whether an object is stored under `key` (its content is not checked)."""
        ...

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """`contains` for several keys."""
        ...

    def delete(self, key: ObjectKey) -> bool:
        """Remove the object under `key`; True when there was one."""
        ...

    def clear(self, *, model: str | None = None, cache_salt: str | None = None) -> int:
        """Remove every object of this tier matching the filters; returns how many."""
        ...

    def stats(self) -> TierStats:
        """Counters and gauges: used_bytes, capacity_bytes (0 = unbounded), objects, hits..."""
        ...

    def close(self) -> None:
        """Release files, connections and threads; the tier is unusable afterwards."""
        ...


def _open_disk(url: str) -> L2Tier:
    from kvtier.storage.tiers.disk import DiskTier

    return DiskTier.from_url(url)


def _open_redis(url: str) -> L2Tier:
    from kvtier.storage.tiers.redis import RedisTier

    return RedisTier.from_url(url)


TIER_SCHEMES: dict[str, Callable[[str], L2Tier]] = {
    "disk": _open_disk,
    "redis": _open_redis,
    "rediss": _open_redis,
    "valkey": _open_redis,
    "valkeys": _open_redis,
}


def open_tier(url: str) -> L2Tier:
    """The tier a URL names, e.g. "disk:///var/lib/kvtier?size=50GiB" or "redis://h:6379/0".

    See `DiskTier.from_url` and `RedisTier.from_url` for each scheme's path and query options.
    """
    scheme, sep, _ = url.partition("://")
    factory = TIER_SCHEMES.get(scheme.lower()) if sep else None
    if factory is None:
        known = ", ".join(f"{s}://" for s in TIER_SCHEMES)
        raise ValueError(f"unknown L2 tier URL {url!r}: the scheme must be one of {known}")
    return factory(url)

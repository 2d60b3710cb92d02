"""Tiers by URL scheme: `open_tier("disk:///var/lib/kvtier?size=50GiB")` and the table behind it.

Each implementation is imported only when its scheme is used, so a server without Redis or
Mooncake never imports their clients.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.redaction import redact
from kvtier.storage.tiers.base import L2Tier

__all__ = ["TIER_SCHEMES", "open_tier"]


def _open_disk(url: str) -> L2Tier:
    from kvtier.storage.tiers.disk import DiskTier

    return DiskTier.from_url(url)


def _open_redis(url: str) -> L2Tier:
    from kvtier.storage.tiers.redis import RedisTier

    return RedisTier.from_url(url)


def _open_redis_cluster(url: str) -> L2Tier:
    from kvtier.storage.tiers.redis_cluster import RedisClusterTier

    return RedisClusterTier.from_url(url)


def _open_mooncake(url: str) -> L2Tier:
    from kvtier.storage.tiers.mooncake import MooncakeTier

    return MooncakeTier.from_url(url)


#: URL scheme -> tier factory; a new tier costs a module and a row here
TIER_SCHEMES: dict[str, Callable[[str], L2Tier]] = {
    "disk": _open_disk,
    "redis": _open_redis,
    "rediss": _open_redis,
    "valkey": _open_redis,
    "valkeys": _open_redis,
    "redis+cluster": _open_redis_cluster,
    "rediss+cluster": _open_redis_cluster,
    "valkey+cluster": _open_redis_cluster,
    "valkeys+cluster": _open_redis_cluster,
    "mooncake": _open_mooncake,
}


def open_tier(url: str) -> L2Tier:
    """The tier a URL names, e.g. "disk:///var/lib/kvtier?size=50GiB", "redis://h:6379/0" or
    "redis+cluster://h1:7000,h2:7000/?prefix=kvtier&ttl=86400".

    See each tier's `from_url` for its path and query options.
    """
    scheme, sep, _ = url.partition("://")
    factory = TIER_SCHEMES.get(scheme.lower()) if sep else None
    if factory is None:
        known = ", ".join(f"{s}://" for s in TIER_SCHEMES)
        raise ValueError(f"unknown L2 tier URL {redact(url)!r}: the scheme must be one of {known}")
    return factory(url)

"""L2 tiers behind the shared-memory L1: local disk and Redis/Valkey, one interface."""

from kvtier.config import parse_size
from kvtier.storage.tiers.base import TIER_SCHEMES, L2Tier, TierStats, open_tier

__all__ = ["TIER_SCHEMES", "L2Tier", "TierStats", "open_tier", "parse_size"]

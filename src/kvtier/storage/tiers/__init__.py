"""L2 tiers behind the shared-memory L1: local disk, Redis/Valkey, Redis/Valkey Cluster and
Mooncake Store, one interface (`L2Tier`) and one typed stats record (`TierStats`)."""

from kvtier.config.sizes import parse_size
from kvtier.storage.tiers.base import L2Tier, Latency, TierStats
from kvtier.storage.tiers.registry import TIER_SCHEMES, open_tier

__all__ = ["TIER_SCHEMES", "L2Tier", "Latency", "TierStats", "open_tier", "parse_size"]

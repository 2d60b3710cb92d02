"""The connector's figures in vLLM's KV connector stats: how long loads and saves copied, and
how much of that the forward pass waited for. vLLM sums them over the workers and logs them
each interval (`KV Transfer metrics: ...`), with the share of copy time hidden behind compute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.integrations.vllm.layerwise import Overlap, hidden_fraction


@dataclass
class KVTierStats(KVConnectorStats):  # type: ignore[misc]
    """Sums of `Overlap`'s counters (seconds, counts) since the last report."""

    def __post_init__(self) -> None:
        for key in Overlap.KEYS:
            self.data.setdefault(key, 0.0)

    def reset(self) -> None:
        self.data = dict.fromkeys(Overlap.KEYS, 0.0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in Overlap.KEYS:
            self.data[key] = self.data.get(key, 0.0) + float(other.data.get(key, 0.0))
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {
            "loads": int(d["loads"]),
            "load_copy_ms": round(d["load_copy_s"] * 1e3, 3),
            "load_hidden": round(hidden_fraction(d["load_copy_s"], d["load_exposed_s"]), 3),
            "saves": int(d["saves"]),
            "save_copy_ms": round(d["save_copy_s"] * 1e3, 3),
            "save_hidden": round(hidden_fraction(d["save_copy_s"], d["save_exposed_s"]), 3),
        }

    def is_empty(self) -> bool:
        return not (self.data.get("loads") or self.data.get("saves"))


def stats_from(data: dict[str, Any] | None) -> KVTierStats | None:
    return KVTierStats(data=dict(data)) if data is not None else None

"""The connector's figures in vLLM's KV connector stats: how long loads and saves copied, how
much of that the forward pass waited for, and how long the scheduler spent asking kvtier. vLLM
sums them over the workers and the scheduler and logs them each interval (`KV Transfer metrics:
...`), with the share of copy time hidden behind compute, and counts them in its Prometheus
`/metrics` (`KVTierPromMetrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.integrations.vllm.layerwise import Overlap, hidden_fraction
from kvtier.integrations.vllm.scheduler import LOOKUP_KEYS

#: what the workers count (copies) and what the scheduler counts (lookups)
KEYS = Overlap.KEYS + LOOKUP_KEYS


@dataclass
class KVTierStats(KVConnectorStats):  # type: ignore[misc]
    """Sums of the workers' `Overlap` counters and the scheduler's lookup counters (seconds,
    counts) since the last report."""

    def __post_init__(self) -> None:
        for key in KEYS:
            self.data.setdefault(key, 0.0)

    def reset(self) -> None:
        self.data = dict.fromkeys(KEYS, 0.0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in KEYS:
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
            "lookups": int(d["lookups"]),
            "lookup_ms": round(d["lookup_s"] * 1e3, 3),
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in ("loads", "saves", "lookups"))


def stats_from(data: dict[str, Any] | None) -> KVTierStats | None:
    return KVTierStats(data=dict(data)) if data is not None else None


#: Prometheus counters in vLLM's /metrics: (stats key, name, help)
PROM_COUNTERS = (
    ("load_copy_s", "vllm:kvtier_load_copy_seconds",
     "Seconds kvtier's loads copied KV into vLLM's blocks"),
    ("load_exposed_s", "vllm:kvtier_load_waited_seconds",
     "Seconds the forward pass waited for kvtier's loads (the copy time not hidden)"),
    ("save_copy_s", "vllm:kvtier_save_copy_seconds",
     "Seconds kvtier's saves copied KV out of vLLM's blocks"),
    ("save_exposed_s", "vllm:kvtier_save_waited_seconds",
     "Seconds the forward pass waited for kvtier's saves (the copy time not hidden)"),
    ("lookups", "vllm:kvtier_lookups", "Lookups and lookup polls the scheduler sent to kvtier"),
    ("lookup_s", "vllm:kvtier_lookup_seconds",
     "Seconds the scheduler spent in kvtier lookups and polls (round trips included)"),
)  # fmt: skip


class KVTierPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Counters of copy seconds and of the seconds the forward pass waited for them, per
    engine: the share hidden is 1 - waited / copy (e.g. `1 - rate(..._waited_seconds_total)
    / rate(..._copy_seconds_total)`)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for key, name, doc in PROM_COUNTERS:
            counter = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self.counters[key] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            value = float(transfer_stats_data.get(key, 0.0))
            if value > 0:
                per_engine[engine_idx].inc(value)

"""The state metrics: what `/metrics` reads from the server's status at each scrape.

`STATE_METRICS` is the table (name, type, labels, help, how to read it from a `ServerStatus`);
`StateCollector` turns one status into Prometheus families. The request-path instruments (the
counters and histograms the handlers update) are in `metrics.py`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvtier.server.observe.snapshots import ServerStatus
from kvtier.storage.tiers.base import LATENCY_BOUNDS_S, TierStats

__all__ = ["STATE_METRICS", "StateCollector", "StateMetric", "StateSnapshot"]

logger = logging.getLogger(__name__)

#: reads the server's status at scrape time
StateSnapshot = Callable[[], ServerStatus]


class StateCollector:
    """Turns one `ServerStatus` into gauge and counter families at scrape time."""

    def __init__(self, snapshot: StateSnapshot) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        # Families without samples: lets the registry detect name clashes without a snapshot.
        return list(_state_families(None))

    def collect(self) -> Iterable[Metric]:
        try:
            status = self._snapshot()
        except Exception:
            # A failing snapshot must not take the request instruments down with it.
            logger.exception("metrics: reading the server state for a scrape failed")
            return []
        return list(_state_families(status))


class _Histogram(NamedTuple):
    """One histogram sample: cumulative (upper bound, count) buckets and the sum."""

    buckets: list[tuple[str, float]]
    total: float


#: the samples one state metric takes from a status: (label values, value) pairs
Samples = Callable[[ServerStatus], Iterable[tuple[Sequence[str], float | _Histogram]]]


class StateMetric(NamedTuple):
    """One metric read from the server's status at scrape time."""

    name: str
    kind: type[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]
    labels: tuple[str, ...]
    help: str
    samples: Samples


def _one(value: Callable[[ServerStatus], float]) -> Samples:
    """The samples of an unlabelled metric: `value` of the status."""
    return lambda s: [((), value(s))]


def _per_tier(value: Callable[[TierStats], float]) -> Samples:
    """The samples of a metric labelled by L2 tier: `value` of each tier's stats."""
    return lambda s: [((tier.name,), value(tier)) for tier in s.l2.tiers]


def _tenant_l1(s: ServerStatus) -> list[tuple[Sequence[str], float]]:
    """Each tenant's L1 bytes that eviction cannot take back, by kind."""
    return [
        sample
        for u in s.l1.tenants
        for sample in (
            ((u.tenant, "staging"), u.staging_bytes),
            ((u.tenant, "quarantined"), u.fenced_bytes),
            ((u.tenant, "pinned"), u.pinned_bytes),
        )
    ]


def _tenant_shares(s: ServerStatus) -> list[tuple[Sequence[str], float]]:
    """The L1 bytes one tenant may hold, by kind; only with a tokens file (tenants)."""
    if not s.config.get("auth_tokens_file"):
        return []
    size = s.l1.capacity_bytes
    kinds = (("staging", "staging"), ("quarantined", "quarantine"), ("pinned", "pinned"))
    return [((kind,), int(s.config[f"tenant_{opt}_share"] * size)) for kind, opt in kinds]


def _evictions(s: ServerStatus) -> list[tuple[Sequence[str], float]]:
    """L1 evictions (chunk groups), then each L2 tier's (the ones that count them)."""
    l2 = [((tier.name,), tier.extra.get("evictions", 0)) for tier in s.l2.tiers]
    return [(("l1",), s.l1.evictions), *l2]


def _admissions(s: ServerStatus) -> list[tuple[Sequence[str], float]]:
    adm = s.l1.admission
    if adm is None:
        return []
    return [(("l1", "admitted"), adm.admitted), (("l1", "declined"), adm.declined)]


def _l2_latency(s: ServerStatus) -> list[tuple[Sequence[str], _Histogram]]:
    """Each tier's read and write latency as cumulative Prometheus buckets."""
    out: list[tuple[Sequence[str], _Histogram]] = []
    bounds = (*LATENCY_BOUNDS_S, math.inf)
    for tier in s.l2.tiers:
        for operation, lat in (("read", tier.read_latency), ("write", tier.write_latency)):
            running = 0
            buckets: list[tuple[str, float]] = []
            for bound, n in zip(bounds, lat.buckets, strict=True):
                running += n
                buckets.append(("+Inf" if bound == math.inf else repr(bound), running))
            out.append(((tier.name, operation), _Histogram(buckets, lat.total_s)))
    return out


_GAUGE, _COUNTER, _HISTOGRAM = GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily
_TIER = ("tier",)

#: every metric read from the server's status, in the order `/metrics` lists them (the metrics
#: table of docs/operations.md names them; counters gain the `_total` suffix when rendered)
STATE_METRICS: tuple[StateMetric, ...] = (
    StateMetric("kvtier_ready", _GAUGE, (), "1 when the arena is ready and serving.",
                _one(lambda s: s.ready)),
    StateMetric("kvtier_degraded", _GAUGE, (),
                "1 while the server serves with a failing part (an L2 tier): see /health.",
                _one(lambda s: s.health == "degraded")),
    StateMetric("kvtier_uptime_seconds", _GAUGE, (), "Seconds since the server started.",
                _one(lambda s: s.uptime_s)),
    StateMetric("kvtier_l1_used_bytes", _GAUGE, (), "Bytes allocated in the L1 arena.",
                _one(lambda s: s.l1.used_bytes)),
    StateMetric("kvtier_l1_capacity_bytes", _GAUGE, (), "Size of the L1 arena in bytes.",
                _one(lambda s: s.l1.capacity_bytes)),
    StateMetric("kvtier_l1_groups", _GAUGE, (), "Chunk groups held in L1.",
                _one(lambda s: s.l1.groups)),
    StateMetric("kvtier_l1_pinned_groups", _GAUGE, (), "L1 chunk groups pinned by lookups.",
                _one(lambda s: s.l1.pinned_groups)),
    StateMetric("kvtier_tenant_l1_bytes", _GAUGE, ("tenant", "kind"),
                "L1 bytes a tenant holds that eviction cannot take back, by kind (staging, "
                "quarantined, pinned): what its --tenant-*-share options bound.",
                _tenant_l1),
    StateMetric("kvtier_tenant_l1_share_bytes", _GAUGE, ("kind",),
                "L1 bytes one tenant may hold, by kind: staging, quarantined (staging and "
                "quarantined together) and pinned (--tenant-*-share of --l1-size); only with "
                "--auth-tokens-file.",
                _tenant_shares),
    StateMetric("kvtier_evictions", _COUNTER, _TIER,
                "Objects evicted to make room, by tier (l1 counts chunk groups).", _evictions),
    StateMetric("kvtier_admissions", _COUNTER, ("tier", "decision"),
                "Chunk groups stored into L1 by whether the cache policy kept them as cache "
                "(admitted) or for their request only (declined); declined groups are never "
                "written to an L2 tier.", _admissions),
    StateMetric("kvtier_declined_evictions", _COUNTER, _TIER,
                "L1 evictions of groups the cache policy had declined.",
                lambda s: [(("l1",), s.l1.declined_evictions)]),
    StateMetric("kvtier_cache_policy_stores_everything", _GAUGE, ("policy",),
                "1 while the L1 cache policy admits every new chunk (adaptive: the room it "
                "measured lets it), 0 while it admits only chunks seen before.",
                lambda s: [((s.l1.admission.policy,), s.l1.admission.stores_everything)]
                if s.l1.admission is not None else []),
    StateMetric("kvtier_evicted_bytes", _COUNTER, _TIER, "Bytes freed by L1 evictions.",
                lambda s: [(("l1",), s.l1.evicted_bytes)]),
    StateMetric("kvtier_l2_used_bytes", _GAUGE, _TIER, "Bytes stored in an L2 tier.",
                _per_tier(lambda t: t.used_bytes)),
    StateMetric("kvtier_l2_capacity_bytes", _GAUGE, _TIER,
                "Capacity of an L2 tier in bytes (0 = unbounded).",
                _per_tier(lambda t: t.capacity_bytes)),
    StateMetric("kvtier_l2_objects", _GAUGE, _TIER, "Objects stored in an L2 tier.",
                _per_tier(lambda t: t.objects)),
    StateMetric("kvtier_l2_hits", _COUNTER, _TIER, "Reads an L2 tier served.",
                _per_tier(lambda t: t.hits)),
    StateMetric("kvtier_l2_misses", _COUNTER, _TIER, "Reads an L2 tier could not serve.",
                _per_tier(lambda t: t.misses)),
    StateMetric("kvtier_l2_errors", _COUNTER, _TIER,
                "Failed L2 operations (backend unreachable, I/O error).",
                _per_tier(lambda t: t.errors)),
    StateMetric("kvtier_l2_corrupt", _COUNTER, _TIER,
                "L2 objects found damaged on read (deleted, never served).",
                _per_tier(lambda t: t.corrupt)),
    StateMetric("kvtier_l2_failing", _GAUGE, _TIER,
                "1 while an L2 tier's errors grow (the server reports degraded).",
                lambda s: [((t.name,), t.name in s.l2.failing) for t in s.l2.tiers]),
    StateMetric("kvtier_l2_compression_ratio", _GAUGE, _TIER,
                "Payload bytes an L2 tier was given to write per byte it stored them in (its "
                "codec; 1 for codec=none or before any write).",
                _per_tier(lambda t: t.codec.ratio)),
    StateMetric("kvtier_l2_codec_seconds", _COUNTER, ("tier", "operation"),
                "Time an L2 tier's codec spent, by tier and operation (encode on the writer "
                "thread, decode in reads).",
                lambda s: [((t.name, op), sec) for t in s.l2.tiers
                           for op, sec in (("encode", t.codec.encode_s),
                                           ("decode", t.codec.decode_s))]),
    StateMetric("kvtier_l2_codec_bytes", _COUNTER, ("tier", "form"),
                "Payload bytes through an L2 tier's codec: raw (given to write), stored (what "
                "they took), decoded (read back from coded objects).",
                lambda s: [((t.name, form), n) for t in s.l2.tiers
                           for form, n in (("raw", t.codec.raw_bytes),
                                           ("stored", t.codec.stored_bytes),
                                           ("decoded", t.codec.decoded_bytes))]),
    StateMetric("kvtier_l2_operation_duration_seconds", _HISTOGRAM, ("tier", "operation"),
                "Time one L2 tier took per call, by tier and operation (read, write).",
                _l2_latency),
    StateMetric("kvtier_l2_load_bytes_per_second", _GAUGE, _TIER,
                "An L2 tier's measured read throughput (a moving estimate; 0 until it served a "
                "load): what decides whether a load is faster than the engine's recompute.",
                lambda s: [((r.tier,), r.bytes_per_s) for r in s.load_rates]),
    StateMetric("kvtier_l2_load_latency_seconds", _GAUGE, _TIER,
                "An L2 tier's measured round trip before a load moves bytes (a moving estimate).",
                lambda s: [((r.tier,), r.latency_s) for r in s.load_rates]),
    StateMetric("kvtier_write_queue_depth", _GAUGE, (), "Objects waiting for L2 write-through.",
                _one(lambda s: s.l2.queue_depth)),
    StateMetric("kvtier_write_queue_capacity", _GAUGE, (),
                "Capacity of the L2 write-through queue.", _one(lambda s: s.l2.queue_capacity)),
    StateMetric("kvtier_write_queue_dropped", _COUNTER, (),
                "Objects the L2 write-through queue dropped because it was full.",
                _one(lambda s: s.l2.dropped)),
    StateMetric("kvtier_write_queue_written", _COUNTER, (),
                "Objects the L2 writer handed to the tiers.", _one(lambda s: s.l2.written)),
    StateMetric("kvtier_l2_write_errors", _COUNTER, (),
                "Object writes an L2 tier failed (each tier counts separately).",
                _one(lambda s: s.l2.write_errors)),
    StateMetric("kvtier_sessions_active", _GAUGE, (), "Sessions currently held.",
                _one(lambda s: s.sessions.active)),
    StateMetric("kvtier_sessions_created", _COUNTER, (), "Sessions ever created.",
                _one(lambda s: s.sessions.created)),
    StateMetric("kvtier_sessions_expired", _COUNTER, (),
                "Sessions that expired without end_session.", _one(lambda s: s.sessions.expired)),
    StateMetric("kvtier_sessions_orphaned", _COUNTER, (),
                "Expired sessions that still held pinned chunks (requests abandoned mid-flight).",
                _one(lambda s: s.sessions.orphaned)),
    StateMetric("kvtier_session_tokens", _GAUGE, (),
                "Tokens held by all sessions together (bounded by --max-session-tokens).",
                _one(lambda s: s.sessions.tokens)),
    StateMetric("kvtier_sessions_shed", _COUNTER, (),
                "Sessions ended early, longest-idle first, to stay within the session bounds.",
                _one(lambda s: s.sessions.shed)),
    StateMetric("kvtier_fenced_slots", _GAUGE, (),
                "Arena slots quarantined after their lease lapsed, until their owner can no "
                "longer touch them.",
                _one(lambda s: s.fencing.fenced_slots)),
    StateMetric("kvtier_lease_expired", _COUNTER, (),
                "Commits and retrieve-dones answered LEASE_EXPIRED (the client discarded the "
                "bytes).",
                _one(lambda s: s.fencing.lease_expired)),
    StateMetric("kvtier_clients_connected", _GAUGE, (),
                "Engine processes connected to the server.", _one(lambda s: len(s.clients))),
)  # fmt: skip


def _state_families(status: ServerStatus | None) -> Iterator[Metric]:
    """The state metrics filled from `status`, or empty families (for `describe`)."""
    for metric in STATE_METRICS:
        family = metric.kind(metric.name, metric.help, labels=metric.labels)
        for labels, value in [] if status is None else metric.samples(status):
            if isinstance(value, _Histogram):
                assert isinstance(family, HistogramMetricFamily), metric.name
                family.add_metric(labels, value.buckets, value.total)
            else:
                assert not isinstance(family, HistogramMetricFamily), metric.name
                family.add_metric(labels, float(value))
        yield family

"""Prometheus metrics of one kvtier server: live request instruments plus a scrape-time view of
the server's typed status.

Each `Metrics` owns its own `CollectorRegistry` (never prometheus-client's global one), so several
servers, or tests, in one process never collide. Request counters are updated on the hot path by
the engine; gauges such as L1 fill are not: `bind_state` hands over a function returning the
server's `ServerStatus`, read only when someone scrapes `/metrics`.

Label values are bounded: operations come from a fixed table, tiers from the configuration, and
models from the first `max_models` seen (later ones are counted as "other"). Cache salts are
never a label: they are tenant secrets and unbounded.
"""

from __future__ import annotations

import bisect
import logging
import math
import platform
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvtier._version import __version__
from kvtier.keys import shown
from kvtier.server.observe.funnel import STAGES
from kvtier.server.observe.snapshots import (
    FunnelCount,
    HitRatePoint,
    LatencySummary,
    MissCount,
    ModelLookup,
    ServerStatus,
    Traffic,
)
from kvtier.server.routes import ROUTES
from kvtier.storage.tiers.base import LATENCY_BOUNDS_S, TierStats

logger = logging.getLogger(__name__)

# `_created` series double every counter's output for a timestamp nobody graphs; the server is
# the only user of prometheus-client in its process, so turning them off process-wide is safe.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

# Request latency buckets, 50 us to 5 s: a lookup served from L1 takes tens of microseconds, a
# retrieve that falls through to a slow L2 can take seconds.
REQUEST_DURATION_BUCKETS: tuple[float, ...] = (
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    500e-3,
    1.0,
    2.5,
    5.0,
)

#: wire request -> (what the user did, which step of it); the labels metrics carry, as each
#: request's route declares them
OPERATIONS: dict[str, tuple[str, str]] = {route.request.__name__: route.labels for route in ROUTES}

#: why a load could not deliver what a lookup reported: the `reason` label of
#: kvtier_failed_loads_total (docs/operations.md lists them)
FAILED_LOAD_REASONS: tuple[str, ...] = (
    "short",  # a retrieve found fewer chunks than its session's pin holds (cleared, share)
    "pin_lapsed",  # the session's pin lapsed first (its client was silent for --pin-lease)
    "no_lookup",  # no lookup of the session on this server (it restarted since, or it ended)
    "lease_expired",  # the retrieve's lease lapsed before the client said it had copied
)

#: models beyond this many distinct names share the label value "other"
DEFAULT_MAX_MODELS = 32
OTHER = "other"
#: the operation of a request that could not be decoded
UNKNOWN = "unknown"


def operation_of(request_name: str) -> tuple[str, str]:
    """The (operation, step) labels of a wire request name; "unknown" for a request that could
    not be decoded."""
    return OPERATIONS.get(request_name, (UNKNOWN, UNKNOWN))


class HitRateHistory:
    """Lookup totals per fixed interval, kept by the server so a page reload loses nothing."""

    def __init__(self, interval_s: float = 10.0, max_points: int = 360) -> None:
        self.interval_s = interval_s
        self._points: deque[list[float]] = deque(maxlen=max_points)  # [start, requested, hit]
        self._lock = threading.Lock()

    def add(self, requested: int, hit: int, now: float | None = None) -> None:
        now = time.time() if now is None else now
        start = now - now % self.interval_s
        with self._lock:
            if self._points and self._points[-1][0] == start:
                point = self._points[-1]
                point[1] += requested
                point[2] += hit
            else:
                self._points.append([start, requested, hit])

    def points(self) -> list[HitRatePoint]:
        with self._lock:
            return [
                HitRatePoint(time=p[0], requested_tokens=int(p[1]), hit_tokens=int(p[2]))
                for p in self._points
            ]


StateSnapshot = Callable[[], ServerStatus]


class Metrics:
    """The server's instruments; `render()` is what `GET /metrics` returns."""

    def __init__(self, *, max_models: int = DEFAULT_MAX_MODELS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.max_models = max_models
        self.history = HitRateHistory()
        prometheus_client.ProcessCollector(registry=self.registry)
        build = Gauge(
            "kvtier_build_info",
            "Always 1; the labels say which kvtier, protocol and Python serve.",
            ["version", "protocol_version", "python_version"],
            registry=self.registry,
        )
        from kvtier.protocol import PROTOCOL_VERSION

        build.labels(__version__, str(PROTOCOL_VERSION), platform.python_version()).set(1)
        self._requests = Counter(
            "kvtier_requests",
            "Requests handled, by operation (store, retrieve, lookup...) and its wire step.",
            ["operation", "step"],
            registry=self.registry,
        )
        self._request_duration = Histogram(
            "kvtier_request_duration_seconds",
            "Time the server took to handle one request, by operation and step.",
            ["operation", "step"],
            buckets=REQUEST_DURATION_BUCKETS,
            registry=self.registry,
        )
        self._request_errors = Counter(
            "kvtier_request_errors",
            "Requests answered with an error, by operation and error code.",
            ["operation", "code"],
            registry=self.registry,
        )
        self._lookups = Counter(
            "kvtier_lookups", "Lookups, by model.", ["model"], registry=self.registry
        )
        self._lookup_requested = Counter(
            "kvtier_lookup_requested_tokens",
            "Tokens asked about by lookups, by model.",
            ["model"],
            registry=self.registry,
        )
        self._lookup_hit = Counter(
            "kvtier_lookup_hit_tokens",
            "Tokens lookups found cached (a prefix of the requested ones), by model.",
            ["model"],
            registry=self.registry,
        )
        self._miss_tokens = Counter(
            "kvtier_lookup_miss_tokens",
            "Tokens lookups did not hit, by why (reason) and, where it has one, the tier the "
            "reason is about: evicted from it, its load failed or was slower than recomputing.",
            ["reason", "tier"],
            registry=self.registry,
        )
        self._funnel_tokens = Counter(
            "kvtier_hit_funnel_tokens",
            "Lookup tokens by tier and stage of the hit funnel: present (the tier held them), "
            "worth_loading (and loading beats recomputing), loaded (served as a hit from it).",
            ["tier", "stage"],
            registry=self.registry,
        )
        self._per_funnel: dict[tuple[str, str], tuple[Counter, list[int]]] = {}
        self._stored_bytes = Counter(
            "kvtier_stored_bytes", "KV bytes committed into L1 by clients.", registry=self.registry
        )
        self._retrieved_bytes = Counter(
            "kvtier_retrieved_bytes", "KV bytes handed out to clients.", registry=self.registry
        )
        handoff_chunks = Counter(
            "kvtier_handoff_chunks",
            "Chunks of hand-off objects (a prefill instance's KV for one decode instance), by "
            "event: stored, read (the decoder ended the hand-off), lapsed (its lease ran out).",
            ["event"],
            registry=self.registry,
        )
        self._handoff_chunks = {e: handoff_chunks.labels(e) for e in ("stored", "read", "lapsed")}
        self._handoff_bytes = Counter(
            "kvtier_handoff_stored_bytes",
            "KV bytes committed into L1 as hand-off objects.",
            registry=self.registry,
        )
        failed = Counter(
            "kvtier_failed_loads",
            "Retrieves that could not deliver what the lookup reported, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self._failed_loads = {reason: failed.labels(reason) for reason in FAILED_LOAD_REASONS}
        self._state_lock = threading.Lock()
        self._models_lock = threading.Lock()
        # labelled children by label values (dict reads and writes are atomic under the GIL)
        self._per_operation: dict[str, tuple[Counter, Histogram]] = {}
        self._per_model: dict[str, tuple[Counter, Counter, Counter]] = {}
        self._model_totals: dict[str, list[int]] = {}  # label -> [requested, hit, lookups]
        # (reason, tier) -> (child, [tokens]); reasons are a fixed table, tiers configured
        self._per_miss: dict[tuple[str, str], tuple[Counter, list[int]]] = {}
        self._stored = 0
        self._retrieved = 0
        self._state_collector: _StateCollector | None = None

    # -- hot path ---------------------------------------------------------------------------

    def observe_request(self, request_name: str, seconds: float) -> None:
        """Count one handled request (its wire name) and record how long it took."""
        # labels() costs ~4 us a call; this runs on every request, so keep the children.
        children = self._per_operation.get(request_name)
        if children is None:
            labels = operation_of(request_name)
            children = self._per_operation[request_name] = (
                self._requests.labels(*labels),
                self._request_duration.labels(*labels),
            )
        children[0].inc()
        children[1].observe(seconds)

    def count_error(self, request_name: str, code: str) -> None:
        """Count one request answered with the error `code` (an ErrorCode name)."""
        self._request_errors.labels(operation_of(request_name)[0], code).inc()

    def model_label(self, model: str) -> str:
        """`model`, or "other" once `max_models` distinct models have been seen."""
        if model in self._per_model:
            return model
        with self._models_lock:
            return model if len(self._per_model) < self.max_models else OTHER

    def observe_lookup(self, model: str, requested_tokens: int, hit_tokens: int) -> None:
        """Record one lookup: how many tokens were asked about and how many were cached."""
        if requested_tokens < 0 or hit_tokens < 0 or hit_tokens > requested_tokens:
            raise ValueError(
                f"lookup counts must satisfy 0 <= hit_tokens <= requested_tokens, got "
                f"requested_tokens={requested_tokens}, hit_tokens={hit_tokens}"
            )
        label = self.model_label(shown(model))
        children = self._per_model.get(label)
        if children is None:
            with self._models_lock:
                children = self._per_model.get(label)
                if children is None:
                    children = self._per_model[label] = (
                        self._lookups.labels(label),
                        self._lookup_requested.labels(label),
                        self._lookup_hit.labels(label),
                    )
                    self._model_totals[label] = [0, 0, 0]
        children[0].inc()
        children[1].inc(requested_tokens)
        children[2].inc(hit_tokens)
        totals = self._model_totals[label]
        totals[0] += requested_tokens
        totals[1] += hit_tokens
        totals[2] += 1
        self.history.add(requested_tokens, hit_tokens)

    def observe_misses(self, tally: dict[tuple[str, str], int]) -> None:
        """Count one lookup's missed tokens by (reason, tier) (see `server/misses.py`)."""
        for labels, tokens in tally.items():
            entry = self._per_miss.get(labels)
            if entry is None:
                with self._models_lock:
                    entry = self._per_miss.get(labels)
                    if entry is None:
                        entry = self._per_miss[labels] = (self._miss_tokens.labels(*labels), [0])
            entry[0].inc(tokens)
            entry[1][0] += tokens

    def observe_funnel(self, tally: dict[tuple[str, str], int]) -> None:
        """Count one lookup's hit funnel by (tier, stage) (see `observe/funnel.py`)."""
        for labels, tokens in tally.items():
            entry = self._per_funnel.get(labels)
            if entry is None:
                with self._models_lock:
                    entry = self._per_funnel.get(labels)
                    if entry is None:
                        child = self._funnel_tokens.labels(*labels)
                        entry = self._per_funnel[labels] = (child, [0])
            entry[0].inc(tokens)
            entry[1][0] += tokens

    def funnel(self) -> list[FunnelCount]:
        """Tokens since start by (tier, stage)."""
        rows = [
            FunnelCount(tier=tier, stage=stage, tokens=entry[1][0])
            for (tier, stage), entry in list(self._per_funnel.items())
        ]
        return sorted(rows, key=lambda r: (r.tier != "l1", r.tier, STAGES.index(r.stage)))

    def misses(self) -> list[MissCount]:
        """Missed tokens since start by (reason, tier), most first."""
        rows = [
            MissCount(reason=reason, tier=tier, tokens=entry[1][0])
            for (reason, tier), entry in list(self._per_miss.items())
        ]
        return sorted(rows, key=lambda r: (-r.tokens, r.reason, r.tier))

    def add_stored_bytes(self, n: int) -> None:
        """Count `n` KV bytes stored by clients."""
        self._stored_bytes.inc(n)
        self._stored += n

    def count_handoff(self, event: str, chunks: int, nbytes: int) -> None:
        """Count hand-off chunks `event` (stored, read, lapsed), and the bytes stored."""
        self._handoff_chunks[event].inc(chunks)
        if nbytes:
            self._handoff_bytes.inc(nbytes)

    def count_failed_load(self, reason: str) -> None:
        """Count one load that fell short of its lookup's report (a FAILED_LOAD_REASONS value)."""
        self._failed_loads[reason].inc()

    def add_retrieved_bytes(self, n: int) -> None:
        """Count `n` KV bytes retrieved by clients."""
        self._retrieved_bytes.inc(n)
        self._retrieved += n

    # -- views for the status ------------------------------------------------------------------

    def models(self) -> list[ModelLookup]:
        """Lookup totals per model label, busiest first."""
        rows = [
            ModelLookup(model=m, requested_tokens=t[0], hit_tokens=t[1], lookups=t[2])
            for m, t in list(self._model_totals.items())
        ]
        return sorted(rows, key=lambda r: -r.requested_tokens)

    def traffic(self) -> Traffic:
        return Traffic(stored_bytes=self._stored, retrieved_bytes=self._retrieved)

    def latency(self) -> list[LatencySummary]:
        """Per operation (steps summed): count, mean and bucket-bound p50/p99."""
        buckets: dict[str, dict[float, float]] = {}
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        for family in self._request_duration.collect():
            for s in family.samples:
                op = s.labels["operation"]
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    by_le = buckets.setdefault(op, {})
                    by_le[le] = by_le.get(le, 0.0) + s.value
                elif s.name.endswith("_sum"):
                    sums[op] = sums.get(op, 0.0) + s.value
                elif s.name.endswith("_count"):
                    counts[op] = counts.get(op, 0.0) + s.value
        out = []
        for op, by_le in sorted(buckets.items()):
            n = counts.get(op, 0.0)
            if not n:
                continue
            bounds = sorted(by_le)
            cumulative = [by_le[b] for b in bounds]

            out.append(
                LatencySummary(
                    operation=op,
                    count=int(n),
                    mean_s=sums.get(op, 0.0) / n,
                    p50_s=_quantile_bound(bounds, cumulative, 0.5),
                    p99_s=_quantile_bound(bounds, cumulative, 0.99),
                )
            )
        return out

    # -- scrape-time state -------------------------------------------------------------------

    def bind_state(self, snapshot: StateSnapshot) -> None:
        """Export the server's state, read from `snapshot()` at each scrape.

        Binding again replaces the previous snapshot function.
        """
        collector = _StateCollector(snapshot)
        with self._state_lock:
            if self._state_collector is not None:
                self.registry.unregister(self._state_collector)
            self.registry.register(collector)
            self._state_collector = collector

    def render(self) -> bytes:
        """Every metric in Prometheus text exposition format."""
        return generate_latest(self.registry)


def _quantile_bound(bounds: list[float], cumulative: list[float], q: float) -> float:
    """The upper bound of the histogram bucket holding quantile `q`."""
    i = bisect.bisect_left(cumulative, q * cumulative[-1])
    return bounds[min(i, len(bounds) - 1)]


class _StateCollector:
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

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
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

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
from kvtier.server.observe.snapshots import (
    HitRatePoint,
    LatencySummary,
    MissCount,
    ModelLookup,
    ServerStatus,
    Traffic,
)
from kvtier.storage.tiers.base import LATENCY_BOUNDS_S

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

#: wire request -> (what the user did, which step of it); the labels metrics carry
OPERATIONS: dict[str, tuple[str, str]] = {
    "Hello": ("connect", "hello"),
    "Heartbeat": ("heartbeat", "heartbeat"),
    "Goodbye": ("disconnect", "goodbye"),
    "Register": ("register", "register"),
    "Lookup": ("lookup", "lookup"),
    "LookupPoll": ("lookup", "poll"),
    "Reserve": ("store", "reserve"),
    "Commit": ("store", "commit"),
    "Abort": ("store", "abort"),
    "StoreInline": ("store", "inline"),
    "Retrieve": ("retrieve", "start"),
    "RetrieveDone": ("retrieve", "done"),
    "Release": ("release", "release"),
    "EndSession": ("end_session", "end_session"),
}

#: why a load could not deliver what a lookup reported: the `reason` label of
#: kvtier_failed_loads_total (the README lists them)
FAILED_LOAD_REASONS: tuple[str, ...] = (
    "short",  # a retrieve found fewer chunks than its session's pin holds (cleared, share)
    "pin_lapsed",  # the session's pin lapsed first (its client was silent for --pin-lease)
    "no_lookup",  # no lookup of the session on this server (it restarted since, or it ended)
    "lease_expired",  # the retrieve's lease lapsed before the client said it had copied
)

#: models beyond this many distinct names share the label value "other"
DEFAULT_MAX_MODELS = 32
OTHER = "other"


def operation_of(request_name: str) -> tuple[str, str]:
    """The (operation, step) labels of a wire request name; unknown names map to snake_case."""
    known = OPERATIONS.get(request_name)
    if known is not None:
        return known
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", request_name).lower() or "unknown"
    return snake, snake


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
        self._stored_bytes = Counter(
            "kvtier_stored_bytes", "KV bytes committed into L1 by clients.", registry=self.registry
        )
        self._retrieved_bytes = Counter(
            "kvtier_retrieved_bytes", "KV bytes handed out to clients.", registry=self.registry
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


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], float(value))
    return family


def _counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], float(value))
    return family


def _state_families(status: ServerStatus | None) -> Iterator[Metric]:
    """The state metrics filled from `status`, or empty families (for `describe`)."""
    s = status
    yield _gauge(
        "kvtier_ready", "1 when the arena is ready and serving.", None if s is None else s.ready
    )
    yield _gauge(
        "kvtier_degraded",
        "1 while the server serves with a failing part (an L2 tier): see /health.",
        None if s is None else s.health == "degraded",
    )
    yield _gauge(
        "kvtier_uptime_seconds",
        "Seconds since the server started.",
        None if s is None else s.uptime_s,
    )
    yield _gauge(
        "kvtier_l1_used_bytes",
        "Bytes allocated in the L1 arena.",
        None if s is None else s.l1.used_bytes,
    )
    yield _gauge(
        "kvtier_l1_capacity_bytes",
        "Size of the L1 arena in bytes.",
        None if s is None else s.l1.capacity_bytes,
    )
    yield _gauge("kvtier_l1_groups", "Chunk groups held in L1.", None if s is None else s.l1.groups)
    yield _gauge(
        "kvtier_l1_pinned_groups",
        "L1 chunk groups pinned by lookups.",
        None if s is None else s.l1.pinned_groups,
    )
    held = GaugeMetricFamily(
        "kvtier_tenant_l1_bytes",
        "L1 bytes a tenant holds that eviction cannot take back, by kind (staging, quarantined, "
        "pinned): what its --tenant-*-share options bound.",
        labels=["tenant", "kind"],
    )
    for usage in [] if s is None else s.l1.tenants:
        held.add_metric([usage.tenant, "staging"], float(usage.staging_bytes))
        held.add_metric([usage.tenant, "quarantined"], float(usage.fenced_bytes))
        held.add_metric([usage.tenant, "pinned"], float(usage.pinned_bytes))
    yield held

    evictions = CounterMetricFamily(
        "kvtier_evictions", "Objects evicted to make room, by tier (l1 counts chunk groups).",
        labels=["tier"],
    )  # fmt: skip
    evicted_bytes = CounterMetricFamily(
        "kvtier_evicted_bytes", "Bytes freed by L1 evictions.", labels=["tier"]
    )
    if s is not None:
        evictions.add_metric(["l1"], float(s.l1.evictions))
        evicted_bytes.add_metric(["l1"], float(s.l1.evicted_bytes))
        for tier in s.l2.tiers:
            evictions.add_metric([tier.name], float(tier.extra.get("evictions", 0)))
    yield evictions
    yield evicted_bytes

    per_tier: list[tuple[GaugeMetricFamily | CounterMetricFamily, str]] = [
        (GaugeMetricFamily("kvtier_l2_used_bytes", "Bytes stored in an L2 tier.", labels=["tier"]),
         "used_bytes"),
        (GaugeMetricFamily("kvtier_l2_capacity_bytes",
                           "Capacity of an L2 tier in bytes (0 = unbounded).", labels=["tier"]),
         "capacity_bytes"),
        (GaugeMetricFamily("kvtier_l2_objects", "Objects stored in an L2 tier.", labels=["tier"]),
         "objects"),
        (CounterMetricFamily("kvtier_l2_hits", "Reads an L2 tier served.", labels=["tier"]),
         "hits"),
        (CounterMetricFamily("kvtier_l2_misses", "Reads an L2 tier could not serve.",
                             labels=["tier"]), "misses"),
        (CounterMetricFamily("kvtier_l2_errors",
                             "Failed L2 operations (backend unreachable, I/O error).",
                             labels=["tier"]), "errors"),
        (CounterMetricFamily("kvtier_l2_corrupt",
                             "L2 objects found damaged on read (deleted, never served).",
                             labels=["tier"]), "corrupt"),
        (GaugeMetricFamily("kvtier_l2_failing",
                           "1 while an L2 tier's errors grow (the server reports degraded).",
                           labels=["tier"]), "failing"),
    ]  # fmt: skip
    for family, field in per_tier:
        if s is not None:
            for tier in s.l2.tiers:
                value = tier.name in s.l2.failing if field == "failing" else getattr(tier, field)
                family.add_metric([tier.name], float(value))
        yield family
    latency = HistogramMetricFamily(
        "kvtier_l2_operation_duration_seconds",
        "Time one L2 tier took per call, by tier and operation (read, write).",
        labels=["tier", "operation"],
    )
    if s is not None:
        for tier in s.l2.tiers:
            for operation, lat in (("read", tier.read_latency), ("write", tier.write_latency)):
                running, buckets = 0, []
                for bound, n in zip((*LATENCY_BOUNDS_S, math.inf), lat.buckets, strict=True):
                    running += n
                    buckets.append(("+Inf" if bound == math.inf else repr(bound), running))
                latency.add_metric([tier.name, operation], buckets, lat.total_s)
    yield latency
    throughput = GaugeMetricFamily(
        "kvtier_l2_load_bytes_per_second",
        "An L2 tier's measured read throughput (a moving estimate; 0 until it served a load): "
        "what decides whether a load is faster than the engine's recompute.",
        labels=["tier"],
    )
    round_trip = GaugeMetricFamily(
        "kvtier_l2_load_latency_seconds",
        "An L2 tier's measured round trip before a load moves bytes (a moving estimate).",
        labels=["tier"],
    )
    for rate in [] if s is None else s.load_rates:
        throughput.add_metric([rate.tier], rate.bytes_per_s)
        round_trip.add_metric([rate.tier], rate.latency_s)
    yield throughput
    yield round_trip

    l2 = s.l2 if s is not None else None
    yield _gauge(
        "kvtier_write_queue_depth",
        "Objects waiting for L2 write-through.",
        None if l2 is None else l2.queue_depth,
    )
    yield _gauge(
        "kvtier_write_queue_capacity",
        "Capacity of the L2 write-through queue.",
        None if l2 is None else l2.queue_capacity,
    )
    yield _counter(
        "kvtier_write_queue_dropped",
        "Objects the L2 write-through queue dropped because it was full.",
        None if l2 is None else l2.dropped,
    )
    yield _counter(
        "kvtier_write_queue_written",
        "Objects the L2 writer handed to the tiers.",
        None if l2 is None else l2.written,
    )
    yield _counter(
        "kvtier_l2_write_errors",
        "Object writes an L2 tier failed (each tier counts separately).",
        None if l2 is None else l2.write_errors,
    )
    sessions = s.sessions if s is not None else None
    yield _gauge(
        "kvtier_sessions_active",
        "Sessions currently held.",
        None if sessions is None else sessions.active,
    )
    yield _counter(
        "kvtier_sessions_created",
        "Sessions ever created.",
        None if sessions is None else sessions.created,
    )
    yield _counter(
        "kvtier_sessions_expired",
        "Sessions that expired without end_session.",
        None if sessions is None else sessions.expired,
    )
    yield _counter(
        "kvtier_sessions_orphaned",
        "Expired sessions that still held pinned chunks (requests abandoned mid-flight).",
        None if sessions is None else sessions.orphaned,
    )
    yield _gauge(
        "kvtier_session_tokens",
        "Tokens held by all sessions together (bounded by --max-session-tokens).",
        None if sessions is None else sessions.tokens,
    )
    yield _counter(
        "kvtier_sessions_shed",
        "Sessions ended early, longest-idle first, to stay within the session bounds.",
        None if sessions is None else sessions.shed,
    )
    fencing = s.fencing if s is not None else None
    yield _gauge(
        "kvtier_fenced_slots",
        "Arena slots quarantined after their lease lapsed, until their owner can no longer "
        "touch them.",
        None if fencing is None else fencing.fenced_slots,
    )
    yield _counter(
        "kvtier_lease_expired",
        "Commits and retrieve-dones answered LEASE_EXPIRED (the client discarded the bytes).",
        None if fencing is None else fencing.lease_expired,
    )
    yield _gauge(
        "kvtier_clients_connected",
        "Engine processes connected to the server.",
        len(s.clients) if s is not None else None,
    )

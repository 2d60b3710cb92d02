"""Prometheus metrics of one kvtier server: live request instruments plus a scrape-time view of
the engine's state.

Each `Metrics` owns its own `CollectorRegistry` (never prometheus-client's global one), so several
servers, or tests, in one process never collide. Request counters are updated on the hot path by
the engine; gauges such as L1 fill are not: `bind_state` hands over the engine's `status()` and
they are read from it only when someone scrapes `/metrics`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

logger = logging.getLogger(__name__)

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

StateSnapshot = Callable[[], dict[str, Any]]


class Metrics:
    """The server's instruments; `render()` is what `GET /metrics` returns."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "kvtier_requests",
            "Requests handled, by operation.",
            ["operation"],
            registry=self.registry,
        )
        self._request_duration = Histogram(
            "kvtier_request_duration_seconds",
            "Time to handle one request, by operation.",
            ["operation"],
            buckets=REQUEST_DURATION_BUCKETS,
            registry=self.registry,
        )
        self._request_errors = Counter(
            "kvtier_request_errors",
            "Requests answered with an error, by operation and error code.",
            ["operation", "code"],
            registry=self.registry,
        )
        self._lookup_requested = Counter(
            "kvtier_lookup_requested_tokens",
            "Tokens asked about by lookups.",
            ["model", "cache_salt"],
            registry=self.registry,
        )
        self._lookup_hit = Counter(
            "kvtier_lookup_hit_tokens",
            "Tokens lookups found cached (a prefix of the requested ones).",
            ["model", "cache_salt"],
            registry=self.registry,
        )
        self._stored_bytes = Counter(
            "kvtier_stored_bytes", "KV bytes committed into L1 by clients.", registry=self.registry
        )
        self._retrieved_bytes = Counter(
            "kvtier_retrieved_bytes", "KV bytes handed out to clients.", registry=self.registry
        )
        self._state_lock = threading.Lock()
        # labelled children by label values (dict reads and writes are atomic under the GIL)
        self._per_operation: dict[str, tuple[Any, Any]] = {}
        self._per_tenant: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._state_collector: _StateCollector | None = None

    def observe_request(self, operation: str, seconds: float) -> None:
        """Count one handled request and record how long it took."""
        # labels() costs ~4 us a call; this runs on every request, so keep the children.
        children = self._per_operation.get(operation)
        if children is None:
            children = self._per_operation[operation] = (
                self._requests.labels(operation),
                self._request_duration.labels(operation),
            )
        children[0].inc()
        children[1].observe(seconds)

    def count_error(self, operation: str, code: str) -> None:
        """Count one request answered with the error `code` (e.g. an ErrorCode name)."""
        self._request_errors.labels(operation, code).inc()

    def observe_lookup(
        self, model: str, cache_salt: str, requested_tokens: int, hit_tokens: int
    ) -> None:
        """Record one lookup: how many tokens were asked about and how many were cached."""
        if requested_tokens < 0 or hit_tokens < 0 or hit_tokens > requested_tokens:
            raise ValueError(
                f"lookup counts must satisfy 0 <= hit_tokens <= requested_tokens, got "
                f"requested_tokens={requested_tokens}, hit_tokens={hit_tokens}"
            )
        children = self._per_tenant.get((model, cache_salt))
        if children is None:
            children = self._per_tenant[model, cache_salt] = (
                self._lookup_requested.labels(model, cache_salt),
                self._lookup_hit.labels(model, cache_salt),
            )
        children[0].inc(requested_tokens)
        children[1].inc(hit_tokens)

    def add_stored_bytes(self, n: int) -> None:
        """Count `n` KV bytes stored by clients."""
        self._stored_bytes.inc(n)

    def add_retrieved_bytes(self, n: int) -> None:
        """Count `n` KV bytes retrieved by clients."""
        self._retrieved_bytes.inc(n)

    def bind_state(self, snapshot: StateSnapshot) -> None:
        """Export the engine's state, read from `snapshot()` (its `status()`) at each scrape.

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


class _StateCollector:
    """Turns one `status()` snapshot into gauge and counter families at scrape time."""

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


def _state_families(status: dict[str, Any] | None) -> Iterator[Metric]:
    """The state metrics filled from `status` (the engine's `status()` shape), or empty."""
    l1: dict[str, Any] = status["l1"] if status is not None else {}
    l2: dict[str, Any] = status["l2"] if status is not None else {}
    sessions: dict[str, Any] = status["sessions"] if status is not None else {}

    def gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc)
        if status is not None:
            family.add_metric([], float(value))
        return family

    def counter(name: str, doc: str, value: Any) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc)
        if status is not None:
            family.add_metric([], float(value))
        return family

    ready = status["ready"] if status is not None else None
    yield gauge("kvtier_ready", "1 when the arena is ready and serving.", ready)
    yield gauge("kvtier_l1_used_bytes", "Bytes allocated in the L1 arena.", l1.get("used_bytes"))
    yield gauge(
        "kvtier_l1_capacity_bytes", "Size of the L1 arena in bytes.", l1.get("capacity_bytes")
    )
    yield gauge("kvtier_l1_groups", "Chunk groups held in L1.", l1.get("groups"))
    yield gauge(
        "kvtier_l1_pinned_groups", "L1 chunk groups pinned by sessions.", l1.get("pinned_groups")
    )
    yield counter("kvtier_evictions_total", "Chunk groups evicted from L1.", l1.get("evictions"))
    yield counter(
        "kvtier_evicted_bytes_total", "Bytes freed by L1 evictions.", l1.get("evicted_bytes")
    )

    tier_families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "used_bytes": GaugeMetricFamily(
            "kvtier_l2_used_bytes", "Bytes stored in an L2 tier.", labels=["tier"]
        ),
        "capacity_bytes": GaugeMetricFamily(
            "kvtier_l2_capacity_bytes",
            "Capacity of an L2 tier in bytes (0 = unbounded).",
            labels=["tier"],
        ),
        "objects": GaugeMetricFamily(
            "kvtier_l2_objects", "Objects stored in an L2 tier.", labels=["tier"]
        ),
        "hits": CounterMetricFamily(
            "kvtier_l2_hits_total", "Reads an L2 tier served.", labels=["tier"]
        ),
        "misses": CounterMetricFamily(
            "kvtier_l2_misses_total", "Reads an L2 tier could not serve.", labels=["tier"]
        ),
    }
    for tier in l2.get("tiers", []):
        for field, family in tier_families.items():
            family.add_metric([str(tier["name"])], float(tier[field]))
    yield from tier_families.values()

    yield gauge(
        "kvtier_write_queue_depth", "Objects waiting for L2 write-through.", l2.get("queue_depth")
    )
    yield gauge(
        "kvtier_write_queue_capacity",
        "Capacity of the L2 write-through queue.",
        l2.get("queue_capacity"),
    )
    yield counter(
        "kvtier_write_queue_dropped_total",
        "Objects the L2 write-through queue dropped because it was full.",
        l2.get("dropped"),
    )
    yield gauge("kvtier_sessions_active", "Sessions currently held.", sessions.get("active"))
    yield counter(
        "kvtier_sessions_created_total", "Sessions ever created.", sessions.get("created")
    )
    yield counter(
        "kvtier_sessions_expired_total",
        "Sessions ended by their idle timeout.",
        sessions.get("expired"),
    )
    yield counter(
        "kvtier_sessions_orphaned_total",
        "Sessions dropped because their client went away.",
        sessions.get("orphaned"),
    )
    yield gauge(
        "kvtier_clients_connected",
        "Engine processes connected to the server.",
        len(status["clients"]) if status is not None else None,
    )

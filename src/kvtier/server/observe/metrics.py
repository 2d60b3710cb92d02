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
import platform
import threading
import time
from collections import deque

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtier._version import __version__
from kvtier.keys import shown
from kvtier.server.observe.funnel import STAGES
from kvtier.server.observe.operations import operation_of
from kvtier.server.observe.snapshots import (
    FunnelCount,
    HitRatePoint,
    LatencySummary,
    MissCount,
    ModelLookup,
    Traffic,
)
from kvtier.server.observe.state_metrics import StateCollector, StateSnapshot

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
            "event: stored, read (the decoder ended the hand-off), lapsed (its lease ran out), "
            "released (a shared tier holds it: no longer pinned in L1).",
            ["event"],
            registry=self.registry,
        )
        self._handoff_chunks = {
            e: handoff_chunks.labels(e) for e in ("stored", "read", "lapsed", "released")
        }
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
        self._state_collector: StateCollector | None = None

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
        """Count hand-off chunks `event` (stored, read, lapsed, released), and the bytes
        stored."""
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
        collector = StateCollector(snapshot)
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

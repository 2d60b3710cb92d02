"""The KV event publisher's counters as Prometheus metrics, read at scrape time.

Registered on the server's metrics registry only when `--kv-events-endpoint` is set, so a server
without KV events exports none of these (rather than zeros that would read as "nothing
published").
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.server.observe.events import EventPublisher

__all__ = ["EventMetrics"]


class EventMetrics:
    """A prometheus-client collector over one `EventPublisher`'s counters."""

    def __init__(self, publisher: EventPublisher) -> None:
        self._publisher = publisher

    def describe(self) -> Iterable[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(self._publisher))

    @staticmethod
    def _families(publisher: EventPublisher | None) -> Iterable[Metric]:
        stats = publisher.stats() if publisher is not None else None
        rows: tuple[tuple[type[CounterMetricFamily | GaugeMetricFamily], str, str, int], ...] = (
            (CounterMetricFamily, "kvtier_kv_events_published",
             "KV events published to routers (a chain of stored chunks is one event).",
             stats.events if stats else 0),
            (CounterMetricFamily, "kvtier_kv_event_batches_published",
             "KV event batches published (one sequence number each).",
             stats.batches if stats else 0),
            (CounterMetricFamily, "kvtier_kv_events_dropped",
             "Chunk reports dropped because the publisher fell behind: routers miss them (the "
             "sequence numbers skip one so that they can tell).",
             stats.dropped_reports if stats else 0),
            (CounterMetricFamily, "kvtier_kv_event_replays",
             "Replay requests answered (a router catching up after a gap).",
             stats.replays if stats else 0),
            (GaugeMetricFamily, "kvtier_kv_event_batches_buffered",
             "Event batches kept for replay (bounded by --kv-events-buffer).",
             stats.buffered if stats else 0),
        )  # fmt: skip
        for kind, name, help_text, value in rows:
            family = kind(name, help_text)
            if stats is not None:
                family.add_metric([], float(value))
            yield family

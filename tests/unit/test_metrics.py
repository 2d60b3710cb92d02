"""kvtier.metrics: the live instruments and the scrape-time state collector."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kvtier.metrics import REQUEST_DURATION_BUCKETS, Metrics

STATUS: dict[str, Any] = {
    "version": "0.1.0",
    "uptime_s": 12.5,
    "ready": True,
    "config": {"l1_size": 1 << 30},
    "l1": {
        "capacity_bytes": 1 << 30,
        "used_bytes": 3 << 20,
        "groups": 7,
        "ready_groups": 6,
        "pinned_groups": 2,
        "staging_shards": 1,
        "evictions": 11,
        "evicted_bytes": 5 << 20,
    },
    "l2": {
        "queue_depth": 3,
        "queue_capacity": 1024,
        "policy": "drop",
        "submitted": 40,
        "written": 30,
        "dropped": 4,
        "write_errors": 0,
        "tiers": [
            {
                "name": "disk",
                "used_bytes": 9 << 20,
                "capacity_bytes": 50 << 30,
                "objects": 9,
                "hits": 5,
                "misses": 2,
                "corrupt": 0,
                "errors": 0,
            },
            {
                "name": "redis",
                "used_bytes": 1 << 20,
                "capacity_bytes": 0,
                "objects": 1,
                "hits": 0,
                "misses": 8,
                "corrupt": 1,
                "errors": 3,
            },
        ],
    },
    "clients": [
        {"client_id": "a", "connected_s": 3.0, "last_seen_s": 0.1, "registrations": []},
        {"client_id": "b", "connected_s": 2.0, "last_seen_s": 0.2, "registrations": []},
    ],
    "sessions": {"active": 4, "created": 20, "expired": 3, "orphaned": 1},
    "lookup": {"requested_tokens": 1024, "hit_tokens": 512},
    "recent_errors": [],
}


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a render, parsed back from the text format, keyed by (name, labels)."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_request_instruments_count_and_time() -> None:
    m = Metrics()
    m.observe_request("lookup", 80e-6)
    m.observe_request("lookup", 0.2)
    m.observe_request("store", 7.0)
    m.count_error("store", "NO_SPACE")
    m.count_error("store", "NO_SPACE")
    got = samples(m)
    assert got[("kvtier_requests_total", (("operation", "lookup"),))] == 2
    assert got[("kvtier_requests_total", (("operation", "store"),))] == 1
    lookup = ("operation", "lookup")
    assert got[("kvtier_request_duration_seconds_count", (lookup,))] == 2
    assert got[("kvtier_request_duration_seconds_sum", (lookup,))] == pytest.approx(0.20008)
    assert got[("kvtier_request_duration_seconds_bucket", (("le", "5e-05"), lookup))] == 0
    assert got[("kvtier_request_duration_seconds_bucket", (("le", "0.0001"), lookup))] == 1
    assert got[("kvtier_request_duration_seconds_bucket", (("le", "0.25"), lookup))] == 2
    store_inf = (("le", "+Inf"), ("operation", "store"))
    assert got[("kvtier_request_duration_seconds_bucket", store_inf)] == 1
    store_5s = (("le", "5.0"), ("operation", "store"))
    assert got[("kvtier_request_duration_seconds_bucket", store_5s)] == 0
    errors = (("code", "NO_SPACE"), ("operation", "store"))
    assert got[("kvtier_request_errors_total", errors)] == 2
    assert REQUEST_DURATION_BUCKETS[0] == 50e-6 and REQUEST_DURATION_BUCKETS[-1] == 5.0


def test_lookup_and_byte_counters() -> None:
    m = Metrics()
    m.observe_lookup("llama", "", 512, 256)
    m.observe_lookup("llama", "", 256, 256)
    m.observe_lookup("llama", "tenant-b", 256, 0)
    m.add_stored_bytes(4096)
    m.add_stored_bytes(100)
    m.add_retrieved_bytes(8192)
    got = samples(m)
    plain = (("cache_salt", ""), ("model", "llama"))
    salted = (("cache_salt", "tenant-b"), ("model", "llama"))
    assert got[("kvtier_lookup_requested_tokens_total", plain)] == 768
    assert got[("kvtier_lookup_hit_tokens_total", plain)] == 512
    assert got[("kvtier_lookup_requested_tokens_total", salted)] == 256
    assert got[("kvtier_lookup_hit_tokens_total", salted)] == 0
    assert got[("kvtier_stored_bytes_total", ())] == 4196
    assert got[("kvtier_retrieved_bytes_total", ())] == 8192


def test_lookup_refuses_impossible_counts() -> None:
    m = Metrics()
    with pytest.raises(ValueError, match="hit_tokens=600"):
        m.observe_lookup("llama", "", 512, 600)
    with pytest.raises(ValueError, match="requested_tokens=-1"):
        m.observe_lookup("llama", "", -1, 0)


def test_state_collector_exports_status_at_scrape_time() -> None:
    state = copy.deepcopy(STATUS)
    m = Metrics()
    m.bind_state(lambda: state)
    got = samples(m)
    expected = {
        "kvtier_ready": 1,
        "kvtier_l1_used_bytes": 3 << 20,
        "kvtier_l1_capacity_bytes": 1 << 30,
        "kvtier_evictions_total": 11,
        "kvtier_evicted_bytes_total": 5 << 20,
        "kvtier_write_queue_depth": 3,
        "kvtier_write_queue_dropped_total": 4,
        "kvtier_sessions_active": 4,
        "kvtier_sessions_created_total": 20,
        "kvtier_sessions_expired_total": 3,
        "kvtier_sessions_orphaned_total": 1,
        "kvtier_clients_connected": 2,
    }
    for name, value in expected.items():
        assert got[(name, ())] == value, name
    assert got[("kvtier_l2_used_bytes", (("tier", "disk"),))] == 9 << 20
    assert got[("kvtier_l2_capacity_bytes", (("tier", "disk"),))] == 50 << 30
    assert got[("kvtier_l2_used_bytes", (("tier", "redis"),))] == 1 << 20
    assert got[("kvtier_l2_capacity_bytes", (("tier", "redis"),))] == 0
    assert got[("kvtier_l2_misses_total", (("tier", "redis"),))] == 8

    # Read again at the next scrape, not cached at bind time.
    state["l1"]["used_bytes"] = 5 << 20
    state["sessions"]["active"] = 0
    state["clients"].pop()
    got = samples(m)
    assert got[("kvtier_l1_used_bytes", ())] == 5 << 20
    assert got[("kvtier_sessions_active", ())] == 0
    assert got[("kvtier_clients_connected", ())] == 1


def test_rebinding_replaces_the_state_source() -> None:
    first, second = copy.deepcopy(STATUS), copy.deepcopy(STATUS)
    second["l1"]["used_bytes"] = 42
    m = Metrics()
    m.bind_state(lambda: first)
    m.bind_state(lambda: second)
    assert samples(m)[("kvtier_l1_used_bytes", ())] == 42


def test_failing_snapshot_keeps_request_metrics(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("engine lock poisoned")

    m = Metrics()
    m.observe_request("lookup", 0.001)
    m.bind_state(broken)
    got = samples(m)
    assert got[("kvtier_requests_total", (("operation", "lookup"),))] == 1
    assert ("kvtier_l1_used_bytes", ()) not in got
    assert "engine lock poisoned" in caplog.text


def test_each_instance_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.observe_request("lookup", 0.001)
    assert a.registry is not b.registry and a.registry is not REGISTRY
    assert ("kvtier_requests_total", (("operation", "lookup"),)) not in samples(b)
    assert REGISTRY.get_sample_value("kvtier_requests_total", {"operation": "lookup"}) is None

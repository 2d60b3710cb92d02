"""kvtier.server.observe.metrics: the live instruments and the scrape-time state collector."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kvtier._version import __version__
from kvtier.server.fencing import FencingStats
from kvtier.server.observe.metrics import REQUEST_DURATION_BUCKETS, HitRateHistory, Metrics
from kvtier.server.observe.operations import OPERATIONS
from kvtier.server.observe.snapshots import (
    ClientInfo,
    L1Stats,
    L2Summary,
    LookupTotals,
    PrefetchStats,
    ServerStatus,
    SessionCounts,
    TenantUsage,
    Traffic,
)
from kvtier.server.observe.state_metrics import STATE_METRICS
from kvtier.storage.admission import AdmissionStats
from kvtier.storage.loadrate import LoadRate
from kvtier.storage.tiers.base import CodecStats, Latency, TierStats


def tier_stats(name: str, **fields: Any) -> TierStats:
    """A tier's stats with zeros where the test does not care."""
    base: dict[str, Any] = dict(
        name=name, kind=name, url=f"{name}://x", healthy=True, last_error="", objects=0,
        used_bytes=0, capacity_bytes=0, hits=0, misses=0, corrupt=0, errors=0,
        layout_mismatches=0, size_mismatches=0, puts=0, bytes_written=0, bytes_read=0,
        read_latency=Latency(), write_latency=Latency(),
    )  # fmt: skip
    return TierStats(**{**base, **fields})


STATUS = ServerStatus(
    version="0.1.0",
    uptime_s=12.5,
    ready=True,
    health="degraded",
    health_reasons=["L2 tier redis is failing"],
    threads_healthy=True,
    config={"l1_size": 1 << 30},
    l1=L1Stats(
        capacity_bytes=1 << 30,
        used_bytes=3 << 20,
        groups=7,
        ready_groups=6,
        staging_shards=1,
        pinned_groups=2,
        evictions=11,
        evicted_bytes=5 << 20,
    ),
    l2=L2Summary(
        queue_depth=3,
        queue_capacity=1024,
        submitted=40,
        written=30,
        dropped=4,
        tiers=[
            tier_stats(
                "disk",
                used_bytes=9 << 20,
                capacity_bytes=50 << 30,
                objects=9,
                hits=5,
                misses=2,
                extra={"evictions": 6},
            ),
            tier_stats(
                "redis",
                used_bytes=1 << 20,
                objects=1,
                misses=8,
                corrupt=1,
                errors=3,
                healthy=False,
                read_latency=Latency(count=2, total_s=0.003, buckets=(0, 0, 0, 1, 1, *[0] * 8)),
                codec=CodecStats(
                    name="fp8",
                    raw_bytes=8 << 20,
                    stored_bytes=4 << 20,
                    encoded=2,
                    encode_s=0.25,
                    decoded=1,
                    decoded_bytes=4 << 20,
                    decode_s=0.125,
                ),
            ),
        ],
        failing=["redis"],
    ),
    clients=[
        ClientInfo(client_id="a", connected_s=3.0, last_seen_s=0.1, registrations=[]),
        ClientInfo(client_id="b", connected_s=2.0, last_seen_s=0.2, registrations=[]),
    ],
    sessions=SessionCounts(active=4, created=20, expired=3, orphaned=1, tokens=900, shed=2),
    fencing=FencingStats(lapsed=1, fenced_slots=2, fenced_bytes=8192, lease_expired=5),
    lookup=LookupTotals(requested_tokens=1024, hit_tokens=512),
    misses=[],
    load_rates=[
        LoadRate(tier="disk", bytes_per_s=2e9, latency_s=1e-5, reads=3, bytes_read=1 << 20),
    ],
    models=[],
    hit_rate_history=[],
    traffic=Traffic(stored_bytes=0, retrieved_bytes=0),
    latency=[],
    prefetch=PrefetchStats(in_flight=0, started=0, refused=0, loaded_groups=0),
    lock_hold={},
    recent_errors=[],
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(metrics: Metrics) -> Samples:
    """Every sample of a render, parsed back from the text format, keyed by (name, labels)."""
    out: Samples = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_request_instruments_use_user_facing_operations() -> None:
    m = Metrics()
    m.observe_request("Lookup", 80e-6)
    m.observe_request("Lookup", 0.2)
    m.observe_request("Reserve", 7.0)
    m.observe_request("Commit", 0.001)
    m.count_error("Commit", "NO_SPACE")
    m.count_error("Reserve", "NO_SPACE")
    got = samples(m)
    lookup = (("operation", "lookup"), ("step", "lookup"))
    assert got[("kvtier_requests_total", lookup)] == 2
    assert got[("kvtier_requests_total", (("operation", "store"), ("step", "reserve")))] == 1
    assert got[("kvtier_requests_total", (("operation", "store"), ("step", "commit")))] == 1
    assert got[("kvtier_request_duration_seconds_count", lookup)] == 2
    assert got[("kvtier_request_duration_seconds_sum", lookup)] == pytest.approx(0.20008)
    assert got[("kvtier_request_duration_seconds_bucket", (("le", "5e-05"), *lookup))] == 0
    assert got[("kvtier_request_duration_seconds_bucket", (("le", "0.0001"), *lookup))] == 1
    assert got[("kvtier_request_duration_seconds_bucket", (("le", "0.25"), *lookup))] == 2
    errors = (("code", "NO_SPACE"), ("operation", "store"))
    assert got[("kvtier_request_errors_total", errors)] == 2
    assert REQUEST_DURATION_BUCKETS[0] == 50e-6 and REQUEST_DURATION_BUCKETS[-1] == 5.0
    # No wire names in any label value, and no `_created` series.
    text = m.render().decode()
    for wire in ("Reserve", "Commit", "RetrieveDone", "Lookup"):
        assert f'"{wire}"' not in text
    assert "_created" not in text
    assert set(OPERATIONS) >= {"Reserve", "Commit", "Retrieve", "RetrieveDone", "StoreInline"}


def test_every_request_has_its_labels_and_they_never_change() -> None:
    """Dashboards key on these values: the routes declare them, this table pins them."""
    assert OPERATIONS == {
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
        "EndHandoff": ("end_handoff", "end_handoff"),
        "ExistsKeys": ("exists_keys", "exists_keys"),
        "ReserveKeys": ("reserve_keys", "reserve_keys"),
        "StoreKeysInline": ("store_keys_inline", "store_keys_inline"),
        "RetrieveKeys": ("retrieve_keys", "retrieve_keys"),
    }
    m = Metrics()
    m.count_error("unknown", "MALFORMED_FRAME")  # a request that could not be decoded
    errors = (("code", "MALFORMED_FRAME"), ("operation", "unknown"))
    assert samples(m)[("kvtier_request_errors_total", errors)] == 1


def test_latency_summary_per_operation() -> None:
    m = Metrics()
    for _ in range(99):
        m.observe_request("Lookup", 80e-6)
    m.observe_request("Lookup", 0.2)
    m.observe_request("Retrieve", 0.003)
    m.observe_request("RetrieveDone", 0.0004)
    rows = {r.operation: r for r in m.latency()}
    assert rows["lookup"].count == 100 and rows["lookup"].p50_s == 100e-6
    assert rows["lookup"].p99_s == 100e-6 and rows["lookup"].mean_s == pytest.approx(0.0020792)
    assert rows["retrieve"].count == 2 and rows["retrieve"].p99_s == 5e-3


def test_lookup_and_byte_counters_label_models_never_salts() -> None:
    m = Metrics()
    m.observe_lookup("llama", 512, 256)
    m.observe_lookup("llama", 256, 256)
    m.observe_lookup("qwen", 256, 0)
    m.add_stored_bytes(4096)
    m.add_stored_bytes(100)
    m.add_retrieved_bytes(8192)
    got = samples(m)
    llama, qwen = (("model", "llama"),), (("model", "qwen"),)
    assert got[("kvtier_lookup_requested_tokens_total", llama)] == 768
    assert got[("kvtier_lookup_hit_tokens_total", llama)] == 512
    assert got[("kvtier_lookups_total", llama)] == 2
    assert got[("kvtier_lookup_requested_tokens_total", qwen)] == 256
    assert got[("kvtier_lookup_hit_tokens_total", qwen)] == 0
    assert got[("kvtier_stored_bytes_total", ())] == 4196
    assert got[("kvtier_retrieved_bytes_total", ())] == 8192
    assert "cache_salt" not in m.render().decode()
    assert [(r.model, r.requested_tokens, r.hit_tokens, r.lookups) for r in m.models()] == [
        ("llama", 768, 512, 2),
        ("qwen", 256, 0, 1),
    ]
    assert m.traffic() == Traffic(stored_bytes=4196, retrieved_bytes=8192)


def test_model_labels_are_bounded() -> None:
    m = Metrics(max_models=3)
    for i in range(50):
        m.observe_lookup(f"model-{i}", 10, 5)
    models = {r.model: r for r in m.models()}
    assert set(models) == {"model-0", "model-1", "model-2", "other"}
    assert models["other"].lookups == 47 and models["other"].requested_tokens == 470
    text = m.render().decode()
    assert len(set(re.findall(r'model="([^"]+)"', text))) == 4


def test_missed_tokens_by_reason_and_tier() -> None:
    m = Metrics()
    m.observe_misses({("evicted", "l1"): 32, ("partial_chunk", ""): 5})
    m.observe_misses({("evicted", "l1"): 16, ("slower_than_recompute", "redis"): 64})
    got = samples(m)

    def miss(reason: str, tier: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return "kvtier_lookup_miss_tokens_total", (("reason", reason), ("tier", tier))

    assert got[miss("evicted", "l1")] == 48
    assert got[miss("partial_chunk", "")] == 5
    assert got[miss("slower_than_recompute", "redis")] == 64
    assert [(r.reason, r.tier, r.tokens) for r in m.misses()] == [
        ("slower_than_recompute", "redis", 64),
        ("evicted", "l1", 48),
        ("partial_chunk", "", 5),
    ]


def test_lookup_refuses_impossible_counts() -> None:
    m = Metrics()
    with pytest.raises(ValueError, match="hit_tokens=600"):
        m.observe_lookup("llama", 512, 600)
    with pytest.raises(ValueError, match="requested_tokens=-1"):
        m.observe_lookup("llama", -1, 0)


def test_hit_rate_history_sums_per_interval() -> None:
    history = HitRateHistory(interval_s=10.0, max_points=2)
    history.add(100, 50, now=1000.0)
    history.add(100, 100, now=1009.9)
    history.add(10, 0, now=1010.0)
    history.add(10, 10, now=1031.0)
    points = [(p.time, p.requested_tokens, p.hit_tokens) for p in history.points()]
    assert points == [(1010.0, 10, 0), (1030.0, 10, 10)]  # the oldest fell off


def test_build_info_process_and_uptime() -> None:
    m = Metrics()
    m.bind_state(lambda: STATUS)
    got = samples(m)
    build = [k for k in got if k[0] == "kvtier_build_info"]
    assert len(build) == 1 and ("version", __version__) in build[0][1]
    assert got[("kvtier_uptime_seconds", ())] == 12.5
    assert got[("process_resident_memory_bytes", ())] > 0
    assert ("process_cpu_seconds_total", ()) in got


def test_state_collector_exports_status_at_scrape_time() -> None:
    state = {"status": STATUS}
    m = Metrics()
    m.bind_state(lambda: state["status"])
    got = samples(m)
    expected = {
        "kvtier_ready": 1,
        "kvtier_degraded": 1,
        "kvtier_l1_used_bytes": 3 << 20,
        "kvtier_l1_capacity_bytes": 1 << 30,
        "kvtier_evicted_bytes_total": None,
        "kvtier_write_queue_depth": 3,
        "kvtier_write_queue_dropped_total": 4,
        "kvtier_sessions_active": 4,
        "kvtier_sessions_created_total": 20,
        "kvtier_sessions_expired_total": 3,
        "kvtier_sessions_orphaned_total": 1,
        "kvtier_session_tokens": 900,
        "kvtier_sessions_shed_total": 2,
        "kvtier_fenced_slots": 2,
        "kvtier_lease_expired_total": 5,
        "kvtier_clients_connected": 2,
    }
    for name, value in expected.items():
        if value is not None:
            assert got[(name, ())] == value, name

    def tier(name: str) -> tuple[tuple[str, str], ...]:
        return (("tier", name),)

    assert got[("kvtier_evictions_total", tier("l1"))] == 11
    assert got[("kvtier_evictions_total", tier("disk"))] == 6
    assert got[("kvtier_evicted_bytes_total", tier("l1"))] == 5 << 20
    assert got[("kvtier_l2_used_bytes", tier("disk"))] == 9 << 20
    assert got[("kvtier_l2_capacity_bytes", tier("disk"))] == 50 << 30
    assert got[("kvtier_l2_used_bytes", tier("redis"))] == 1 << 20
    assert got[("kvtier_l2_misses_total", tier("redis"))] == 8
    assert got[("kvtier_l2_load_bytes_per_second", tier("disk"))] == 2e9
    assert got[("kvtier_l2_load_latency_seconds", tier("disk"))] == 1e-5
    assert got[("kvtier_l2_errors_total", tier("redis"))] == 3
    assert got[("kvtier_l2_corrupt_total", tier("redis"))] == 1
    assert got[("kvtier_l2_failing", tier("redis"))] == 1
    assert got[("kvtier_l2_failing", tier("disk"))] == 0

    # Read again at the next scrape, not cached at bind time.
    state["status"] = msgspec.structs.replace(
        STATUS,
        l1=msgspec.structs.replace(STATUS.l1, used_bytes=5 << 20),
        sessions=msgspec.structs.replace(STATUS.sessions, active=0),
        clients=STATUS.clients[:1],
    )
    got = samples(m)
    assert got[("kvtier_l1_used_bytes", ())] == 5 << 20
    assert got[("kvtier_sessions_active", ())] == 0
    assert got[("kvtier_clients_connected", ())] == 1


def test_state_metric_names_types_and_labels_never_change() -> None:
    """Dashboards and the README name these: every state metric, its type and its labels."""
    tenants = [TenantUsage(tenant="t", staging_bytes=1, fenced_bytes=2, pinned_bytes=3)]
    admission = AdmissionStats(
        policy="adaptive", admitted=5, declined=7, ghost_names=40, stores_everything=False
    )
    shares = {"auth_tokens_file": "/etc/kvtier/tokens", "tenant_staging_share": 0.25,
              "tenant_quarantine_share": 0.5, "tenant_pinned_share": 0.75}  # fmt: skip
    status = msgspec.structs.replace(
        STATUS,
        l1=msgspec.structs.replace(STATUS.l1, tenants=tenants, admission=admission),
        config={**STATUS.config, **shares},
    )
    m = Metrics()
    m.bind_state(lambda: status)
    names = {metric.name for metric in STATE_METRICS}
    got = {
        family.name: (
            family.type,
            tuple(sorted({k for s in family.samples for k in s.labels} - {"le"})),
        )
        for family in text_string_to_metric_families(m.render().decode())
        if family.name in names
    }
    assert got == {
        "kvtier_admissions": ("counter", ("decision", "tier")),
        "kvtier_declined_evictions": ("counter", ("tier",)),
        "kvtier_cache_policy_stores_everything": ("gauge", ("policy",)),
        "kvtier_ready": ("gauge", ()),
        "kvtier_degraded": ("gauge", ()),
        "kvtier_uptime_seconds": ("gauge", ()),
        "kvtier_l1_used_bytes": ("gauge", ()),
        "kvtier_l1_capacity_bytes": ("gauge", ()),
        "kvtier_l1_groups": ("gauge", ()),
        "kvtier_l1_pinned_groups": ("gauge", ()),
        "kvtier_tenant_l1_bytes": ("gauge", ("kind", "tenant")),
        "kvtier_tenant_l1_share_bytes": ("gauge", ("kind",)),
        "kvtier_evictions": ("counter", ("tier",)),
        "kvtier_evicted_bytes": ("counter", ("tier",)),
        "kvtier_l2_used_bytes": ("gauge", ("tier",)),
        "kvtier_l2_capacity_bytes": ("gauge", ("tier",)),
        "kvtier_l2_objects": ("gauge", ("tier",)),
        "kvtier_l2_hits": ("counter", ("tier",)),
        "kvtier_l2_misses": ("counter", ("tier",)),
        "kvtier_l2_errors": ("counter", ("tier",)),
        "kvtier_l2_corrupt": ("counter", ("tier",)),
        "kvtier_l2_failing": ("gauge", ("tier",)),
        "kvtier_l2_operation_duration_seconds": ("histogram", ("operation", "tier")),
        "kvtier_l2_compression_ratio": ("gauge", ("tier",)),
        "kvtier_l2_codec_seconds": ("counter", ("operation", "tier")),
        "kvtier_l2_codec_bytes": ("counter", ("form", "tier")),
        "kvtier_l2_load_bytes_per_second": ("gauge", ("tier",)),
        "kvtier_l2_load_latency_seconds": ("gauge", ("tier",)),
        "kvtier_write_queue_depth": ("gauge", ()),
        "kvtier_write_queue_capacity": ("gauge", ()),
        "kvtier_write_queue_dropped": ("counter", ()),
        "kvtier_write_queue_written": ("counter", ()),
        "kvtier_l2_write_errors": ("counter", ()),
        "kvtier_sessions_active": ("gauge", ()),
        "kvtier_sessions_created": ("counter", ()),
        "kvtier_sessions_expired": ("counter", ()),
        "kvtier_sessions_orphaned": ("counter", ()),
        "kvtier_session_tokens": ("gauge", ()),
        "kvtier_sessions_shed": ("counter", ()),
        "kvtier_fenced_slots": ("gauge", ()),
        "kvtier_lease_expired": ("counter", ()),
        "kvtier_clients_connected": ("gauge", ()),
    }

    def tenant(kind: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return "kvtier_tenant_l1_bytes", (("kind", kind), ("tenant", "t"))

    got_samples = samples(m)
    assert [got_samples[tenant(k)] for k in ("staging", "quarantined", "pinned")] == [1, 2, 3]
    capacity = status.l1.capacity_bytes
    shares_got = [got_samples[("kvtier_tenant_l1_share_bytes", (("kind", k),))]
                  for k in ("staging", "quarantined", "pinned")]  # fmt: skip
    assert shares_got == [int(capacity * 0.25), int(capacity * 0.5), int(capacity * 0.75)]
    # without a tokens file there are no tenants, so no shares
    m.bind_state(lambda: STATUS)
    assert not [k for k in samples(m) if k[0] == "kvtier_tenant_l1_share_bytes"]


def test_l2_latency_per_tier_from_the_tiers_stats() -> None:
    m = Metrics()
    m.bind_state(lambda: STATUS)
    got = samples(m)
    read = (("operation", "read"), ("tier", "redis"))
    assert got[("kvtier_l2_operation_duration_seconds_count", read)] == 2
    assert got[("kvtier_l2_operation_duration_seconds_sum", read)] == pytest.approx(0.003)
    le_1ms = (("le", "0.001"), ("operation", "read"), ("tier", "redis"))
    assert got[("kvtier_l2_operation_duration_seconds_bucket", le_1ms)] == 1
    le_inf = (("le", "+Inf"), ("operation", "read"), ("tier", "redis"))
    assert got[("kvtier_l2_operation_duration_seconds_bucket", le_inf)] == 2


def test_l2_compression_ratio_and_codec_time_per_tier() -> None:
    m = Metrics()
    m.bind_state(lambda: STATUS)
    got = samples(m)
    assert got[("kvtier_l2_compression_ratio", (("tier", "redis"),))] == 2.0
    assert got[("kvtier_l2_compression_ratio", (("tier", "disk"),))] == 1.0  # codec none
    assert (
        got[("kvtier_l2_codec_seconds_total", (("operation", "encode"), ("tier", "redis")))] == 0.25
    )
    assert (
        got[("kvtier_l2_codec_seconds_total", (("operation", "decode"), ("tier", "redis")))]
        == 0.125
    )
    stored = (("form", "stored"), ("tier", "redis"))
    assert got[("kvtier_l2_codec_bytes_total", stored)] == 4 << 20
    assert got[("kvtier_l2_codec_bytes_total", (("form", "raw"), ("tier", "redis")))] == 8 << 20


def test_rebinding_replaces_the_state_source() -> None:
    second = msgspec.structs.replace(STATUS, l1=msgspec.structs.replace(STATUS.l1, used_bytes=42))
    m = Metrics()
    m.bind_state(lambda: STATUS)
    m.bind_state(lambda: second)
    assert samples(m)[("kvtier_l1_used_bytes", ())] == 42


def test_failing_snapshot_keeps_request_metrics(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> ServerStatus:
        raise RuntimeError("engine lock poisoned")

    m = Metrics()
    m.observe_request("Lookup", 0.001)
    m.bind_state(broken)
    got = samples(m)
    assert got[("kvtier_requests_total", (("operation", "lookup"), ("step", "lookup")))] == 1
    assert ("kvtier_l1_used_bytes", ()) not in got
    assert "engine lock poisoned" in caplog.text


def test_each_instance_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.observe_request("Lookup", 0.001)
    labels = (("operation", "lookup"), ("step", "lookup"))
    assert a.registry is not b.registry and a.registry is not REGISTRY
    assert ("kvtier_requests_total", labels) not in samples(b)
    assert REGISTRY.get_sample_value("kvtier_requests_total", dict(labels)) is None

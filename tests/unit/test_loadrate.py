"""LoadRates (moving per-tier estimates) and paying_prefix (which L2 loads beat recomputing)."""

from __future__ import annotations

import pytest

from kvtier.storage.loadrate import LoadRate, LoadRates, paying_prefix


def rate(bytes_per_s: float, latency_s: float = 0.0) -> LoadRate:
    return LoadRate(tier="t", bytes_per_s=bytes_per_s, latency_s=latency_s, reads=1, bytes_read=1)


def test_estimates_start_at_the_first_sample_and_move_a_fifth_of_the_way() -> None:
    rates = LoadRates(["disk", "redis"])
    assert rates.get("disk").bytes_per_s == 0 and rates.get("disk").seconds(1 << 20) == 0
    rates.observe_probe("redis", 0.001)
    rates.observe_read("redis", 1_000_000, 0.101)  # 0.1 s beyond the round trip
    got = rates.get("redis")
    assert got.latency_s == pytest.approx(0.001) and got.bytes_per_s == pytest.approx(1e7)
    rates.observe_read("redis", 1_000_000, 0.201)  # now 5 MB/s: a fifth of the way there
    assert rates.get("redis").bytes_per_s == pytest.approx(1e7 - 0.2 * 5e6)
    rates.observe_read("redis", 0, 5.0)  # moved nothing: teaches nothing
    assert rates.get("redis").reads == 2 and rates.get("redis").bytes_read == 2_000_000
    assert [r.tier for r in rates.snapshot()] == ["disk", "redis"]


def test_a_read_faster_than_the_round_trip_still_counts_part_of_its_time() -> None:
    rates = LoadRates(["t"])
    rates.observe_probe("t", 0.01)
    rates.observe_read("t", 1000, 0.004)
    assert rates.get("t").bytes_per_s == pytest.approx(1000 / 0.001)  # a quarter of 4 ms


def test_unknown_prefill_speed_loads_everything() -> None:
    assert paying_prefix([[0]] * 5, [rate(1.0)], shard_bytes=1 << 20, chunk_tokens=16,
                         prefill_tokens_per_s=0) == 5  # fmt: skip


def test_a_tier_is_used_only_where_it_beats_recomputing() -> None:
    # 1 MiB per chunk at 1 GiB/s: ~1 ms a chunk; 256 tokens recompute in 1 ms at 256k tok/s
    fast, slow = rate(float(1 << 30)), rate(float(1 << 20))
    kw = dict(shard_bytes=1 << 20, chunk_tokens=256)
    assert paying_prefix([[0]] * 4, [fast], prefill_tokens_per_s=25_600, **kw) == 4
    assert paying_prefix([[0]] * 4, [slow], prefill_tokens_per_s=25_600, **kw) == 0
    # fast for two chunks, then a slow tier: the prefix that saves most stops before it
    tiers = [[0], [0], [1], [1]]
    assert paying_prefix(tiers, [fast, slow], prefill_tokens_per_s=25_600, **kw) == 2
    # an unmeasured tier is trusted
    assert paying_prefix([[0]] * 3, [rate(0.0)], prefill_tokens_per_s=1e9, **kw) == 3


def test_a_round_trip_is_paid_once_per_tier_so_longer_loads_can_pay() -> None:
    # 10 ms round trip, transfer 1 ms a chunk, recompute 4 ms a chunk: one chunk loses
    # (11 > 4), four win (14 < 16)
    tier = rate(float(1 << 20) / 0.001, latency_s=0.010)
    kw = dict(shard_bytes=1 << 20, chunk_tokens=4, prefill_tokens_per_s=1000)
    assert paying_prefix([[0]], [tier], **kw) == 0
    assert paying_prefix([[0]] * 4, [tier], **kw) == 4
    # each chunk's shards (two ranks) all count
    assert paying_prefix([[0, 0]] * 4, [tier], **kw) == 0  # 18 ms > 16 ms


def test_one_tenant_cannot_drag_another_tenants_estimate() -> None:
    """One tenant's tiny-chunk loads dragged the shared disk-speed estimate from 1,258 to
    22.7 MiB/s, after which another tenant's disk hits were gated to 0."""
    rates = LoadRates(["disk"])
    rates.observe_read("disk", 64 << 20, 0.05, "alice")  # 1280 MiB/s
    for _ in range(200):
        rates.observe_read("disk", 4096, 0.0002, "mallory")  # tiny reads: 20 MiB/s
    assert rates.get("disk", "alice").bytes_per_s == (64 << 20) / 0.05
    assert rates.get("disk", "mallory").bytes_per_s < 30 << 20
    assert rates.get("disk", "bob").reads == 0  # unmeasured: trusted until it loads

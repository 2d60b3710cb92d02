"""What every tier shares: URL option parsing, URL redaction, counters, latency histograms."""

from __future__ import annotations

import bisect
import logging

import pytest

from kvtier.keys import ObjectKey
from kvtier.redaction import redact
from kvtier.storage.tiers import accounting, open_tier
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.accounting import TierCounters
from kvtier.storage.tiers.base import LATENCY_BOUNDS_S, Latency
from kvtier.storage.tiers.options import PARSERS, as_bool, parse_url
from kvtier.storage.tiers.redis import RedisTier


def test_redact_url_hides_only_the_password() -> None:
    assert redact("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("redis://u:hunter2@h:1/0?prefix=x") == "redis://u:***@h:1/0?prefix=x"
    assert (
        redact("redis+cluster://u:pw@h1:7000,h2:7000/") == "redis+cluster://u:***@h1:7000,h2:7000/"
    )
    assert redact("disk:///var/lib/kvtier?size=1GiB") == "disk:///var/lib/kvtier?size=1GiB"


def test_errors_and_stats_never_show_the_password() -> None:
    with pytest.raises(ValueError) as info:
        open_tier("nope://:hunter2@h/")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ValueError) as info:
        open_tier("redis://:hunter2@h:1/0?bogus=1")
    assert "hunter2" not in str(info.value) and "bogus" in str(info.value)
    tier = RedisTier("redis://:hunter2@127.0.0.1:1/0", connect_timeout=0.1)
    try:
        tier.put(fmt_key(), b"x", "L")
        s = tier.stats()
        assert s.errors >= 1 and not s.healthy and s.last_error
        assert "hunter2" not in s.url and "hunter2" not in s.last_error and "***" in s.url
    finally:
        tier.close()


def fmt_key() -> ObjectKey:
    return ObjectKey("m", "", 1, 0, bytes(32))


def test_parse_url_names_the_option_the_value_and_the_known_ones() -> None:
    options = {"size": PARSERS["size"], "fsync": PARSERS["bool"], "ttl": PARSERS["optional_int"]}
    parts, got = parse_url("disk:///x?size=2GiB&fsync=yes&ttl=", options, tier="disk")
    assert parts.path == "/x" and got == {"size": 2 << 30, "fsync": True, "ttl": None}
    with pytest.raises(ValueError, match=r"unknown disk tier URL options \['sise'\].*known: fsync"):
        parse_url("disk:///x?sise=1", options, tier="disk")
    with pytest.raises(ValueError, match=r"bad disk tier URL option fsync='maybe'"):
        parse_url("disk:///x?fsync=maybe", options, tier="disk")
    assert as_bool("ON") and not as_bool("0")


def test_a_raw_hash_sign_in_a_tier_url_is_refused_without_showing_the_password() -> None:
    # unencoded, "#" would end the URL inside the password and make its rest the "host"
    with pytest.raises(ValueError, match="%23") as info:
        RedisTier.from_url("redis://:zq:Xq7v@9Zkw#Jw@127.0.0.1:6379/0")
    assert "Xq7v" not in str(info.value) and "9Zkw" not in str(info.value)
    assert "Jw" not in str(info.value)


def test_counters_rate_limit_warnings_and_report_health(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = logging.getLogger("kvtier.test.counters")
    counters = TierCounters(log, ("evictions",))
    caplog.set_level("WARNING", logger=log.name)
    for i in range(1000):
        counters.failed("write", f"disk full #{i}")
    assert len(caplog.records) == 1
    s = counters.snapshot(name="t", kind="disk", url="disk:///x", objects=0, used_bytes=0,
                          capacity_bytes=0)  # fmt: skip
    assert s.errors == 1000 and s.last_error == "write: disk full #999" and not s.healthy
    # once the interval has passed, the next warning says how many were held back
    monkeypatch.setattr(accounting, "WARN_EVERY_S", 0.0)
    counters.failed("write", "disk full again")
    assert caplog.records[-1].getMessage() == (
        "write: disk full again (999 similar warnings suppressed)"
    )
    monkeypatch.setattr(accounting, "UNHEALTHY_FOR_S", 0.0)
    s = counters.snapshot(name="t", kind="disk", url="", objects=0, used_bytes=0, capacity_bytes=0)
    assert s.healthy and s.errors == 1001 and s.extra == {"evictions": 0}


def test_settle_counts_each_verdict() -> None:
    counters = TierCounters(logging.getLogger("kvtier.test.settle"))
    outcomes = [fmt.Verdict.OK, None, fmt.Verdict.CORRUPT, fmt.Verdict.LAYOUT_MISMATCH,
                fmt.Verdict.SIZE_MISMATCH]  # fmt: skip
    assert [counters.settle(v, 10) for v in outcomes] == [True, False, False, False, False]
    s = counters.snapshot(name="t", kind="x", url="", objects=0, used_bytes=0, capacity_bytes=0)
    assert (s.hits, s.misses, s.corrupt, s.layout_mismatches, s.size_mismatches) == (1, 4, 1, 1, 1)
    assert s.bytes_read == 10


def test_latency_histogram_buckets_and_merge() -> None:
    counters = TierCounters(logging.getLogger("kvtier.test.latency"))
    with counters.timed("read", 4):
        pass
    s = counters.snapshot(name="t", kind="x", url="", objects=0, used_bytes=0, capacity_bytes=0)
    per_call = s.read_latency.max_s  # the block's time split over its 4 reads
    assert s.read_latency.count == 4 and s.read_latency.total_s == pytest.approx(4 * per_call)
    assert s.read_latency.buckets[bisect.bisect_left(LATENCY_BOUNDS_S, per_call)] == 4
    assert s.write_latency == Latency()
    recorder = accounting._LatencyRecorder()
    recorder.add(0.0004, 2)  # 0.2 ms per call: the (0.1 ms, 0.25 ms] bucket
    recorder.add(2.0, 1)  # above the largest bound: the last bucket
    both = recorder.frozen().merged(recorder.frozen())
    assert both.count == 6 and both.max_s == 2.0 and both.total_s == pytest.approx(4.0008)
    assert both.buckets[1] == 4 and both.buckets[-1] == 2 and sum(both.buckets) == 6


def test_read_hashed_equals_one_shot_digest() -> None:
    data = bytes(range(256)) * (3 * fmt.BLOCK // 256 + 7)
    out = memoryview(bytearray(len(data)))

    def fill(block: memoryview, offset: int) -> None:
        block[:] = data[offset : offset + len(block)]

    assert fmt.read_hashed(out, fill) == fmt.digest(data) and out.tobytes() == data


def test_aligned_header_pads_to_the_page_and_decodes_to_its_padded_size() -> None:
    payload = bytes(range(256)) * 16
    for text in ("k", "x" * 5000):  # a header of one page, and one past a page
        header = fmt.encode_header(text, "uint8[4096]", payload, aligned=True)
        assert len(header) % fmt.ALIGN == 0
        assert len(header) == fmt.header_size(text, "uint8[4096]", aligned=True)
        decoded = fmt.decode_header(header)
        assert decoded is not None and decoded.size == len(header)
        assert fmt.verify(decoded, text, "uint8[4096]", payload, len(header) + len(payload)) is (
            fmt.Verdict.OK
        )
    plain = fmt.encode_header("k", "uint8[4096]", payload)
    assert len(plain) == fmt.header_size("k", "uint8[4096]") < fmt.ALIGN
    decoded = fmt.decode_header(plain)
    assert decoded is not None and decoded.size == len(plain)


def test_a_header_with_an_unknown_flag_does_not_decode() -> None:
    header = bytearray(fmt.encode_header("k", "uint8[4]", b"abcd"))
    header[10:12] = (4).to_bytes(2, "little")  # the flags field
    assert fmt.decode_header(header) is None


def test_the_resume_point_mark_round_trips_and_old_headers_read_as_resume_points() -> None:
    marked = fmt.decode_header(fmt.encode_header("k", "uint8[4]", b"abcd", resumable=False))
    assert marked is not None and not marked.resumable
    old = fmt.decode_header(fmt.encode_header("k", "uint8[4]", b"abcd"))  # flags 0
    assert old is not None and old.resumable
    assert fmt.verify(marked, "k", "uint8[4]", b"abcd", marked.size + 4) is fmt.Verdict.UNRESUMABLE
    assert fmt.verify(old, "k", "uint8[4]", b"abcd", old.size + 4) is fmt.Verdict.OK

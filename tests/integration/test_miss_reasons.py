"""Why lookups missed, against real servers: each reason produced on purpose and counted in
/metrics (kvtier_lookup_miss_tokens_total{reason, tier}), and a tier made slow on purpose (the
real Redis behind a throttling proxy) whose chunks are not reported to an engine that states a
faster prefill, and are to one that states a slower one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from testkit.admin import changes, status, written
from testkit.kv import CS, prompt
from testkit.servers import ServerProcess
from testkit.trust import SHAPE, kv_for, reserve
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.hashing import TokenHasher
from kvtier.keys import ObjectKey, compose

from .throttle_proxy import throttled

CHUNK_BYTES = 16 << 10  # SHAPE in float16
Tally = dict[tuple[str, str], float]


def miss_tokens(server: ServerProcess) -> Tally:
    """kvtier_lookup_miss_tokens_total by (reason, tier), read from /metrics."""
    assert server.admin_url is not None
    text = httpx.get(server.admin_url + "/metrics", timeout=5).text
    return {
        (s.labels["reason"], s.labels["tier"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvtier_lookup_miss_tokens_total"
    }


class Counted:
    """The change in the miss counters since the last call."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.seen = miss_tokens(server)

    def __call__(self) -> Tally:
        now = miss_tokens(self.server)
        delta = {k: v - self.seen.get(k, 0) for k, v in now.items() if v != self.seen.get(k, 0)}
        self.seen = now
        return delta


def test_each_reason_of_a_miss_in_l1(server_factory: Callable[..., ServerProcess]) -> None:
    srv = server_factory(
        "--l1-size", "64KiB", "--chunk-size", str(CS), "--staging-lease", "1",
        "--reap-interval", "0.2",
    )  # fmt: skip
    counted = Counted(srv)
    with Client(srv.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.lookup("never", prompt(1, 3), model="m") == 0
        assert counted() == {("never_stored", ""): 3 * CS}
        assert c.exists_keys(["page-a", "page-b"], model="m") == 0  # named chunks count too
        assert counted() == {("never_stored", ""): 2 * CS}

        assert c.store("w2", prompt(2, 2), kv_for(2, 2), model="m") == 2 * CS
        assert c.lookup("tail", [*prompt(2, 2), 1, 2, 3, 4, 5], model="m") == 2 * CS
        assert counted() == {("partial_chunk", ""): 5}
        c.end_session("tail")

        # Another model of the same salt is named; another salt's chunks are never told of
        # (a salt keeps its prompts apart: see test_a_lookup_learns_nothing_of_...).
        assert c.lookup("salt", prompt(2, 2), model="m", cache_salt="other") == 0
        assert counted() == {("never_stored", ""): 2 * CS}
        assert c.lookup("model", prompt(2, 2), model="m2") == 0
        assert counted() == {("other_salt_or_model", ""): 2 * CS}

        with Client(srv.address) as rank0:  # rank 0 of two stores, rank 1 never does
            rank0.register(model="m", world_size=2, worker_id=0, chunk_shape=SHAPE, dtype="float16")
            rank0.store("w4", prompt(3, 1), kv_for(3, 1), model="m", world_size=2)
        assert c.lookup("half", prompt(3, 1), model="m", world_size=2) == 0
        assert counted() == {("incomplete", "l1"): CS}

        # The L1 holds four chunks: four more take the place of everything above.
        assert c.store("w5", prompt(4, 4), kv_for(4, 4), model="m") == 4 * CS
        assert c.lookup("gone", prompt(2, 2), model="m") == 0
        assert counted() == {("evicted", "l1"): 2 * CS}

        assert srv.admin_url is not None
        cleared = httpx.post(srv.admin_url + "/clear", json={}, headers=changes(srv), timeout=5)
        assert cleared.json() == {"cleared": 4}
        assert c.lookup("cleared", prompt(4, 4), model="m") == 0
        assert counted() == {("cleared", "l1"): 4 * CS}

        reserve(c, "w7", prompt(5, 1))  # never committed: its staging lease lapses
        assert wait_for(lambda: status(srv)["fencing"]["lapsed"] == 1)
        assert c.lookup("lapsed", prompt(5, 1), model="m") == 0
        assert counted() == {("lease_lapsed", "l1"): CS}

    st = status(srv)
    got = {(m["reason"], m["tier"]): m["tokens"] for m in st["misses"]}
    assert got == miss_tokens(srv)  # /status and /metrics tell the same
    shown = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "status", "--admin", srv.admin_url],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert shown.returncode == 0, shown.stderr
    assert "lease_lapsed" in shown.stdout and "evicted (l1)" in shown.stdout


def test_misses_of_a_disk_tier_evicted_corrupt_and_not_loaded(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    disk = f"disk://{tmp_path}/l2?size=160KiB"  # about nine 16 KiB chunks
    args = ("--l1-size", "64KiB", "--chunk-size", str(CS), "--l2", disk)
    first = server_factory(*args)
    with Client(first.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        stored = 0
        for n, chunks in ((1, 2), (2, 4), (3, 4), (4, 4)):
            assert c.store(f"w{n}", prompt(n, chunks), kv_for(n, chunks), model="m")
            stored += chunks
            assert wait_for(lambda stored=stored: written(first, stored))  # type: ignore[misc]
        counted = Counted(first)
        # prompt 1 left the L1 first (the disk still had it), then the disk
        assert c.lookup("gone", prompt(1, 2), model="m") == 0
        assert counted() == {("evicted", "disk"): 2 * CS}
    assert first.stop() == 0

    tokens = prompt(4, 4)
    h1 = TokenHasher(CS).compute_chunk_hashes(tokens)[1]
    name = ObjectKey(compose("", "m"), compose("", ""), 1, 0, h1).to_str()
    path = next(p for p in (tmp_path / "l2").rglob("*") if p.name == name)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))

    second = server_factory(*args)
    counted = Counted(second)
    with Client(second.address) as c:
        # no worker registered a layout yet: nothing can be loaded, the disk holds it
        assert c.lookup("layout", prompt(3, 4), model="m") == 0
        assert counted() == {("not_loaded", "disk"): 4 * CS}
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.lookup("corrupt", tokens, model="m") == CS
        # chunk 1 failed its digest; 2 and 3 come after it, so they miss for that reason too
        assert counted() == {("load_failed", "disk"): 3 * CS}


THROTTLE = 512 << 10  # bytes per second the proxy lets through from Redis


def test_a_slow_tier_is_not_reported_to_a_faster_prefill(
    server_factory: Callable[..., ServerProcess], redis_url: str, redis_prefix: str
) -> None:
    host_port = redis_url.split("//")[1].split("/")[0]
    host, port = host_port.split(":")
    args = ("--l1-size", "1MiB", "--chunk-size", str(CS))
    writer = server_factory(*args, "--l2", f"{redis_url}?prefix={redis_prefix}")
    with Client(writer.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        for n in (1, 2):
            assert c.store(f"w{n}", prompt(n, 4), kv_for(n, 4), model="m") == 4 * CS
        assert wait_for(lambda: written(writer, 8))
    with throttled((host, int(port)), THROTTLE) as proxy:
        slow_url = f"redis://127.0.0.1:{proxy.port}/0?prefix={redis_prefix}"
        reader = server_factory(*args, "--l2", slow_url)
        counted = Counted(reader)
        with Client(reader.address) as c:
            c.register(model="m", chunk_shape=SHAPE, dtype="float16")
            # the first load measures the tier (a tier never measured is trusted)
            assert c.lookup("measure", prompt(1, 4), model="m", prefill_tokens_per_s=1e9) == 4 * CS
            assert proxy.bytes_sent >= 4 * CHUNK_BYTES
            (rate,) = status(reader)["load_rates"]
            assert rate["tier"] == "redis" and rate["reads"] == 1
            assert 0 < rate["bytes_per_s"] <= 1.5 * THROTTLE  # it sees the throttle
            assert reader.admin_url is not None
            metrics = httpx.get(reader.admin_url + "/metrics", timeout=5).text
            (gauge,) = [
                s.value
                for family in text_string_to_metric_families(metrics)
                for s in family.samples
                if s.name == "kvtier_l2_load_bytes_per_second" and s.labels == {"tier": "redis"}
            ]
            assert gauge == pytest.approx(rate["bytes_per_s"])
            load_s = rate["latency_s"] + CHUNK_BYTES / rate["bytes_per_s"]  # one chunk
            even = CS / load_s  # the prefill speed at which loading and recomputing tie
            counted()

            assert c.lookup("fast", prompt(2, 4), model="m", prefill_tokens_per_s=10 * even) == 0
            assert counted() == {("slower_than_recompute", "redis"): 4 * CS}
            hit = c.lookup("slow", prompt(2, 4), model="m", prefill_tokens_per_s=even / 10)
            assert hit == 4 * CS
            assert counted() == {}


def test_chunks_past_a_tenants_pinned_share_or_a_resume_point_miss_for_that_reason(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    token = "miss-test-token-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{token} tenant-a\n")
    srv = server_factory(
        "--l1-size", "64KiB", "--chunk-size", str(CS), "--auth-tokens-file", str(tokens),
        "--tenant-pinned-share", "0.25", "--tenant-staging-share", "1",
        "--tenant-quarantine-share", "1",
    )  # fmt: skip
    with Client(srv.address, token=token) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.store("w", prompt(1, 3), kv_for(1, 3), model="m") == 3 * CS
        counted = Counted(srv)
        # a quarter of the L1 pins one 16 KiB chunk; the other two are in L1 all the same
        assert c.lookup("r", prompt(1, 3), model="m") == CS
        assert counted() == {("tenant_share", "l1"): 2 * CS}
        c.end_session("r")

        # three chunks stored, the engine can resume after the first only
        flags = [True, False, False]
        assert c.store("w2", prompt(2, 3), kv_for(2, 3), model="m", resumable=flags) == 3 * CS
        assert c.lookup("resume", prompt(2, 3), model="m") == CS
        assert counted() == {("not_resumable", "l1"): 2 * CS}


def test_a_lookup_learns_nothing_of_another_tenants_or_salts_chunks(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """The attack: tenant B looks up a prompt it guesses and reads the miss reasons in /status
    and /metrics, to learn whether tenant A (or another salt of its own) cached it. Each of
    those misses counts as never stored; only another model of B's own salt is named."""
    victim, spy = "victim-tenant-token-0123456789", "spying-tenant-token-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{victim} victim\n{spy} spy\n")
    srv = server_factory(
        "--l1-size", "1MiB", "--chunk-size", str(CS), "--auth-tokens-file", str(tokens)
    )
    with Client(srv.address, token=victim) as a, Client(srv.address, token=spy) as b:
        for c in (a, b):
            c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert a.store("secret", prompt(1, 3), kv_for(1, 3), model="m") == 3 * CS
        assert a.store("salted", prompt(2, 2), kv_for(2, 2), model="m", cache_salt="s") == 2 * CS
        assert b.store("mine", prompt(3, 2), kv_for(3, 2), model="m", cache_salt="x") == 2 * CS
        counted = Counted(srv)
        before = {(m["reason"], m["tier"]): m["tokens"] for m in status(srv)["misses"]}

        assert b.lookup("guess", prompt(1, 3), model="m") == 0  # the victim's, same model
        assert b.lookup("guess-salt", prompt(2, 2), model="m", cache_salt="s") == 0
        assert b.lookup("own-salt", prompt(3, 2), model="m", cache_salt="y") == 0
        assert counted() == {("never_stored", ""): 7 * CS}
        after = {(m["reason"], m["tier"]): m["tokens"] for m in status(srv)["misses"]}
        assert after.get(("other_salt_or_model", ""), 0) == before.get(
            ("other_salt_or_model", ""), 0
        )

        # The reason still serves a tenant's own names: its other model, same salt.
        assert b.lookup("own-model", prompt(3, 2), model="m2", cache_salt="x") == 0
        assert counted() == {("other_salt_or_model", ""): 2 * CS}

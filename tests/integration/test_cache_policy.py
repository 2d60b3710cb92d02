"""The cache policy against real servers: what the doorkeeper declines is still read by the
request that stored it, never reaches the disk tier, is evicted first once that request ends and
then misses as `not_admitted`; what a second request asks for is kept and written on; the hit
funnel and the admission counts are in /metrics and /status."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
from testkit.admin import metric_samples, status, written
from testkit.kv import CS, prompt
from testkit.servers import ServerProcess
from testkit.trust import SHAPE, kv_for
from testkit.waiting import wait_for

from kvtier.client import Client


def metrics(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    assert server.admin_url is not None
    return metric_samples(httpx.get(server.admin_url + "/metrics", timeout=5).text)


def admissions(server: ServerProcess) -> tuple[float, float]:
    got = metrics(server)

    def count(decision: str) -> float:
        return got.get(("kvtier_admissions_total", (("decision", decision), ("tier", "l1"))), 0.0)

    return count("admitted"), count("declined")


def test_doorkeeper_declines_first_sightings_but_serves_their_request(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    srv = server_factory(
        "--l1-size", "64KiB", "--chunk-size", str(CS), "--policy", "doorkeeper",
        "--l2", f"disk://{tmp_path}/l2?size=1MiB",
    )  # fmt: skip
    with Client(srv.address) as c, Client(srv.address) as other:
        for client in (c, other):
            client.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.lookup("a", prompt(1, 2), model="m") == 0
        assert c.store("a", prompt(1, 2), kv_for(1, 2), model="m") == 2 * CS
        assert admissions(srv) == (0, 2)  # seen by one request only: declined

        # Another request fills the rest of L1; the declined chunks stay for "a".
        assert other.lookup("b", prompt(2, 2), model="m") == 0
        assert other.store("b", prompt(2, 2), kv_for(2, 2), model="m") == 2 * CS
        other.end_session("b")
        assert c.lookup("a", prompt(1, 2), model="m") == 2 * CS
        out = kv_for(0, 2)
        c.retrieve("a", prompt(1, 2), out, model="m", end=2 * CS)
        assert (out == kv_for(1, 2)).all()
        time.sleep(0.3)  # give the writer time: nothing declined may reach the disk tier
        st = status(srv)
        assert st["l2"]["written"] == 0 and st["l2"]["tiers"][0]["objects"] == 0
        c.end_session("a")

        # Ended: "a"'s chunks are the coldest; four new chunks take every place in L1.
        assert other.lookup("c", prompt(3, 4), model="m") == 0
        assert other.store("c", prompt(3, 4), kv_for(3, 4), model="m") == 4 * CS
        other.end_session("c")
        assert c.lookup("d", prompt(1, 2), model="m") == 0
        reasons = {(m["reason"], m["tier"]): m["tokens"] for m in status(srv)["misses"]}
        assert reasons.get(("not_admitted", "l1")) == 2 * CS

        # "d" is the second request to ask for prompt 1: now its chunks are kept and written.
        assert c.store("d", prompt(1, 2), kv_for(1, 2), model="m") == 2 * CS
        assert admissions(srv)[0] == 2
        assert wait_for(lambda: written(srv, 2))
        c.end_session("d")
        assert c.lookup("e", prompt(1, 2), model="m") == 2 * CS

    got = metrics(srv)
    funnel = {
        dict(labels)["stage"]: value
        for (name, labels), value in got.items()
        if name == "kvtier_hit_funnel_tokens_total" and dict(labels)["tier"] == "l1"
    }
    assert funnel["present"] >= funnel["worth_loading"] >= funnel["loaded"] == 4 * CS
    assert got[("kvtier_cache_policy_stores_everything", (("policy", "doorkeeper"),))] == 0
    st = status(srv)
    assert st["l1"]["admission"]["policy"] == "doorkeeper"
    assert {(f["tier"], f["stage"]) for f in st["funnel"]} >= {("l1", "present"), ("l1", "loaded")}


def test_lru_keeps_everything(server_factory: Callable[..., ServerProcess]) -> None:
    srv = server_factory("--l1-size", "64KiB", "--chunk-size", str(CS), "--policy", "lru")
    with Client(srv.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.store("a", prompt(1, 2), kv_for(1, 2), model="m") == 2 * CS
        assert admissions(srv) == (2, 0)
        got = metrics(srv)
        assert got[("kvtier_cache_policy_stores_everything", (("policy", "lru"),))] == 1


def test_an_unknown_policy_is_refused_at_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "serve", "--policy", "fifo",
         "--address", f"ipc://{tmp_path}/s.sock"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode != 0
    assert "--policy" in run.stderr and "adaptive" in run.stderr and "fifo" in run.stderr

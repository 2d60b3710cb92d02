"""The admin HTTP API and `kvtier status` / `clear`, against a real `kvtier serve` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from testkit.admin import admin_url, auth, changes, metric_samples, token_file
from testkit.clock import FakeClock
from testkit.servers import ServerProcess, free_port, start_server
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.config import ServerConfig
from kvtier.periodic import PeriodicThreadRegistry, ThreadLevel, create_periodic_thread
from kvtier.server.app import build_engine
from kvtier.server.observe.admin import start_admin_server
from kvtier.server.views import AdminViews

REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-token-Zx9-0123"  # >= 16 characters: it also guards a 0.0.0.0 admin address
SERVER_ARGS = ("--l1-size", "64MiB")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One server for the module (its tests use disjoint models and request ids)."""
    srv = start_server(*SERVER_ARGS)
    try:
        yield srv
    finally:
        srv.stop()


def get(srv: ServerProcess, path: str, **kw: Any) -> httpx.Response:
    return httpx.get(admin_url(srv) + path, timeout=10, **kw)


def tier_watch_runs(srv: ServerProcess) -> int:
    """How many times the server's tier watch (the periodic check of its L2 tiers) has run."""
    threads = get(srv, "/threads").json()["threads"]
    return next(int(t["run_count"]) for t in threads if t["name"].startswith("tier-watch-"))


# -- endpoints -----------------------------------------------------------------------------------


def test_admin_url_is_loopback(server: ServerProcess) -> None:
    assert admin_url(server).startswith("http://127.0.0.1:")


def test_health_ok(server: ServerProcess) -> None:
    response = get(server, "/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_status_shape(server: ServerProcess) -> None:
    status = get(server, "/status").json()
    assert status["ready"] is True and status["threads_healthy"] is True
    assert status["health"] == "ok" and status["health_reasons"] == []
    assert set(status) >= {"models", "hit_rate_history", "traffic", "latency", "clients"}
    assert status["config"]["l1_size"] == 64 << 20
    assert status["config"]["address"] == [server.address]
    assert status["l1"]["capacity_bytes"] == 64 << 20
    assert set(status["l1"]) >= {
        "capacity_bytes",
        "used_bytes",
        "groups",
        "ready_groups",
        "pinned_groups",
        "staging_shards",
        "evictions",
        "evicted_bytes",
    }
    assert set(status["l2"]) >= {"queue_depth", "queue_capacity", "policy", "tiers"}
    assert set(status["sessions"]) == {"active", "created", "expired", "orphaned", "tokens", "shed"}
    assert set(status["lookup"]) == {"requested_tokens", "hit_tokens"}
    assert isinstance(status["clients"], list) and isinstance(status["recent_errors"], list)


def test_threads_lists_the_servers_periodic_threads(server: ServerProcess) -> None:
    body = get(server, "/threads").json()
    assert body["health"] == {"healthy": True, "unhealthy": []}
    assert body["threads"], "the server runs periodic threads (session cleanup, reaping...)"
    for thread in body["threads"]:
        assert {"name", "level", "interval", "running", "run_count"} <= set(thread)
        assert thread["running"] is True


def test_metrics_endpoint(server: ServerProcess) -> None:
    response = get(server, "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    got = metric_samples(response.text)
    assert got[("kvtier_l1_capacity_bytes", ())] == 64 << 20
    assert got[("kvtier_ready", ())] == 1
    assert ("kvtier_sessions_active", ()) in got


def test_sessions_paging_and_bad_input(server: ServerProcess) -> None:
    body = get(server, "/sessions", params={"offset": 0, "limit": 5}).json()
    assert set(body) == {"total", "offset", "limit", "sessions"}
    assert (body["offset"], body["limit"]) == (0, 5)
    for params in ({"limit": "x"}, {"limit": 0}, {"offset": -1}, {"limit": 100000}):
        response = get(server, "/sessions", params=params)
        assert response.status_code == 400, params
        assert "error" in response.json()


def test_unknown_session_is_404(server: ServerProcess) -> None:
    assert get(server, "/sessions/no-such-request").status_code == 404
    response = httpx.delete(
        admin_url(server) + "/sessions/no-such-request", headers=changes(server)
    )
    assert response.status_code == 404
    assert "no-such-request" in response.json()["error"]


def test_clear_validates_its_body(server: ServerProcess) -> None:
    url = admin_url(server) + "/clear"
    bad = [b"{not json", b"[1, 2]", b'{"model": 3}', b'{"modle": "x"}']
    headers = {"Content-Type": "application/json", **changes(server)}
    for body in bad:
        response = httpx.post(url, content=body, headers=headers)
        assert response.status_code == 400, body
        assert "error" in response.json()
    response = httpx.post(url, json={"model": "never-stored", "cache_salt": None}, headers=headers)
    assert response.status_code == 200 and response.json() == {"cleared": 0}


def test_openapi_describes_every_route(server: ServerProcess) -> None:
    schema = get(server, "/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    paths = schema["paths"]
    assert set(paths) >= {
        "/health",
        "/status",
        "/sessions",
        "/sessions/{request_id}",
        "/threads",
        "/metrics",
        "/clear",
        "/chunks",
        "/",
        "/login",
    }
    assert set(paths["/sessions/{request_id}"]) == {"get", "delete"}
    assert set(paths["/clear"]) == {"post"}


def test_chunks_lists_a_tier_and_names_what_it_cannot_list(server: ServerProcess) -> None:
    reply = get(server, "/chunks")
    assert reply.status_code == 200
    assert reply.json()["tier"] == "l1" and reply.json()["total"] >= 0
    missing = get(server, "/chunks?tier=redis")
    assert missing.status_code == 404 and "cannot list" in missing.json()["error"]
    assert get(server, "/chunks?limit=-1").status_code == 400


def test_chunks_never_holds_the_engine_lock_for_a_scan_of_the_l1(tmp_path: Path) -> None:
    """The attack: poll /chunks on a large L1 while engines look up. Each call holds the engine
    lock one slice of the L1 at a time (the server's own count of its holds says how many), and
    still lists every complete group once, with the exact total."""
    from kvtier.server.observe.chunk_listing import SLICE

    groups = 3 * SLICE + 100
    srv = start_server("--l1-size", "64MiB", "--chunk-size", "16", "--l2", "none")
    try:
        with Client(srv.address) as c:
            c.register(model="m", chunk_shape=[2, 4], dtype="float16")
            tokens = list(range(groups * 16))
            kv = np.arange(groups * 8, dtype=np.float16).reshape(groups, 2, 4)
            assert c.store("fill", tokens, kv, model="m") == groups * 16

            def holds() -> int:
                hold = get(srv, "/status").json()["lock_hold"].get("chunks", {})
                return int(hold.get("count", 0))

            before = holds()
            reply = get(srv, f"/chunks?limit={groups + 10}").json()
            assert reply["total"] == groups and len(reply["chunks"]) == groups
            assert len({row["chunk_hash"] for row in reply["chunks"]}) == groups
            assert holds() - before >= groups // SLICE + 1  # one short hold per slice
            assert len(get(srv, "/chunks?limit=5").json()["chunks"]) == 5
    finally:
        srv.close()


def test_a_prompt_a_live_client_pinned_can_be_stored_again_after_a_clear() -> None:
    """The attack: a client looks up a prompt and keeps its session (and pins) alive; after
    an operator's clear, nobody could store that prompt again until the session ended. Now the
    new store succeeds into fresh slots, is found and read back byte for byte, while the
    pinned, cleared copy keeps its slots until its session ends."""
    from testkit.kv import prompt
    from testkit.trust import SHAPE, kv_for

    srv = start_server("--l1-size", "1MiB", "--chunk-size", "16", "--l2", "none")
    try:
        with Client(srv.address) as holder, Client(srv.address) as writer:
            for c in (holder, writer):
                c.register(model="m", chunk_shape=list(SHAPE), dtype="float16")
            tokens, kv = prompt(1, 2), kv_for(1, 2)
            assert writer.store("first", tokens, kv, model="m") == 32
            assert holder.lookup("pinning", tokens, model="m") == 32  # pinned, never released
            used = get(srv, "/status").json()["l1"]["used_bytes"]
            cleared = httpx.post(admin_url(srv) + "/clear", json={}, headers=changes(srv))
            assert cleared.json() == {"cleared": 2}
            assert writer.lookup("after-clear", tokens, model="m") == 0
            writer.end_session("after-clear")

            assert writer.store("again", tokens, kv, model="m") == 32
            assert writer.lookup("found", tokens, model="m") == 32
            out = np.zeros_like(kv)
            assert writer.retrieve("found", tokens, out, model="m") == 32
            assert np.array_equal(out, kv)
            l1 = get(srv, "/status").json()["l1"]
            assert l1["used_bytes"] == 2 * used and l1["groups"] == 4  # both copies held
            assert get(srv, "/sessions/pinning").json()["pinned_chunks"] == 2
            holder.end_session("pinning")
            assert wait_for(lambda: get(srv, "/status").json()["l1"]["used_bytes"] == used)
    finally:
        srv.close()


def test_status_page_and_assets(server: ServerProcess) -> None:
    page = get(server, "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for element in ("hit-rate", "l1-used", "sessions-active", "lookup-hit-tokens"):
        assert f'id="{element}"' in page.text
    assert "http://" not in page.text and "https://" not in page.text  # no external assets
    for asset, kind in (("/static/app.js", "javascript"), ("/static/style.css", "text/css")):
        response = get(server, asset)
        assert response.status_code == 200 and kind in response.headers["content-type"]


# -- auth ----------------------------------------------------------------------------------------


def test_off_loopback_without_token_refuses_to_start() -> None:
    with pytest.raises(RuntimeError) as refused:
        start_server(*SERVER_ARGS, "--admin-host", "0.0.0.0")
    assert "--admin-token" in str(refused.value) and "KVTIER_ADMIN_TOKEN" in str(refused.value)


def test_off_loopback_requires_the_token() -> None:
    srv = start_server(*SERVER_ARGS, "--admin-host", "0.0.0.0", "--admin-token", TOKEN)
    try:
        assert srv.admin_url is not None
        port = srv.admin_url.rsplit(":", 1)[1]
        base = f"http://127.0.0.1:{port}"  # bound to every interface; only ever use loopback
        routes = [
            ("GET", "/status"),
            ("GET", "/sessions"),
            ("GET", "/sessions/x"),
            ("DELETE", "/sessions/x"),
            ("GET", "/threads"),
            ("GET", "/metrics"),
            ("POST", "/clear"),
            ("GET", "/openapi.json"),
        ]
        for method, path in routes:
            for headers in ({}, auth("wrong-token"), {"Authorization": TOKEN}):
                response = httpx.request(method, base + path, headers=headers, json={})
                assert response.status_code == 401, (method, path, headers)
        # Probes, the page and its assets never need the token (the page holds no data).
        for path in ("/health", "/", "/static/app.js", "/static/style.css"):
            assert httpx.get(base + path).status_code == 200, path
        assert TOKEN not in httpx.get(base + "/").text
        assert httpx.get(base + "/status", headers=auth(TOKEN)).json()["ready"] is True
        assert httpx.post(base + "/clear", headers=auth(TOKEN), json={}).status_code == 200
        # No token in URLs: a query parameter is no credential.
        assert httpx.get(base + "/status", params={"token": TOKEN}).status_code == 401
        # The page logs in once; the HttpOnly cookie then carries its reads, never its changes.
        assert httpx.post(base + "/login", json={"token": "wrong"}).status_code == 401
        login = httpx.post(base + "/login", json={"token": TOKEN})
        assert login.status_code == 200
        set_cookie = login.headers["set-cookie"].lower()
        assert "httponly" in set_cookie and "samesite=strict" in set_cookie
        cookies = dict(login.cookies)
        assert cookies["kvtier_admin"] != TOKEN  # a digest: the cookie is not the bearer token
        assert httpx.get(base + "/status", cookies=cookies).status_code == 200
        assert httpx.post(base + "/clear", cookies=cookies, json={}).status_code == 401
        assert httpx.get(base + "/status", cookies=cookies).json()["config"]["admin_token"] == "***"
        assert srv.proc.poll() is None
        assert json.loads(cli("status", "--admin", base, "--token", TOKEN, "--json").stdout)[
            "ready"
        ]
        refused = cli("status", "--admin", base, check=False)
        assert refused.returncode == 1 and "KVTIER_ADMIN_TOKEN" in refused.stderr
        from_env = cli("status", "--admin", base, env={"KVTIER_ADMIN_TOKEN": TOKEN})
        assert "L1" in from_env.stdout
    finally:
        srv.stop()
    assert TOKEN not in srv.output


def test_loopback_changes_need_the_generated_token() -> None:
    srv = start_server(*SERVER_ARGS)
    try:
        assert srv.admin_url is not None
        path = token_file(srv)
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.parent.stat().st_mode & 0o777 == 0o700
        token = path.read_text().strip()
        assert len(token) >= 32 and token not in srv.output
        base = srv.admin_url
        assert httpx.get(base + "/status").status_code == 200  # reads stay open on loopback
        for method, route in (("POST", "/clear"), ("DELETE", "/sessions/x")):
            assert httpx.request(method, base + route, json={}).status_code == 401
        assert httpx.post(base + "/clear", json={}, headers=auth(token)).status_code == 200
        assert httpx.delete(base + "/sessions/x", headers=auth(token)).status_code == 404
        # `kvtier clear` finds the token by the admin port, as the same user.
        assert cli("clear", "--admin", base).stdout.strip() == "cleared 0 chunks"
    finally:
        srv.stop()
    assert not path.exists(), "the token file is removed at shutdown"


def test_dead_redis_tier_degrades_health_and_reaches_metrics_errors_and_log() -> None:
    """Finding 3 of issue 13: a dead Redis tier no longer looks healthy."""
    dead = f"redis://:hunter2@127.0.0.1:{free_port()}/0?connect_timeout=0.2&cooldown=0.5"
    srv = start_server(*SERVER_ARGS, "--l2", dead)
    try:
        assert wait_for(lambda: get(srv, "/health").json()["status"] == "degraded", timeout=20)
        health = get(srv, "/health")
        assert health.status_code == 200, "degraded still serves: probes keep the server"
        body = health.json()
        assert body["status"] == "degraded" and "L2 tier redis is failing" in body["reasons"][0]
        status = get(srv, "/status").json()
        assert status["health"] == "degraded"
        assert status["l2"]["failing"] == ["redis"] and status["l2"]["tiers"][0]["name"] == "redis"
        assert any(e["code"] == "L2_ERROR" for e in status["recent_errors"])
        assert all("hunter2" not in url for url in status["config"]["l2"])
        got = metric_samples(get(srv, "/metrics").text)
        assert got[("kvtier_l2_errors_total", (("tier", "redis"),))] > 0
        assert got[("kvtier_l2_failing", (("tier", "redis"),))] == 1
        assert got[("kvtier_degraded", ())] == 1
        # the tier keeps failing two more checks of the tier watch: the log line is rate-limited
        runs = tier_watch_runs(srv)
        assert wait_for(lambda: tier_watch_runs(srv) >= runs + 2, timeout=20)
    finally:
        srv.stop()
    failing_lines = [line for line in srv.log if "L2 tier redis failing" in line]
    assert len(failing_lines) == 1, failing_lines
    assert "hunter2" not in srv.output


# -- kvtier status / clear -----------------------------------------------------------------------


def cli(
    *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "COLUMNS": "160", **(env or {})}
    if not env:
        full_env.pop("KVTIER_ADMIN_TOKEN", None)
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_cli_status_tables_and_json(server: ServerProcess) -> None:
    tables = cli("status", "--admin", admin_url(server)).stdout
    for heading in ("kvtier server", "L1", "L2 tiers", "Clients", "Recent errors"):
        assert heading in tables
    assert "64.0 MiB" in tables
    status = json.loads(cli("status", "--admin", admin_url(server), "--json").stdout)
    assert status["l1"]["capacity_bytes"] == 64 << 20 and status["threads_healthy"] is True


def test_cli_status_says_when_a_tiers_load_speed_is_not_measured_yet(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    fresh = server_factory("--l1-size", "64MiB", "--l2", f"disk://{tmp_path}/l2?size=64MiB")
    tables = cli("status", "--admin", admin_url(fresh)).stdout
    speeds = tables[tables.index("L2 load speed") :]
    row = next(line for line in speeds.splitlines() if line.startswith("│ disk "))
    assert row.split("│")[1:4] == [" disk ", " not measured yet ", "          - "], tables
    assert "loads at not measured" not in tables


def test_cli_version_and_config_mistakes_are_one_line() -> None:
    assert cli("--version").stdout.strip().startswith("kvtier ")
    mistakes = [
        (["--l1-size", "2"], "--l1-size", "2GiB"),
        (["--l1-size", "abc"], "--l1-size", "2GiB"),
        (["--l1-size", "4KiB"], "--l1-size", "2GiB"),
        (["--chunk-size", "0"], "--chunk-size", "--chunk-size 256"),
        (["--chunk-size", "abc"], "--chunk-size", "--chunk-size 256"),
        (["--log-level", "verbose"], "--log-level", "--log-level info"),
        (["--hash-algorithm", "sha256_cbor"], "--hash-seed", "--hash-seed 0"),
        (["--session-ttl", "-5"], "--session-ttl", "--session-ttl 600"),
        (["--address", "/tmp/x.sock"], "--address", "ipc://"),
    ]
    for args, option, example in mistakes:
        result = cli("serve", *args, "--admin-port", "-1", "--l2", "none", check=False)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (args, result.stderr)
        assert len(lines) == 1 and option in lines[0] and example in lines[0], (args, lines)
        assert "Traceback" not in result.stderr


def test_cli_serve_help_is_readable() -> None:
    text = cli("serve", "--help").stdout
    assert "<list[str]>" not in text and "<bool>" not in text
    for name in ("blake3", "xxh3_128", "sha256_cbor", "SIZE", "SECONDS"):
        assert name in text


def test_cli_clear(server: ServerProcess) -> None:
    result = cli("clear", "--admin", admin_url(server), "--model", "never-stored")
    assert result.stdout.strip() == "cleared 0 chunks"


def test_cli_unreachable_server_is_one_line_and_exit_1() -> None:
    result = cli("status", "--admin", "http://127.0.0.1:1", check=False)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach" in lines[0] and "127.0.0.1:1" in lines[0]
    result = cli("clear", "--admin", "http://127.0.0.1:1", check=False)
    assert result.returncode == 1 and "cannot reach" in result.stderr


# -- a scripted workload -------------------------------------------------------------------------

CHUNK_SHAPE = (2, 4, 64)  # float16: 1 KiB per chunk


def kv_chunks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *CHUNK_SHAPE)).astype(np.float16)


def test_metrics_and_sessions_follow_a_client_workload(server: ServerProcess) -> None:
    model = f"model-{time.monotonic_ns()}"
    before = get(server, "/status").json()
    with Client(server.address) as client:
        chunk = client.chunk_size
        tokens = list(range(4 * chunk))
        client.register(model=model, chunk_shape=CHUNK_SHAPE, dtype="float16")
        stored = client.store("writer", tokens[: 2 * chunk], kv_chunks(2, 0), model=model)
        assert stored == 2 * chunk
        hits = [
            client.lookup("reader-a", tokens, model=model),
            client.lookup("reader-b", tokens[:chunk], model=model),
            client.lookup("reader-c", [7] * (3 * chunk), model=model),
        ]
        requested = 4 * chunk + chunk + 3 * chunk
        assert hits == [2 * chunk, chunk, 0]

        got = metric_samples(get(server, "/metrics").text)
        labels = (("model", model),)
        assert got[("kvtier_lookup_hit_tokens_total", labels)] == sum(hits)
        assert got[("kvtier_lookup_requested_tokens_total", labels)] == requested
        assert got[("kvtier_requests_total", (("operation", "lookup"), ("step", "lookup")))] >= 3
        assert got[("kvtier_stored_bytes_total", ())] >= 2 * kv_chunks(1, 0).nbytes
        assert got[("kvtier_clients_connected", ())] >= 1
        assert got[("kvtier_l1_used_bytes", ())] > 0

        status = get(server, "/status").json()
        lookup_delta = {
            k: status["lookup"][k] - before["lookup"][k] for k in ("requested_tokens", "hit_tokens")
        }
        assert lookup_delta == {"requested_tokens": requested, "hit_tokens": sum(hits)}
        me = [c for c in status["clients"] if c["client_id"] == client.client_id[:8]]
        assert client.client_id not in json.dumps(status)
        assert me and me[0]["registrations"][0]["model"] == model
        mine = [m for m in status["models"] if m["model"] == model]
        assert mine == [
            {"model": model, "requested_tokens": requested, "hit_tokens": sum(hits), "lookups": 3}
        ]
        assert status["traffic"]["stored_bytes"] >= 2 * kv_chunks(1, 0).nbytes
        assert {r["operation"] for r in status["latency"]} >= {"lookup", "store", "register"}
        assert sum(p[1] for p in status["hit_rate_history"]) >= requested

        page = get(server, "/sessions", params={"limit": 1000}).json()
        ids = [s["request_id"] for s in page["sessions"]]
        assert {"writer", "reader-a", "reader-b", "reader-c"} <= set(ids)
        assert page["total"] >= 4
        assert ids.index("reader-c") < ids.index("reader-a") < ids.index("writer")  # newest first
        first = get(server, "/sessions", params={"offset": 0, "limit": 2}).json()
        second = get(server, "/sessions", params={"offset": 2, "limit": 2}).json()
        assert [s["request_id"] for s in first["sessions"] + second["sessions"]] == ids[:4]

        session = get(server, "/sessions/reader-a").json()
        assert session["request_id"] == "reader-a" and session["num_tokens"] == 4 * chunk
        assert session["pinned_chunks"] == 2

        # A clear removes pinned chunks from view at once too (issue 10, finding 7); their
        # slots are freed when the pins end.
        assert httpx.post(
            admin_url(server) + "/clear", json={"model": model}, headers=changes(server)
        ).json() == {"cleared": 2}
        assert client.lookup("reader-d", tokens, model=model) == 0
        for request_id in ("writer", "reader-a", "reader-b", "reader-c"):
            url = admin_url(server) + f"/sessions/{request_id}"
            assert httpx.delete(url, headers=changes(server)).status_code == 200
            assert get(server, f"/sessions/{request_id}").status_code == 404
        client.end_session("reader-d")
        assert cli("clear", "--admin", admin_url(server), "--model", model).stdout.strip() == (
            "cleared 0 chunks"
        )
        assert client.lookup("reader-e", tokens, model=model) == 0
        client.end_session("reader-e")


# -- health with a stalled thread (in process, over a real Engine) -------------------------------


def test_health_503_while_a_critical_thread_is_stalled(tmp_path: Path) -> None:
    registry = PeriodicThreadRegistry()
    config = ServerConfig(
        address=[f"ipc://{tmp_path}/kvtier.sock"],
        l1_size=4 << 20,
        l2=["none"],  # the default disk tier would leave a folder under ~/.cache per run
        arena_name=f"kvtier-admin-test-{os.getpid()}-{time.monotonic_ns()}",
        prefault=False,
        admin_port=0,
    )
    engine = build_engine(config, registry=registry)
    clock = FakeClock()
    stalled = create_periodic_thread(
        "test-stalled", 3600.0, lambda: None, ThreadLevel.CRITICAL, registry=registry, clock=clock
    )
    lazy = create_periodic_thread(
        "test-lazy", 3600.0, lambda: None, ThreadLevel.LOW, registry=registry, clock=clock
    )
    try:
        views = AdminViews(engine, registry=registry)
        with start_admin_server(views, port=0, registry=registry) as admin:
            stalled.start()
            lazy.start()
            assert stalled.wait_for_runs(1, timeout=10)  # the first cycle runs at start
            assert httpx.get(admin.url + "/health").json() == {"status": "ok"}

            clock.now += 3 * 3600.0 + 1  # three missed intervals: stalled (the LOW one is ignored)
            response = httpx.get(admin.url + "/health")
            assert response.status_code == 503
            body = response.json()
            assert body["status"] == "unavailable"
            assert len(body["reasons"]) == 1 and "test-stalled" in body["reasons"][0]
            assert httpx.get(admin.url + "/status").json()["threads_healthy"] is False
            threads = httpx.get(admin.url + "/threads").json()
            assert [u["name"] for u in threads["health"]["unhealthy"]] == ["test-stalled"]
            assert {t["name"] for t in threads["threads"]} >= {"test-stalled", "test-lazy"}

            stalled.wake()  # it runs a cycle, stamped with the fake clock's now: healthy again
            assert stalled.wait_for_runs(2, timeout=10)
            assert httpx.get(admin.url + "/health").status_code == 200

            engine.close()  # the arena is gone: not ready
            response = httpx.get(admin.url + "/health")
            assert response.status_code == 503 and "not ready" in response.json()["reasons"][0]
    finally:
        registry.reset()
        engine.close()

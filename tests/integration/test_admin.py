"""The admin HTTP API and `kvtier status` / `clear`, against a real `kvtier serve` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.client import Client
from kvtier.config import ServerConfig
from kvtier.periodic import PeriodicThreadRegistry, ThreadLevel, create_periodic_thread
from kvtier.server.admin import start_admin_server
from kvtier.server.app import build_engine
from tests.conftest import ServerProcess, start_server

from ..conftest import FakeClock

REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-token-Zx9"
SERVER_ARGS = ("--l1-size", "64MiB")


def auth(token: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One server for the module (its tests use disjoint models and request ids)."""
    srv = start_server(*SERVER_ARGS)
    try:
        yield srv
    finally:
        srv.stop()


def get(srv: ServerProcess, path: str, **kw: Any) -> httpx.Response:
    return httpx.get(srv.admin_url + path, timeout=10, **kw)


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


# -- endpoints -----------------------------------------------------------------------------------


def test_admin_url_is_loopback(server: ServerProcess) -> None:
    assert server.admin_url.startswith("http://127.0.0.1:")


def test_health_ok(server: ServerProcess) -> None:
    response = get(server, "/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_status_shape(server: ServerProcess) -> None:
    status = get(server, "/status").json()
    assert status["ready"] is True and status["threads_healthy"] is True
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
    assert set(status["sessions"]) == {"active", "created", "expired", "orphaned"}
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
    response = httpx.delete(server.admin_url + "/sessions/no-such-request")
    assert response.status_code == 404
    assert "no-such-request" in response.json()["error"]


def test_clear_validates_its_body(server: ServerProcess) -> None:
    url = server.admin_url + "/clear"
    bad = [b"{not json", b"[1, 2]", b'{"model": 3}', b'{"modle": "x"}']
    for body in bad:
        response = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, body
        assert "error" in response.json()
    response = httpx.post(url, json={"model": "never-stored", "cache_salt": None})
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
        "/",
    }
    assert set(paths["/sessions/{request_id}"]) == {"get", "delete"}
    assert set(paths["/clear"]) == {"post"}


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
            ("GET", "/health"),
            ("GET", "/status"),
            ("GET", "/sessions"),
            ("GET", "/sessions/x"),
            ("DELETE", "/sessions/x"),
            ("GET", "/threads"),
            ("GET", "/metrics"),
            ("POST", "/clear"),
            ("GET", "/openapi.json"),
            ("GET", "/"),
            ("GET", "/static/app.js"),
        ]
        for method, path in routes:
            for headers in ({}, auth("wrong-token"), {"Authorization": TOKEN}):
                response = httpx.request(method, base + path, headers=headers, json={})
                assert response.status_code == 401, (method, path, headers)
        assert httpx.get(base + "/health", headers=auth(TOKEN)).status_code == 200
        assert httpx.get(base + "/status", headers=auth(TOKEN)).json()["ready"] is True
        assert httpx.post(base + "/clear", headers=auth(TOKEN), json={}).status_code == 200
        # The browser page authenticates by ?token=, for itself and its assets only.
        page = httpx.get(base + "/", params={"token": TOKEN})
        assert page.status_code == 200 and f"/static/app.js?token={TOKEN}" in page.text
        assert httpx.get(base + "/static/app.js", params={"token": TOKEN}).status_code == 200
        assert httpx.get(base + "/status", params={"token": TOKEN}).status_code == 401
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
    tables = cli("status", "--admin", server.admin_url).stdout
    for heading in ("kvtier server", "L1", "L2 tiers", "Clients", "Recent errors"):
        assert heading in tables
    assert "64.0 MiB" in tables
    status = json.loads(cli("status", "--admin", server.admin_url, "--json").stdout)
    assert status["l1"]["capacity_bytes"] == 64 << 20 and status["threads_healthy"] is True


def test_cli_clear(server: ServerProcess) -> None:
    result = cli("clear", "--admin", server.admin_url, "--model", "never-stored")
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
        labels = (("cache_salt", ""), ("model", model))
        assert got[("kvtier_lookup_hit_tokens_total", labels)] == sum(hits)
        assert got[("kvtier_lookup_requested_tokens_total", labels)] == requested
        assert got[("kvtier_requests_total", (("operation", "Lookup"),))] >= 3
        assert got[("kvtier_stored_bytes_total", ())] >= 2 * kv_chunks(1, 0).nbytes
        assert got[("kvtier_clients_connected", ())] >= 1
        assert got[("kvtier_l1_used_bytes", ())] > 0

        status = get(server, "/status").json()
        lookup_delta = {
            k: status["lookup"][k] - before["lookup"][k] for k in ("requested_tokens", "hit_tokens")
        }
        assert lookup_delta == {"requested_tokens": requested, "hit_tokens": sum(hits)}
        me = [c for c in status["clients"] if c["client_id"] == client.client_id]
        assert me and me[0]["registrations"][0]["model"] == model

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

        # Pinned chunks survive a clear; ending the sessions releases the pins.
        assert httpx.post(server.admin_url + "/clear", json={"model": model}).json() == {
            "cleared": 0
        }
        for request_id in ("writer", "reader-a", "reader-b", "reader-c"):
            assert httpx.delete(server.admin_url + f"/sessions/{request_id}").status_code == 200
            assert get(server, f"/sessions/{request_id}").status_code == 404
        assert client.lookup("reader-d", tokens, model=model) == 2 * chunk
        client.end_session("reader-d")
        assert cli("clear", "--admin", server.admin_url, "--model", model).stdout.strip() == (
            "cleared 2 chunks"
        )
        assert client.lookup("reader-e", tokens, model=model) == 0
        client.end_session("reader-e")


# -- health with a stalled thread (in process, over a real Engine) -------------------------------


def test_health_503_while_a_critical_thread_is_stalled(tmp_path: Path) -> None:
    registry = PeriodicThreadRegistry()
    config = ServerConfig(
        address=[f"ipc://{tmp_path}/kvtier.sock"],
        l1_size=4 << 20,
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
        with start_admin_server(engine, port=0, registry=registry) as admin:
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

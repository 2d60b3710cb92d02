"""deploy/grafana/kvtier.json and deploy/prometheus/kvtier-rules.yaml against a real Prometheus.

A real `prometheus` scrapes a live `kvtier serve` (with a disk tier, tenants, KV events and an
admin token, as deploy/kubernetes runs it) every second while a client stores, looks up,
retrieves, holds pins and makes mistakes. Then every query of every dashboard panel runs
through Prometheus's HTTP API over that window and must return finite data (no panel silently
empty), every recording and alerting rule must evaluate without error, every series an alert
names must have data, and KvtierDown must fire for real once the server stops. The metric names
the dashboard and the rules use are checked against the server's own /metrics, so a renamed
metric fails here. `promtool check rules` and `promtool test rules` (each alert firing and not
firing) run too.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from testkit.prometheus import Prometheus, binary, finite_values, start_prometheus
from testkit.servers import ServerProcess, free_port, start_server
from testkit.waiting import wait_for

import kvtier
from kvtier.errors import KVTierError

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kvtier.json"
RULES = REPO / "deploy" / "prometheus" / "kvtier-rules.yaml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "kvtier-rules.test.yaml"

ADMIN_TOKEN = "a" * 32
TENANT_TOKEN = "tenant-a-credential-0001"
CS = 16
SHAPE = (2, 2, CS, 1, 64)  # 8 KiB a chunk: a 512 KiB L1 holds about 60 and evicts to the disk
#: what Grafana puts for the dashboard's variables: "All" of job and server, and the rate
#: window it would pick for a 1 s scrape interval
GRAFANA_VARIABLES = {"$__rate_interval": "15s", "$job": ".+", "$instance": ".+"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, query) for every target of every panel."""
    return [
        (panel["title"], target["expr"])
        for panel in dashboard()["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


OPERATIONS = REPO / "docs" / "operations.md"


def docs_prometheus_config() -> dict[str, Any]:
    """The prometheus.yml lines of docs/operations.md."""
    text = OPERATIONS.read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", text, re.S)
    return yaml.safe_load(block)  # type: ignore[no-any-return]


def as_grafana_runs_it(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a variable the dashboard does not define: {expr}"
    return expr


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def series_names(expr: str) -> set[str]:
    """The metric and recording-rule names an expression selects (kvtier's and `up`)."""
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)  # matchers, ranges, strings
    return {n for n in _NAME.findall(bare) if n.startswith(("kvtier_", "kvtier:")) or n == "up"}


def exported_names(metrics_text: str) -> set[str]:
    """Every sample name a /metrics page holds (`_total`, `_bucket`... included)."""
    return {
        line.split("{")[0].split(" ")[0]
        for line in metrics_text.splitlines()
        if line and not line.startswith("#")
    }


def unknown_names(names: set[str], exported: set[str]) -> set[str]:
    """The kvtier metric names (not recording rules, not `up`) that /metrics lacks."""
    return {n for n in names if n.startswith("kvtier_") and n not in exported}


# -- the live run ----------------------------------------------------------------------------------


def _drive(address: str, seconds: float, stop: threading.Event) -> dict[str, int]:
    """An engine's traffic: new prompts stored (the small L1 evicts to the disk tier), old ones
    looked up and retrieved (loaded back from the disk), lookups left pinned (the tenant holds
    pins), unknown prompts looked up (misses) and a session ended twice (an error reply)."""
    counts = {"stored": 0, "hit": 0, "errors": 0}
    kv = np.ones((4, *SHAPE), np.float16)
    out = np.empty_like(kv)
    deadline = time.monotonic() + seconds
    with kvtier.Client(address, token=TENANT_TOKEN) as client:
        client.register(model="dash", chunk_shape=SHAPE, dtype="float16")
        i = 0
        while time.monotonic() < deadline and not stop.is_set():
            prompt = np.arange(i * 4 * CS, (i + 1) * 4 * CS, dtype=np.uint32)
            counts["stored"] += client.store(f"s{i}", prompt, kv, model="dash")
            old = np.arange((i // 2) * 4 * CS, (i // 2 + 1) * 4 * CS, dtype=np.uint32)
            hit = client.lookup(f"r{i}", old, model="dash")
            if hit:
                counts["hit"] += client.retrieve(f"r{i}", old, out, model="dash", end=hit)
            client.end_session(f"r{i}")
            client.lookup(f"held{i % 3}", prompt, model="dash")  # pinned until the next round
            client.lookup(f"u{i}", np.arange(10**6 + i * 64, 10**6 + i * 64 + 64), model="dash")
            client.end_session(f"u{i}")
            try:
                client.end_session(f"u{i}")
            except KVTierError:
                counts["errors"] += 1
            i += 1
            time.sleep(0.05)
    return counts


class Live:
    """What the module's run left: Prometheus (still up), the time window, the server's
    /metrics page and what the client did."""

    def __init__(self, prom: Prometheus, server: ServerProcess, start: float) -> None:
        self.prom = prom
        self.server = server
        self.start = start
        self.end = start
        self.metrics_text = ""
        self.counts: dict[str, int] = {}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder = tmp_path_factory.mktemp("prometheus")
    (folder / "tokens").write_text(f"{TENANT_TOKEN} team-a\n")
    (folder / "admin-token").write_text(ADMIN_TOKEN)
    server = start_server(
        "--l1-size", "512KiB", "--chunk-size", str(CS),
        "--l2", f"disk://{folder}/l2?size=64MiB",
        "--admin-token", ADMIN_TOKEN, "--auth-tokens-file", str(folder / "tokens"),
        "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
    )  # fmt: skip
    assert server.admin_url is not None, server.output
    # docs/operations.md's scrape job, pointed at this server and this token file
    docs = docs_prometheus_config()
    assert [Path(f).name for f in docs["rule_files"]] == [RULES.name]
    (scrape,) = docs["scrape_configs"]
    scrape["authorization"]["credentials_file"] = str(folder / "admin-token")
    scrape["static_configs"] = [{"targets": [server.admin_url.removeprefix("http://")]}]
    prom = start_prometheus(folder, [scrape], [RULES])
    run = Live(prom, server, time.time())
    stop = threading.Event()
    try:
        run.counts = _drive(server.address, 12.0, stop)
        run.metrics_text = httpx.get(
            f"{server.admin_url}/metrics",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=10,
        ).text
        # two more scrapes and rule evaluations after the last request
        time.sleep(2.5)
        run.end = time.time()
        yield run
    finally:
        stop.set()
        server.close()
        prom.stop()


def test_the_client_did_what_the_panels_show(live: Live) -> None:
    assert live.counts["stored"] > 0 and live.counts["hit"] > 0 and live.counts["errors"] > 0
    up = live.prom.query('up{job="kvtier"}')
    assert [float(s["value"][1]) for s in up] == [1.0], up


def test_every_dashboard_metric_name_is_one_kvtier_exports(live: Live) -> None:
    exported = exported_names(live.metrics_text)
    names = set().union(*(series_names(expr) for _, expr in panel_queries()))
    assert unknown_names(names, exported) == set()
    for rule in rules():
        assert unknown_names(series_names(rule["expr"]), exported) == set(), rule
    # a renamed metric is caught by the same check
    renamed = exported - {"kvtier_lookup_hit_tokens_total"}
    assert unknown_names(names, renamed) == {"kvtier_lookup_hit_tokens_total"}


def test_the_operations_guide_shows_every_panels_queries() -> None:
    text = OPERATIONS.read_text().replace("\\|", "|")  # a table cell escapes PromQL's "|"
    missing = [f"{title}: {expr}" for title, expr in panel_queries() if f"`{expr}`" not in text]
    assert missing == [], missing


def test_every_panel_query_returns_data_from_a_real_prometheus(live: Live) -> None:
    empty = []
    for title, expr in panel_queries():
        result = live.prom.query_range(as_grafana_runs_it(expr), live.start, live.end)
        if not finite_values(result):
            empty.append(f"{title}: {expr}")
    assert empty == [], "panels with no data:\n" + "\n".join(empty)
    hit_rate = panel_queries()[0][1]
    values = finite_values(
        live.prom.query_range(as_grafana_runs_it(hit_rate), live.start, live.end)
    )
    assert 0 < max(values) <= 1, values


def test_every_rule_evaluates_and_every_series_an_alert_names_has_data(live: Live) -> None:
    loaded = {rule["name"]: rule for rule in live.prom.rules()}
    for rule in rules():
        name = rule.get("alert") or rule["record"]
        assert loaded[name]["health"] == "ok", (name, loaded[name].get("lastError"))
        live.prom.query(rule["expr"])  # evaluates without an error
        for series in series_names(rule["expr"]):
            result = live.prom.query_range(series, live.start, live.end)
            assert finite_values(result), f"{name}: {series} has no data"


def test_kvtier_down_fires_when_the_server_stops(live: Live) -> None:
    (down,) = [rule for rule in rules() if rule.get("alert") == "KvtierDown"]
    assert live.prom.query(down["expr"]) == []
    live.server.stop()
    assert wait_for(lambda: live.prom.query(down["expr"]) != [], timeout=15)


# -- promtool --------------------------------------------------------------------------------------


def test_promtool_checks_the_rules_and_their_unit_tests_pass() -> None:
    promtool = binary("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run([promtool, "test", "rules", str(RULE_TESTS)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def test_each_alert_has_a_unit_test_firing_and_one_not_firing() -> None:
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert alerts == {
        "KvtierDown", "KvtierTierFailing", "KvtierHitRateCollapsed", "KvtierL1FullOfPins",
        "KvtierEventsDropped", "KvtierTenantAtShare",
    }  # fmt: skip
    cases = [
        case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    ]  # fmt: skip
    for alert in alerts:
        expected = [case["exp_alerts"] for case in cases if case["alertname"] == alert]
        assert [] in expected and any(expected), alert


def test_the_unit_tests_fail_when_an_alert_is_broken(tmp_path: Path) -> None:
    """The same unit tests against rules with one threshold moved: promtool says which."""
    broken = RULES.read_text().replace(
        "kvtier:l1_pinned:ratio > 0.8", "kvtier:l1_pinned:ratio > 0.9"
    )
    assert broken != RULES.read_text()
    (tmp_path / RULES.name).write_text(broken)
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    out = subprocess.run([binary("promtool"), "test", "rules", str(tmp_path / RULE_TESTS.name)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "KvtierL1FullOfPins" in out.stdout + out.stderr


# -- the dashboard's shape -------------------------------------------------------------------------


def test_the_dashboard_imports_with_any_prometheus_and_its_panels_do_not_overlap() -> None:
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= set(variables)
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])}  # fmt: skip
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine

"""A real Prometheus (Debian's `prometheus` package) on a free loopback port, scraping the
targets a test gives it and evaluating rule files, and its HTTP query API."""

from __future__ import annotations

import math
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from testkit.servers import free_port
from testkit.waiting import wait_for

HINT = "apt-get install prometheus (make test does: Debian's package has prometheus and promtool)"


def binary(name: str) -> str:
    """`prometheus` or `promtool` from PATH, failing the test (never skipping) when missing."""
    exe = shutil.which(name)
    if exe is None:
        pytest.fail(f"{name} is missing: {HINT}", pytrace=False)
    return exe


@dataclass
class Prometheus:
    """A running Prometheus and the folder holding its configuration and data."""

    proc: subprocess.Popen[bytes]
    url: str
    folder: Path

    def query(self, expr: str, time: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result (AssertionError naming the expression on an error)."""
        params: dict[str, Any] = {"query": expr}
        if time is not None:
            params["time"] = time
        return self._api("query", params)

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[Any]:
        """A range query's result: one entry per series, each with its [time, value] pairs."""
        return self._api("query_range", {"query": expr, "start": start, "end": end, "step": step})

    def rules(self) -> list[dict[str, Any]]:
        """Every rule Prometheus loaded, with its health and last error."""
        reply = httpx.get(f"{self.url}/api/v1/rules", timeout=10).json()
        return [rule for group in reply["data"]["groups"] for rule in group["rules"]]

    def _api(self, what: str, params: dict[str, Any]) -> list[Any]:
        reply = httpx.get(f"{self.url}/api/v1/{what}", params=params, timeout=30).json()
        assert reply["status"] == "success", (params["query"], reply)
        return reply["data"]["result"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_prometheus(
    folder: Path,
    scrape_configs: list[dict[str, Any]],
    rule_files: list[Path],
    interval: str = "1s",
) -> Prometheus:
    """Prometheus scraping and evaluating every `interval`, its data under `folder`."""
    exe = binary("prometheus")
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": scrape_configs,
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv = [
        exe, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ]  # fmt: skip
    log = open(folder / "prometheus.log", "wb")  # noqa: SIM115 - the child writes it until it stops
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    server = Prometheus(proc, f"http://127.0.0.1:{port}", folder)

    def ready() -> bool:
        try:
            return httpx.get(f"{server.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    if not wait_for(ready, timeout=60) or proc.poll() is not None:
        server.stop()
        output = (folder / "prometheus.log").read_text(errors="replace")
        raise AssertionError(f"prometheus did not start: {' '.join(argv)}\n{output}")
    return server


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    """The finite sample values of a query result (instant or range): NaN and infinities,
    which a panel draws as nothing, left out."""
    values: list[float] = []
    for series in result:
        pairs = series.get("values") or [series["value"]]
        values.extend(float(v) for _, v in pairs if math.isfinite(float(v)))
    return values

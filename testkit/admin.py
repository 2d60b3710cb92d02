"""What a test reads from a server's admin HTTP API: its status, its metrics, and the headers
that let a request change it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from testkit.servers import ServerProcess


def auth(token: str | None = None) -> dict[str, str]:
    """The Authorization header of `token` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def admin_url(server: ServerProcess) -> str:
    """The server's admin base URL (every server the tests start has one unless told not to)."""
    assert server.admin_url is not None, "the server was started without an admin API"
    return server.admin_url


def status(server: ServerProcess, token: str | None = None) -> dict[str, Any]:
    """GET /status."""
    reply = httpx.get(admin_url(server) + "/status", timeout=5, headers=auth(token))
    return reply.json()  # type: ignore[no-any-return]


def written(server: ServerProcess, n: int) -> bool:
    """Whether the server's L2 has written at least `n` chunks and has nothing queued."""
    l2 = status(server)["l2"]
    return bool(l2["written"] >= n and l2["queue_depth"] == 0)


def token_file(server: ServerProcess) -> Path:
    """The file the server wrote its generated admin token to (it says where at start)."""
    m = re.search(r"token for changes: (\S+)\)", server.output)
    assert m, server.output
    return Path(m.group(1))


def changes(server: ServerProcess) -> dict[str, str]:
    """Headers that let a request change the server (clear, end a session)."""
    return auth(token_file(server).read_text().strip())


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text as {(sample name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out

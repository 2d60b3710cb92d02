"""Replaying a trace through a real kvtier server: a private `kvtier serve` to replay against,
the requests on the real lookup and store path, and the server's own counters around the run.

Each request is what an engine does with a prompt: a lookup under a new request id (its hit is
what the lookup reports), a store of the whole prompt (the server skips the chunks it holds) and
the end of the request's session. Chunks are `BLOCK_TOKENS` tokens of one tiny layout,
`CHUNK_BYTES` each (one page, so an L1 of N chunks' bytes holds exactly N of them); every run
stores under a model name of its own, so a running server's other chunks never count as hits.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvtier.cli.trace import BLOCK_TOKENS, TraceRequest, prompt_tokens
from kvtier.client import Client
from kvtier.errors import KVTierError

__all__ = ["CHUNK_BYTES", "CHUNK_SHAPE", "Run", "ServerCounters", "private_server", "replay"]

#: One chunk of the replay's layout: (layers, K and V, tokens, KV heads, head dim), float16.
CHUNK_SHAPE = (1, 2, BLOCK_TOKENS, 1, 2)
CHUNK_BYTES = 4096  # 1 * 2 * 512 * 1 * 2 * 2 bytes: one page
START_TIMEOUT_S = 60.0


@dataclass
class ServerCounters:
    """What the server's /status counts that a replay reports (differences over a run)."""

    l1_stored_bytes: int = 0  # bytes committed into L1
    l1_evictions: int = 0
    l1_evicted_bytes: int = 0
    l1_declined_evictions: int = 0  # evicted chunks the cache policy had not admitted
    l2_written_bytes: dict[str, int] = field(default_factory=dict)  # per tier
    l2_puts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, status: dict[str, Any]) -> ServerCounters:
        l1, l2 = status["l1"], status["l2"]
        tiers = l2.get("tiers", [])
        return cls(
            l1_stored_bytes=int(status["traffic"]["stored_bytes"]),
            l1_evictions=int(l1["evictions"]),
            l1_evicted_bytes=int(l1["evicted_bytes"]),
            l1_declined_evictions=int(l1.get("declined_evictions", 0)),
            l2_written_bytes={t["name"]: int(t["bytes_written"]) for t in tiers},
            l2_puts={t["name"]: int(t["puts"]) for t in tiers},
        )

    def since(self, before: ServerCounters) -> ServerCounters:
        """What was counted between `before` and these."""
        return ServerCounters(
            l1_stored_bytes=self.l1_stored_bytes - before.l1_stored_bytes,
            l1_evictions=self.l1_evictions - before.l1_evictions,
            l1_evicted_bytes=self.l1_evicted_bytes - before.l1_evicted_bytes,
            l1_declined_evictions=self.l1_declined_evictions - before.l1_declined_evictions,
            l2_written_bytes={
                name: n - before.l2_written_bytes.get(name, 0)
                for name, n in self.l2_written_bytes.items()
            },
            l2_puts={name: n - before.l2_puts.get(name, 0) for name, n in self.l2_puts.items()},
        )


@dataclass
class Run:
    """One replay through a server: hit blocks per request, timings, the server's counters."""

    hits: list[int]
    seconds: float
    lookup_s: float  # all lookups together, as the client waited for them
    store_s: float  # all stores together
    store_errors: int  # stores the server refused (the prompt's chunks were not stored)
    counters: ServerCounters | None  # None: no admin API to read them from


@dataclass(frozen=True)
class Server:
    """Where a server listens: its ZMQ address and admin API (None: not known)."""

    address: str
    admin: str | None


@contextlib.contextmanager
def private_server(l1_chunks: int, policy: str, l2: Sequence[str]) -> Iterator[Server]:
    """A `kvtier serve` of its own on a private ipc address, with an L1 of exactly `l1_chunks`
    chunks, chunks of `BLOCK_TOKENS` tokens, `policy` and the L2 tiers `l2` (none when empty);
    stopped (SIGINT) on exit. RuntimeError with its output when it does not start."""
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-") as tmp:
        address = f"ipc://{tmp}/kvtier.sock"
        argv = [
            sys.executable, "-m", "kvtier.cli", "serve", "--address", address,
            "--l1-size", f"{l1_chunks * CHUNK_BYTES}B", "--chunk-size", str(BLOCK_TOKENS),
            "--policy", policy, "--admin-host", "127.0.0.1", "--admin-port", "0",
            "--log-level", "warning",
        ]  # fmt: skip
        for url in l2 or ["none"]:
            argv += ["--l2", url]
        log = Path(tmp) / "server.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        try:
            yield Server(address, _wait_ready(proc, log))
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], log: Path) -> str | None:
    """The admin URL of a server once it printed that it is ready."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "kvtier: ready" in text:
            found = re.search(r"^admin: (http\S+)", text, re.MULTILINE)
            return found.group(1) if found else None
        if proc.poll() is not None:
            raise RuntimeError(f"kvtier serve exited with {proc.returncode}:\n{text[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"kvtier serve was not ready in {START_TIMEOUT_S:g}s:\n{text[-2000:]}")


def read_status(admin: str, token: str | None = None) -> dict[str, Any]:
    """The server's GET /status; RuntimeError saying what went wrong."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(admin.rstrip("/") + "/status", headers=headers, timeout=30.0)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot read {admin}/status: {exc}") from None
    if response.is_error:
        raise RuntimeError(f"{admin}/status answered HTTP {response.status_code}")
    status: dict[str, Any] = response.json()
    return status


def _settled_status(admin: str, token: str | None, timeout: float = 60.0) -> dict[str, Any]:
    """/status once the L2 write-through queue is empty (what was stored is written)."""
    deadline = time.monotonic() + timeout
    while True:
        status = read_status(admin, token)
        l2 = status["l2"]
        done = l2["written"] + l2["dropped"] + l2["write_errors"]
        if (l2["queue_depth"] == 0 and done >= l2["submitted"]) or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def replay(
    server: Server,
    requests: Sequence[TraceRequest],
    *,
    token: str = "",
    admin_token: str | None = None,
    progress: Callable[[int], None] = lambda done: None,
) -> Run:
    """Replay `requests` in order through the server; `progress(n)` after each one."""
    admin = server.admin
    before = None if admin is None else ServerCounters.of(read_status(admin, admin_token))
    model = f"kvtier-replay-{uuid.uuid4().hex[:12]}"
    longest = max((len(r.hash_ids) for r in requests), default=0)
    kv = np.zeros((max(1, longest), *CHUNK_SHAPE), dtype=np.float16)
    hits: list[int] = []
    lookup_s = store_s = 0.0
    errors = 0
    start = time.perf_counter()
    with Client(server.address, token=token) as client:
        if client.chunk_size != BLOCK_TOKENS:
            raise RuntimeError(
                f"the server at {server.address} has chunks of {client.chunk_size} tokens; a "
                f"replay needs {BLOCK_TOKENS} (kvtier serve --chunk-size {BLOCK_TOKENS})"
            )
        client.register(model=model, chunk_shape=CHUNK_SHAPE, dtype="float16")
        for index, request in enumerate(requests):
            request_id = f"{model}-{index}"
            tokens = prompt_tokens(request.hash_ids)
            t0 = time.perf_counter()
            hit = client.lookup(request_id, tokens, model=model)
            t1 = time.perf_counter()
            if len(request.hash_ids):
                try:
                    client.store(request_id, tokens, kv[: len(request.hash_ids)], model=model)
                except KVTierError:
                    errors += 1
            t2 = time.perf_counter()
            client.end_session(request_id)
            lookup_s += t1 - t0
            store_s += t2 - t1
            hits.append(hit // BLOCK_TOKENS)
            progress(index + 1)
    seconds = time.perf_counter() - start
    counters = None
    if admin is not None and before is not None:
        counters = ServerCounters.of(_settled_status(admin, admin_token)).since(before)
    return Run(hits, seconds, lookup_s, store_s, errors, counters)

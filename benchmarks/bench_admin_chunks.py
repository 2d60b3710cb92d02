"""What polling the admin API's `/chunks` costs an engine: the p99 of one client's lookups
(a full L1 hit of a four-chunk prompt, the same request each time) while another thread polls
`GET /chunks` without pause, against the same lookups with no polling (the baseline, measured
in the same run on the same server). The L1 holds `GROUPS` one-page chunk groups, so a scan of
all of it under the engine lock would show.

Run alone: `python -m benchmarks.bench_admin_chunks [GROUPS]`.
"""

from __future__ import annotations

import sys
import threading
import time

import httpx
import numpy as np
from testkit.servers import start_server

from benchmarks.common import percentile, table
from kvtier.client import Client

CHUNK = 16
SHAPE = (2, 4)  # float16: 16 bytes a chunk, one page a shard
GROUPS = 200_000
BATCH = 4096  # chunks a store
LOOKUPS = 1500


def _fill(c: Client, groups: int) -> None:
    rng = np.random.default_rng(0)
    for n in range(0, groups, BATCH):
        k = min(BATCH, groups - n)
        tokens = rng.integers(0, 50_000, size=k * CHUNK).tolist()
        kv = np.zeros((k, *SHAPE), dtype=np.float16)
        c.store(f"fill{n}", tokens, kv, model="m")


def _lookups(c: Client, tokens: list[int]) -> list[float]:
    out = []
    for _ in range(LOOKUPS):
        t0 = time.perf_counter()
        c.lookup("probe", tokens, model="m")
        out.append(time.perf_counter() - t0)
    return out


def _measure(groups: int) -> list[list[object]]:
    server = start_server(
        "--l1-size", f"{(groups + 1024) * 4096 * 2 // (1 << 20) + 8}MiB",
        "--chunk-size", str(CHUNK), "--max-sessions", "100000",
    )  # fmt: skip
    try:
        admin = server.admin_url
        assert admin is not None
        with Client(server.address) as c:
            c.register(model="m", chunk_shape=list(SHAPE), dtype="float16")
            _fill(c, groups)
            tokens = list(range(1, 4 * CHUNK + 1))
            c.store("hot", tokens, np.ones((4, *SHAPE), dtype=np.float16), model="m")
            _lookups(c, tokens)  # warm up
            idle = _lookups(c, tokens)
            stop = threading.Event()
            polls: list[float] = []

            def poll() -> None:
                with httpx.Client(base_url=admin, timeout=60) as http:
                    while not stop.is_set():
                        t0 = time.perf_counter()
                        reply = http.get("/chunks")
                        reply.raise_for_status()
                        polls.append(time.perf_counter() - t0)

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            time.sleep(0.5)
            busy = _lookups(c, tokens)
            stop.set()
            poller.join(60)
            holds = httpx.get(admin + "/status", timeout=30).json()["lock_hold"]
        chunks_hold = holds.get("chunks", {}).get("max_s", 0.0) * 1e3
        p_idle, p_busy = percentile(idle, 99) * 1e3, percentile(busy, 99) * 1e3
        return [
            [f"{groups:,}", f"{p_idle:.2f}", f"{p_busy:.2f}", f"{p_busy / p_idle:.2f}x",
             f"{max(busy) * 1e3:.1f}", f"{chunks_hold:.1f}", len(polls),
             f"{percentile(polls, 50) * 1e3:.0f}" if len(polls) > 1 else "-"],
        ]  # fmt: skip
    finally:
        server.close()


def run(groups: int = GROUPS) -> str:
    rows = _measure(groups)
    return "\n".join(
        [
            "## /chunks polled while an engine looks up",
            "",
            f"{LOOKUPS} lookups (a full L1 hit of 4 chunks) with no polling, then with a thread",
            "polling `GET /chunks` (the default limit) without pause; ratio against no polling.",
            "The longest hold of the engine lock by one /chunks call is the server's own",
            "`lock_hold` figure (`/status`).",
            "",
            table(
                [
                    "L1 groups",
                    "lookup p99 ms, idle",
                    "lookup p99 ms, polled",
                    "ratio",
                    "lookup max ms, polled",
                    "longest /chunks lock hold ms",
                    "polls",
                    "poll p50 ms",
                ],
                rows,
            ),
            "",
        ]
    )


if __name__ == "__main__":
    print(run(int(sys.argv[1]) if len(sys.argv) > 1 else GROUPS))

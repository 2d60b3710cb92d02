"""Concurrency of the server, as ratios against same-run baselines (issue 11).

- Lookups beside L2 loads: p99 latency of 8 clients doing L1-hit lookups of a 32k-token prompt,
  while 2 other clients keep looking up prompts that must load from the disk tier, against the
  same 8 clients with no L2 traffic. Goal: at most 2x.
- Small requests: heartbeats from 8 clients (raw DEALER sockets, so the client library's own
  overhead is not measured), requests per second against a ZMQ ROUTER echo server in Python
  with the same clients. Goal: at least 50%.
- The longest hold of the engine lock per request type during the runs (from /status).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from benchmarks.common import percentile, stop_server, table

T = TypeVar("T")

PROMPT = 32768
CHUNK_SHAPE = (64, 1024)  # float16: 128 KiB per chunk, 16 MiB per 32k-token prompt
HOT_CLIENTS = 8
LOADERS = 2
LOAD_PROMPTS = 16  # distinct prompts on disk; L1 holds only a few of them at once
HOT_LOOKUPS = 150  # per hot client and phase
ROUNDS = 3  # quiet and busy phases alternate, so a slow minute of the machine hits both
SMALL_CLIENTS = 8
SMALL_REQUESTS = 3000  # per client


def _tokens(seed: int) -> bytes:
    return np.arange(seed * 10**6, seed * 10**6 + PROMPT, dtype="<u4").tobytes()


def _admin(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/status", timeout=30) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def _start(*args: str) -> tuple[Any, str, str]:
    """`kvtier serve` with its admin API on a free port: (process, address, admin url)."""
    import os
    import subprocess
    import sys

    address = f"ipc:///tmp/kvtier-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--address", address, "--admin-port", "0",
         *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    stdout = proc.stdout
    lines, url = [], ""
    for line in stdout:
        lines.append(line)
        if line.startswith("admin: "):
            url = line.split()[1]
        if line.startswith("kvtier: ready"):
            import threading

            threading.Thread(target=lambda: [None for _ in stdout], daemon=True).start()
            return proc, address, url
    raise RuntimeError("kvtier serve did not start:\n" + "".join(lines))


def _store_prompts(address: str, seeds: list[int]) -> None:
    from kvtier.client import Client

    kv = np.random.default_rng(0).standard_normal((PROMPT // 256, *CHUNK_SHAPE))
    kv = kv.astype(np.float16)
    with Client(address, timeout=120) as c:
        c.register(model="bench", chunk_shape=CHUNK_SHAPE, dtype="float16")
        for seed in seeds:
            c.store(f"fill{seed}", _tokens(seed), kv, model="bench")
            c.end_session(f"fill{seed}")


def _hot_client(address: str, n: int, barrier: Any, queue: Any) -> None:
    from kvtier.client import Client

    tokens = _tokens(0)
    samples = []
    with Client(address) as c:
        for _ in range(10):
            c.lookup("warm", tokens, model="bench")
        barrier.wait()
        me = uuid.uuid4().hex[:6]
        for _ in range(n):
            t0 = time.perf_counter()
            hit = c.lookup(me, tokens, model="bench")
            samples.append(time.perf_counter() - t0)
            assert hit == PROMPT, hit
        c.end_session(me)
    queue.put(samples)


def _loader(address: str, seeds: list[int], go: Any, stop: Any, queue: Any) -> None:
    """Look up prompts that are on disk and (mostly) not in L1 while `go` is set, until told
    to stop."""
    from kvtier.client import Client

    loads = 0
    times = []
    with Client(address, timeout=120) as c:
        c.register(model="bench", chunk_shape=CHUNK_SHAPE, dtype="float16")
        i = 0
        while not stop.is_set():
            if not go.wait(0.05):
                continue
            seed = seeds[i % len(seeds)]
            t0 = time.perf_counter()
            hit = c.lookup(f"load{seed}-{i}", _tokens(seed), model="bench")
            times.append(time.perf_counter() - t0)
            c.end_session(f"load{seed}-{i}")
            loads += hit == PROMPT
            i += 1
    queue.put((i, loads, times))


def _hot_phase(address: str) -> list[float]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(HOT_CLIENTS)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_hot_client, args=(address, HOT_LOOKUPS, barrier, queue))
        for _ in range(HOT_CLIENTS)
    ]
    for proc in procs:
        proc.start()
    samples: list[float] = []
    for _ in procs:
        samples += queue.get(timeout=600)
    for proc in procs:
        proc.join()
    return samples


def alternate_beside_loaders(
    address: str, seeds: list[int], measure: Callable[[], T], rounds: int, busy_after_s: float
) -> tuple[list[tuple[T, T]], list[Any]]:
    """`rounds` pairs of `measure()`: with the loader processes paused (quiet), then while they
    load `seeds`' prompts (busy), alternated so a slow minute of the machine hits both; and each
    loader's (lookups, full hits, lookup times)."""
    ctx = mp.get_context("spawn")
    go, stop, queue = ctx.Event(), ctx.Event(), ctx.Queue()
    loaders = [
        ctx.Process(target=_loader, args=(address, seeds[i::LOADERS], go, stop, queue))
        for i in range(LOADERS)
    ]
    for loader in loaders:
        loader.start()
    pairs = []
    for _ in range(rounds):
        go.clear()
        time.sleep(1)  # the loads in flight end
        quiet = measure()
        go.set()
        time.sleep(busy_after_s)  # the loaders are loading
        pairs.append((quiet, measure()))
    stop.set()
    results = [queue.get(timeout=600) for _ in loaders]
    for loader in loaders:
        loader.join()
    return pairs, results


def _lookups_beside_loads() -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="kvtier-bench-l2-")
    disk = f"disk://{folder}?size=2GiB"
    seeds = list(range(1, 1 + LOAD_PROMPTS))
    try:
        proc, address, _ = _start(
            "--l1-size", "1GiB", "--l2", disk, "--l2-queue-policy", "block"
        )  # fmt: skip
        try:
            _store_prompts(address, seeds)
            time.sleep(2)  # let the write-through drain
        finally:
            stop_server(proc)  # flushes the L2 queue
        # L1 holds the hot prompt and about three loaded ones: loaders keep reading the disk
        proc, address, admin = _start("--l1-size", "80MiB", "--l2", disk)
        try:
            _store_prompts(address, [0])  # the hot prompt, in L1
            rounds, results = alternate_beside_loaders(
                address, seeds, lambda: _hot_phase(address), ROUNDS, busy_after_s=2
            )
            holds = _admin(admin)["lock_hold"]
        finally:
            stop_server(proc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    load_times = [t for _, _, times in results for t in times]
    return {
        "rounds": rounds,
        "loader_lookups": sum(n for n, _, _ in results),
        "loader_full_hits": sum(k for _, k, _ in results),
        "load_times": load_times,
        "holds": holds,
    }


# -- small requests ------------------------------------------------------------------------------


def _echo_server(address: str, ready: Any, stop: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    ready.set()
    while not stop.is_set():
        if sock.poll(100):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                sock.send_multipart(frames, copy=False)
    ctx.destroy(linger=0)


def _small_client(address: str, kvtier: bool, n: int, barrier: Any, queue: Any) -> None:
    import zmq

    from kvtier import protocol as p

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    if kvtier:
        hello = p.Hello(p.PROTOCOL_VERSION, uuid.uuid4().hex)
        sock.send_multipart([b"00000000", p.encode(hello)])
        sock.recv_multipart()
    header = p.encode(p.Heartbeat())
    for _ in range(50):
        sock.send_multipart([b"00000001", header])
        sock.recv_multipart()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        sock.send_multipart([b"00000001", header])
        sock.recv_multipart()
    queue.put((t0, time.perf_counter()))
    ctx.destroy(linger=0)


def _small_rate(address: str, kvtier: bool) -> float:
    """Requests per second, all clients together, from the first start to the last end."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(SMALL_CLIENTS)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_small_client, args=(address, kvtier, SMALL_REQUESTS, barrier, queue))
        for _ in range(SMALL_CLIENTS)
    ]
    for proc in procs:
        proc.start()
    spans: list[tuple[float, float]] = [queue.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    return SMALL_CLIENTS * SMALL_REQUESTS / wall


def _small_requests() -> tuple[float, float, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    echo_address = f"ipc:///tmp/kvtier-bench-echo-{uuid.uuid4().hex[:6]}.sock"
    echo = ctx.Process(target=_echo_server, args=(echo_address, ready, stop))
    echo.start()
    ready.wait(30)
    try:
        echo_rate = _small_rate(echo_address, kvtier=False)
    finally:
        stop.set()
        echo.join()
    proc, address, admin = _start("--l1-size", "64MiB", "--l2", "none")
    try:
        kvtier_rate = _small_rate(address, kvtier=True)
        holds = _admin(admin)["lock_hold"]
    finally:
        stop_server(proc)
    return echo_rate, kvtier_rate, holds


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def run() -> str:
    lines = ["## Server concurrency: lookups beside L2 loads, small requests", ""]
    loads = _lookups_beside_loads()
    rounds: list[tuple[list[float], list[float]]] = loads["rounds"]
    quiet = [t for q, _ in rounds for t in q]
    busy = [t for _, b in rounds for t in b]
    q99, b99 = percentile(quiet, 99), percentile(busy, 99)
    ratios = [percentile(b, 99) / percentile(q, 99) for q, b in rounds]
    load_times = loads["load_times"]
    rows = [
        [
            f"round {i + 1}",
            _ms(percentile(q, 50)),
            _ms(percentile(q, 99)),
            _ms(percentile(b, 50)),
            _ms(percentile(b, 99)),
            f"{ratio:.2f}",
        ]
        for i, ((q, b), ratio) in enumerate(zip(rounds, ratios, strict=True))
    ]
    rows.append(
        [
            f"all {ROUNDS} rounds",
            _ms(percentile(quiet, 50)),
            _ms(q99),
            _ms(percentile(busy, 50)),
            _ms(b99),
            f"{b99 / q99:.2f}",
        ]
    )
    lines += [
        f"{HOT_CLIENTS} client processes each do {HOT_LOOKUPS} lookups of a 32k-token prompt"
        " whose 128 chunks are in L1 (128 KiB per chunk), with no L2 traffic (quiet), then the"
        f" same again while {LOADERS} other clients keep looking up {LOAD_PROMPTS} other"
        " 32k-token prompts that are on the disk tier and mostly not in L1 (L1 is 80 MiB: the"
        " hot prompt and about three loaded ones), so their lookups load 16 MiB each from disk"
        f" (busy). Quiet and busy phases alternate, {ROUNDS} rounds; the goal reads the p99 of"
        " all rounds' samples together.",
        "",
        table(
            [
                "L1-hit lookups",
                "quiet p50 ms",
                "quiet p99 ms",
                "busy p50 ms",
                "busy p99 ms",
                "p99 ratio",
            ],
            rows,
        ),
        "",
        f"- the loaders' lookups: {len(load_times)} ({loads['loader_full_hits']} full hits),"
        + (
            f" p50 {_ms(percentile(load_times, 50))} ms, p99 {_ms(percentile(load_times, 99))} ms"
            if len(load_times) > 2
            else " too few for percentiles"
        ),
        f"- goal p99 beside L2 loads <= 2x p99 without: {b99 / q99:.2f}x over all rounds"
        f" (per round {', '.join(f'{r:.2f}' for r in ratios)}) — "
        f"{'met' if b99 / q99 <= 2 else 'NOT met'}",
        "",
    ]
    echo_rate, kvtier_rate, small_holds = _small_requests()
    lines += [
        f"{SMALL_CLIENTS} client processes each send {SMALL_REQUESTS} heartbeat requests, one at "
        "a time, over raw DEALER sockets; the baseline is a Python ZMQ ROUTER that echoes each",
        "message back, with the same clients.",
        "",
        table(
            ["server", "requests/s", "ratio"],
            [
                ["ZMQ echo (baseline)", f"{echo_rate:,.0f}", "1.00"],
                ["kvtier heartbeats", f"{kvtier_rate:,.0f}", f"{kvtier_rate / echo_rate:.2f}"],
            ],
        ),
        "",
        f"- goal >= 50% of the echo server: {kvtier_rate / echo_rate:.0%} — "
        f"{'met' if kvtier_rate / echo_rate >= 0.5 else 'NOT met'}",
        "",
        "Holds of the engine lock per operation (request type or background task), from the",
        "server's status (`lock_hold`): the lookup server over all lookup phases, then the",
        "heartbeat server. A hold's time includes any wait for the GIL or a CPU inside it.",
        "",
        table(
            ["server", "operation", "holds", "mean µs", "max µs"],
            [
                [
                    run_name,
                    op,
                    h["count"],
                    f"{h['total_s'] / h['count'] * 1e6:.0f}",
                    f"{h['max_s'] * 1e6:.0f}",
                ]
                for run_name, holds in (("lookups", loads["holds"]), ("heartbeats", small_holds))
                for op, h in sorted(holds.items())
            ],
        ),
        "",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())

"""Small helpers shared by the benchmark modules: timing, threads, markdown tables, `kvtier serve`
processes, the tier benchmarks' buffers, and a Redis prefix's clean-up."""

from __future__ import annotations

import mmap
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


def best_of(fn: Callable[[], object], *, repeat: int = 5, number: int = 1) -> float:
    """The fastest of `repeat` timings of `number` calls, in seconds per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of samples, by linear interpolation."""
    return statistics.quantiles(samples, n=100, method="inclusive")[max(0, min(98, int(q) - 1))]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def start_server(*args: str) -> tuple[Any, str]:
    """Start `kvtier serve` in its own process; returns (process, address) once it is ready."""
    import os
    import subprocess
    import sys
    import threading
    import uuid

    address = f"ipc:///tmp/kvtier-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--address", address, "--admin-port", "-1",
         "--l2", "none", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("kvtier: ready"):
            # keep reading its output: a full pipe would stall the server's logging
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, address
    raise RuntimeError("kvtier serve did not start:\n" + "".join(lines))


def stop_server(proc: Any) -> None:
    import signal

    proc.send_signal(signal.SIGINT)
    proc.wait(15)


def on_threads(fn: Callable[[int], None], n: int) -> float:
    """Seconds `fn(0)` .. `fn(n - 1)` take, each on its own thread, all at once; re-raises the
    first failure."""
    failures: list[BaseException] = []

    def body(c: int) -> None:
        try:
            fn(c)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=body, args=(c,)) for c in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failures:
        raise failures[0]
    return wall


class Buffers:
    """One mapping for a source chunk and `clients` x `batch` outputs of its size, as the
    server's arena is one mapping: a Mooncake tier registers it once and moves bytes in place."""

    def __init__(self, chunk: bytes, clients: int, batch: int) -> None:
        self.size = len(chunk)
        self.map = mmap.mmap(-1, self.size * (1 + clients * batch))
        self.view = memoryview(self.map)
        self.view[: self.size] = chunk
        self.chunk = self.view[: self.size]
        self.outs = [
            [self.view[self.size * (1 + c * batch + j) :][: self.size] for j in range(batch)]
            for c in range(clients)
        ]


def drop_redis_keys(prefix: str, url: str = "redis://127.0.0.1:6379/0") -> None:
    """Delete every key under `prefix` from the Redis at `url` (what a run stored there)."""
    import redis

    r = redis.Redis.from_url(url)
    names = list(r.scan_iter(match=f"{prefix}*", count=1000))
    if names:
        r.delete(*names)

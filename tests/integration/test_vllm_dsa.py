"""KVTierConnector on the KV cache specs vLLM builds for DeepSeek-V3.2 and GLM-5 (DeepSeek
Sparse Attention: an MLA latent and an indexer's keys per layer, in one KV cache group of
unlike layers) and DeepSeek-V4 (sliding-window latents, latents compressed 4:1 and 128:1 beside
their indexer, the compressors' running states: six groups with blocks of 64, 256, 4 and 8
tokens), under vLLM's real Scheduler and KV cache manager (HMA on), with worker connectors on CPU
caches vLLM's own planner and allocator build (`testkit/dsa_specs.py`), against a real
`kvtier serve`. vLLM's CPU build cannot run these models' forward passes (sparse attention is
CUDA / ROCm only), so the harness's forward pass writes each token's (or compressed state's)
known value and a load is checked byte for byte."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit.dsa_specs import FAMILIES, family_specs
from testkit.servers import ServerProcess, start_server
from testkit.tiny_models import write_tiny_llama
from testkit.vllm_harness import Harness, require_vllm

from kvtier.client import Client

pytestmark = pytest.mark.vllm

CHUNK = 256  # DeepSeek-V4's compressed group has blocks of 256 tokens
BLOCK = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm()
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-dsa"), layers=4, kv_heads=2)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server("--l1-size", "256MiB", "--chunk-size", str(CHUNK), "--client-timeout", "5")
    yield srv
    srv.close()


@pytest.fixture
def harness(model_dir: Path) -> Iterator[Callable[..., Harness]]:
    built: list[Harness] = []

    def build(address: str, family: str, **kw: Any) -> Harness:
        kw.setdefault("block_size", BLOCK)
        kw.setdefault("max_model_len", 1024)
        kw.setdefault("max_num_batched_tokens", 1024)
        kw.setdefault("num_blocks", 512 if family == "deepseek-v4" else 128)
        kw.setdefault("layout", "BLHNC")  # what vLLM's CPU engine resolves for DeepSeek-V4
        kw.setdefault("extra", {"model": f"{family}-tp{kw.get('tensor_parallel_size', 1)}"})
        h = Harness.build(model_dir, address=address, specs=family_specs(family, BLOCK), **kw)
        built.append(h)
        return h

    yield build
    for h in built:
        h.close()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(n)]


def _store(build: Callable[..., Harness], address: str, family: str, prompt: list[int], **kw: Any):
    a = build(address, family, **kw)
    a.add("a", prompt)
    a.run_until_done(["a"])
    a.flush()
    assert a.num_cached["a"] == 0
    a.close()


def _assert_groups_exact(h: Harness, req_id: str, tokens: list[int], rank: int = 0) -> None:
    """Every layer of every group holds, in every block vLLM allocated, what a recompute
    writes (a compressed layer: each whole state)."""
    assert h.groups
    for i, g in enumerate(h.groups):
        got = h.read_back(req_id, rank, len(tokens), i)
        want = h.expected(tokens, rank, i, req_id=req_id)
        assert len(got), f"group {i} ({g.kind}, {g.names}) holds nothing to compare"
        assert _raw(got) == _raw(want), f"group {i} ({g.names})"


def _raw(t: Any) -> bytes:
    import torch

    return bytes(t.contiguous().view(torch.uint8).numpy())


def _run_until_loaded(h: Harness, req_id: str) -> None:
    """Step until the request is scheduled past its load (a model of one KV cache group loads in
    the step that schedules it; several groups load asynchronously, before it is scheduled)."""
    out = h.step(forward=False)
    if req_id not in out.num_scheduled_tokens:
        h.step_until_scheduled(req_id, forward=False)


def _kinds(family: str) -> list[tuple[str, int]]:
    """(kind, tokens per state) of each run of alike layers the harness sees."""
    return {
        "deepseek-v3.2": [("mla", 1), ("mla", 1)],
        "glm-5": [("mla", 1), ("mla", 1)],
        "deepseek-v4": [("sliding", 1)] * 3
        + [("mla", 4), ("mla", 4), ("mla", 128), ("sliding", 1), ("sliding", 1), ("sliding", 1)],
    }[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_copy_for_two_tp_ranks_every_group_byte_exact_hits_where_every_group_resumes(
    server: ServerProcess, harness: Callable[..., Harness], family: str
) -> None:
    """A TP=2 engine stores one copy of every group (nothing is split over TP ranks); another
    loads it into both ranks, byte for byte in every layer of every group. A hit is a point
    every group resumes from: DeepSeek-V3.2 and GLM-5 keep every block of every layer (a hit
    is whole blocks, one token short of the prompt); DeepSeek-V4's sliding windows and
    compressor states are read at the hit's end (a hit is whole chunks, where each 4:1 and
    128:1 state is complete)."""
    tp2: dict[str, Any] = {"tensor_parallel_size": 2}
    stored = _prompt(FAMILIES.index(family) + 1, 2 * CHUNK + 88)  # 2 full chunks and a tail
    _store(harness, server.address, family, stored, **tp2)
    # vLLM's own prefix cache off: every token not computed comes from kvtier
    b = harness(server.address, family, enable_prefix_caching=False, **tp2)
    assert sorted((g.kind, g.tokens_per_state) for g in b.groups) == sorted(_kinds(family))
    sides = [w.worker_side for w in b.workers]
    assert sides[0].config.mla and [s.worker_id for s in sides] == [0, 0]
    assert sides[0].config.world_size == 1 and not sides[0].config.stores(1)
    cases = {  # request: (prompt, tokens kvtier serves)
        "full": (stored, 2 * CHUNK),
        # the 2 stored chunks exactly: the last token is computed (vLLM needs its logits)
        "exact": (stored[: 2 * CHUNK], CHUNK if family == "deepseek-v4" else 2 * CHUNK - BLOCK),
        # 10 tokens short of the second chunk: only what the prompt holds whole
        "short": (stored[: 2 * CHUNK - 10], CHUNK),
        # leaves the stored prompt inside the first chunk: nothing
        "other": (stored[:100] + _prompt(99, 400), 0),
    }
    for req, (tokens, want) in cases.items():
        b.add(req, tokens)
        _run_until_loaded(b, req)
        assert b.num_cached[req] == want, req
        if want:
            for rank in (0, 1):  # both ranks load the one copy
                _assert_groups_exact(b, req, tokens[:want], rank)
        b.run_until_done([req])
    assert not b.invalid_blocks_seen and not b.failed_loads_seen
    # the server holds one shard per chunk: complete at world_size 1, unknown at 2
    model = sides[0].config.model
    with Client(server.address) as client:
        ids = np.asarray(stored, dtype=np.uint32)
        assert client.lookup("probe1", ids, model=model, world_size=1) == 2 * CHUNK
        assert client.lookup("probe2", ids, model=model, world_size=2) == 0


def test_a_chunk_that_is_not_a_multiple_of_every_group_block_is_refused(
    harness: Callable[..., Harness],
) -> None:
    from kvtier.errors import InvalidArgumentError

    odd = start_server("--l1-size", "16MiB", "--chunk-size", "128")
    try:  # DeepSeek-V4's compressed group has blocks of 256 tokens
        with pytest.raises(InvalidArgumentError, match="multiple of"):
            harness(odd.address, "deepseek-v4")
    finally:
        odd.stop()


def test_caches_that_cannot_be_resumed_or_split_are_refused_naming_why() -> None:
    import torch
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        UniformTypeKVCacheSpecs,
    )

    from kvtier.errors import InvalidArgumentError
    from kvtier.integrations.vllm.config import cache_groups

    def config(spec: Any, names: list[str]) -> Any:
        return KVCacheConfig(
            num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
        )

    kw: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": 1, "dtype": torch.bfloat16}
    ring = CircularBufferSpec(**kw, head_size=64)  # GLM-5-Next's open compression group
    with pytest.raises(InvalidArgumentError, match="CircularBufferSpec"):
        cache_groups(config(ring, ["l0"]))
    replay = SlidingWindowMLASpec(**kw, head_size=512, sliding_window=128, bounded_replay=True)
    with pytest.raises(InvalidArgumentError, match="replayed, not cached"):
        cache_groups(config(replay, ["l0"]))
    # one group of an MLA latent (the same on every TP rank) and attention heads split over TP
    # ranks: fine at TP=1 (every rank stores its own), refused at TP=2
    mixed = UniformTypeKVCacheSpecs(
        block_size=BLOCK,
        kv_cache_specs={
            "l0": MLAAttentionSpec(**kw, head_size=576, max_tp_shards=1),
            "l1": FullAttentionSpec(**{**kw, "num_kv_heads": 2}, head_size=64),
        },
    )
    (group,) = cache_groups(config(mixed, ["l0", "l1"]))
    assert group.kind == "mla" and not group.replicated
    with pytest.raises(InvalidArgumentError, match="tensor-parallel-size 1"):
        cache_groups(config(mixed, ["l0", "l1"]), tp_size=2)

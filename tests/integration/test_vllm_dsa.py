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
    try:
        require_vllm()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
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
def test_every_group_round_trips_byte_exact(
    server: ServerProcess, harness: Callable[..., Harness], family: str
) -> None:
    prompt = _prompt(FAMILIES.index(family) + 1, 600)  # 2 full chunks and a tail
    _store(harness, server.address, family, prompt)
    b = harness(server.address, family)
    assert sorted((g.kind, g.tokens_per_state) for g in b.groups) == sorted(_kinds(family))
    config = b.workers[0].kvtier_config
    assert config.mla and config.world_size == 1  # nothing is split over TP ranks
    b.add("b", prompt)
    out = b.step(forward=False)
    (load,) = out.kv_connector_metadata.loads
    assert (load.start, load.end) == (0, 2 * CHUNK)
    if "b" not in out.num_scheduled_tokens:
        b.step_until_scheduled("b", forward=False)
    assert b.num_cached["b"] == 2 * CHUNK
    _assert_groups_exact(b, "b", prompt[: 2 * CHUNK])
    b.run_until_done(["b"])
    assert not b.invalid_blocks_seen and not b.failed_loads_seen


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hit_is_a_point_every_group_resumes_from(
    server: ServerProcess, harness: Callable[..., Harness], family: str
) -> None:
    """DeepSeek-V3.2 / GLM-5 keep every block of every layer: a hit is cut to whole blocks, one
    token short of the prompt. DeepSeek-V4's sliding windows and compressor states are read at
    the hit's end: a hit is whole chunks, where each 4:1 and 128:1 state is complete."""
    stored = _prompt(10 + FAMILIES.index(family), 2 * CHUNK + 8)
    _store(harness, server.address, family, stored)
    # the same first 2 chunks, ending 10 tokens into the second: only what was stored whole
    b = harness(server.address, family)
    short = stored[: CHUNK + CHUNK - 10]
    b.add("short", short)
    _run_until_loaded(b, "short")
    assert b.num_cached["short"] == CHUNK  # the second chunk is not complete in this prompt
    _assert_groups_exact(b, "short", short[:CHUNK])
    # exactly the 2 stored chunks: the last token is computed (vLLM needs its logits)
    c = harness(server.address, family)
    exact = stored[: 2 * CHUNK]
    c.add("exact", exact)
    _run_until_loaded(c, "exact")
    want = 2 * CHUNK - BLOCK if family != "deepseek-v4" else CHUNK
    assert c.num_cached["exact"] == want
    _assert_groups_exact(c, "exact", exact[:want])
    # a prompt that leaves the stored one inside the first chunk: no hit
    d = harness(server.address, family)
    other = stored[:100] + _prompt(99, 400)
    d.add("other", other)
    d.step()
    assert d.num_cached["other"] == 0
    for h, r in ((b, "short"), (c, "exact"), (d, "other")):
        h.run_until_done([r])
        assert not h.invalid_blocks_seen and not h.failed_loads_seen


@pytest.mark.parametrize("family", FAMILIES)
def test_two_tensor_parallel_ranks_store_one_copy_both_read(
    server: ServerProcess, harness: Callable[..., Harness], family: str
) -> None:
    prompt = _prompt(20 + FAMILIES.index(family), 600)
    _store(harness, server.address, family, prompt, tensor_parallel_size=2)
    b = harness(server.address, family, tensor_parallel_size=2)
    sides = [w.worker_side for w in b.workers]
    assert [s.worker_id for s in sides] == [0, 0] and sides[0].config.world_size == 1
    assert sides[0].config.stores(0) and not sides[0].config.stores(1)
    b.add("b", prompt)
    _run_until_loaded(b, "b")
    assert b.num_cached["b"] == 2 * CHUNK
    for rank in (0, 1):  # both ranks load the one copy
        _assert_groups_exact(b, "b", prompt[: 2 * CHUNK], rank)
    b.run_until_done(["b"])
    assert not b.invalid_blocks_seen and not b.failed_loads_seen
    # the server holds one shard per chunk: complete at world_size 1, unknown at 2
    model = sides[0].config.model
    with Client(server.address) as client:
        tokens = np.asarray(prompt, dtype=np.uint32)
        assert client.lookup("probe1", tokens, model=model, world_size=1) == 2 * CHUNK
        assert client.lookup("probe2", tokens, model=model, world_size=2) == 0


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

"""KVTierConnector on vLLM's hybrid KV cache manager (HMA on): vLLM's real Scheduler with
worker connectors on CPU caches that vLLM's own grouping and allocation build for a
sliding-window + full-attention model, an MLA model and a Mamba-type (linear attention + full
attention) model, against a real `kvtier serve`. Every group's load is checked byte for byte
against what a recompute writes (vllm_harness.py). Models with several KV cache groups load
asynchronously: a request waits for its load in WAITING_FOR_REMOTE_KVS and runs from the step
after, so these tests step until it is scheduled."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit.servers import ServerProcess, start_server
from testkit.tiny_models import write_tiny_llama
from testkit.vllm_harness import COPY_MODES, Harness, require_vllm
from testkit.waiting import wait_for

pytestmark = pytest.mark.vllm

CHUNK = 64  # kvtier chunk: four vLLM blocks of 16 (one Mamba-aligned block of 64)
BLOCK = 16
WINDOW = 20  # a sliding-window piece keeps min(4, cdiv(19, 16) + 1) = 3 of a chunk's 4 blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm()
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-hybrid"), layers=4, kv_heads=2)


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    srv = start_server("--l1-size", "64MiB", "--chunk-size", str(CHUNK), "--client-timeout", "5")
    yield srv
    srv.close()


def sliding_specs(tp: int = 1) -> Callable[[int], dict[str, Any]]:
    """Gemma-3-like: layers 0 and 2 slide over WINDOW tokens, 1 and 3 attend to everything."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    def specs(rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i in range(4):
            kw = {"block_size": BLOCK, "num_kv_heads": 2 // tp, "head_size": 64}
            name = f"model.layers.{i}.self_attn.attn"
            if i % 2 == 0:
                out[name] = SlidingWindowSpec(**kw, dtype=torch.float32, sliding_window=WINDOW)
            else:
                out[name] = FullAttentionSpec(**kw, dtype=torch.float32)
        return out

    return specs


def mla_specs(rank: int) -> dict[str, Any]:
    """DeepSeek-V2-like: one latent vector of 576 per token (kv_lora_rank 512 + rope 64)."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return {
        f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float32
        )
        for i in range(2)
    }


def mamba_specs(rank: int) -> dict[str, Any]:
    """Qwen3-Next-like: three linear-attention layers (a conv and a recurrent state each) and
    one full-attention layer, Mamba blocks aligned to the attention block (vLLM's "align")."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    out: dict[str, Any] = {}
    for i in range(3):
        out[f"model.layers.{i}.linear_attn"] = MambaSpec(
            block_size=CHUNK,
            shapes=((3, 256), (4, 16, 16)),
            dtypes=(torch.float32, torch.float32),
            mamba_cache_mode="align",
        )
    out["model.layers.3.self_attn.attn"] = FullAttentionSpec(
        block_size=CHUNK, num_kv_heads=2, head_size=64, dtype=torch.float32
    )
    return out


@pytest.fixture
def harness(harness: Callable[..., Harness]) -> Callable[..., Harness]:
    """The shared harness fixture (tests/integration/conftest.py) on this module's model, with
    this module's block size and lengths unless a test gives its own."""

    def build(address: str, **kw: Any) -> Harness:
        kw.setdefault("block_size", BLOCK)
        kw.setdefault("max_model_len", 1024)
        kw.setdefault("max_num_batched_tokens", 1024)
        return harness(address, **kw)

    return build


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(n)]


def _store(build: Callable[..., Harness], address: str, prompt: list[int], **kw: Any) -> None:
    a = build(address, **kw)
    a.add("a", prompt)
    a.run_until_done(["a"])
    a.flush()
    assert a.num_cached["a"] == 0
    a.close()


def _assert_groups_exact(h: Harness, req_id: str, tokens: list[int], rank: int = 0) -> None:
    """Every attention group holds, in every block vLLM allocated, what a recompute writes."""
    for i, g in enumerate(h.groups):
        if g.kind == "mamba":
            continue
        got = h.read_back(req_id, rank, len(tokens), i)
        want = h.expected(tokens, rank, i, req_id=req_id)
        assert got.numpy().tobytes() == want.numpy().tobytes(), f"group {i} ({g.kind})"


def _null_block_untouched(h: Harness) -> None:
    for rank, cache in enumerate(h.caches):
        for g in h.groups:
            for name in g.names:
                assert not cache[name][0].any(), f"rank {rank} wrote vLLM's null block ({name})"


@pytest.mark.parametrize("mode", list(COPY_MODES))
def test_sliding_window_round_trip_is_byte_exact_and_skips_the_null_block(
    mode: str, server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    prompt = _prompt(1, 300)  # 4 full chunks and a tail
    _store(harness, server.address, prompt, specs=sliding_specs(), extra=COPY_MODES[mode])
    b = harness(server.address, specs=sliding_specs(), extra=COPY_MODES[mode])
    assert [g.kind for g in b.groups] == ["sliding", "full"]
    # what the worker registers for the KV events: vLLM's own labels of its groups
    config = b.workers[0].kvtier_config
    assert [(g.index, g.spec_kind, g.sliding_window) for g in config.groups] == [
        (0, "sliding_window", WINDOW),
        (1, "full_attention", 0),
    ]
    b.add("b", prompt)
    out = b.step()
    (load,) = out.kv_connector_metadata.loads
    assert (load.start, load.end) == (0, 256)
    assert "b" not in out.num_scheduled_tokens  # it waits for its load
    b.step_until_scheduled("b")
    assert b.num_cached["b"] == 256
    sliding, full = load.block_ids
    assert len(full) == len(sliding) == 256 // BLOCK  # the sliding list keeps its length
    held = [x for x in sliding if x != 0]
    # vLLM allocates only the window before the hit: out-of-window blocks are not needed
    assert 0 < len(held) <= 3 and sliding[-len(held) :] == tuple(held)
    _assert_groups_exact(b, "b", prompt[:256])
    _null_block_untouched(b)
    b.run_until_done(["b"])
    assert not b.invalid_blocks_seen
    _null_block_untouched(b)


@pytest.mark.parametrize("mode", list(COPY_MODES))
def test_mla_round_trip_is_byte_exact(
    mode: str, server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    prompt = _prompt(2, 300)
    _store(harness, server.address, prompt, specs=mla_specs, extra=COPY_MODES[mode])
    b = harness(server.address, specs=mla_specs, extra=COPY_MODES[mode])
    assert [g.kind for g in b.groups] == ["mla"]
    assert [g.spec_kind for g in b.workers[0].kvtier_config.groups] == ["mla_attention"]
    b.add("b", prompt)
    b.step()
    assert b.num_cached["b"] == 256
    _assert_groups_exact(b, "b", prompt[:256])
    b.run_until_done(["b"])
    assert not b.invalid_blocks_seen


@pytest.mark.parametrize("mode", list(COPY_MODES))
def test_mla_with_two_tensor_parallel_ranks_stores_one_copy(
    mode: str, server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    from kvtier.client import Client

    prompt = _prompt(3, 300)
    _store(
        harness,
        server.address,
        prompt,
        specs=mla_specs,
        tensor_parallel_size=2,
        extra=COPY_MODES[mode],
    )
    b = harness(server.address, specs=mla_specs, tensor_parallel_size=2, extra=COPY_MODES[mode])
    config = b.workers[0].kvtier_config
    assert config.world_size == 1  # one shard, written by TP rank 0
    b.add("b", prompt)
    b.step()
    assert b.num_cached["b"] == 256
    for rank in (0, 1):  # both ranks load the one copy
        _assert_groups_exact(b, "b", prompt[:256], rank)
    b.run_until_done(["b"])
    assert not b.invalid_blocks_seen
    # the server holds the chunks as one shard: complete at world_size 1, unknown at 2
    import numpy as np

    with Client(server.address) as client:
        tokens = np.asarray(prompt, dtype=np.uint32)
        assert client.lookup("probe1", tokens, model=config.model, world_size=1) == 256
        assert client.lookup("probe2", tokens, model=config.model, world_size=2) == 0


@pytest.mark.parametrize("mode", list(COPY_MODES))
def test_mamba_state_round_trip_is_byte_exact(
    mode: str, server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    # steps of one chunk: vLLM's "align" mode materializes the state at every chunk's end
    kw: dict[str, Any] = {
        "specs": mamba_specs,
        "block_size": CHUNK,
        "mamba_cache_mode": "align",
        "max_num_batched_tokens": CHUNK,
    }
    prompt = _prompt(4, 300)
    _store(harness, server.address, prompt, **kw, extra=COPY_MODES[mode])
    b = harness(server.address, **kw, extra=COPY_MODES[mode])
    kinds = [g.kind for g in b.groups]
    assert kinds.count("mamba") == 3 and "full" in kinds
    b.add("b", prompt)
    out = b.step()
    (load,) = out.kv_connector_metadata.loads
    # the forward pass would write the state after 300 over the loaded one
    b.step_until_scheduled("b", forward=False)
    assert b.num_cached["b"] == 256
    _assert_groups_exact(b, "b", prompt[:256])
    for i, g in enumerate(b.groups):
        if g.kind == "mamba":
            want = b.expected_state(prompt[:256], 0, i)
            assert b.read_state("b", 0, 256, i) == want
            # loaded before the request's step is planned: vLLM copies the state at 256 into
            # the block its step runs from, after the load, so the load fills one block
            assert len(load.block_ids[i]) == 1, f"group {i}"
    b.run_until_done(["b"])
    assert not b.invalid_blocks_seen


def test_mamba_chunks_without_a_state_at_their_end_are_not_resume_points(
    server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    # one long step: vLLM's "align" split stops the prefill at 256 (the last block boundary
    # before the prompt's last token), so of chunks 64..256 only the one ending at 256 has a
    # state; the chunks before it are stored (their attention pages) but are no resume points
    kw: dict[str, Any] = {"specs": mamba_specs, "block_size": CHUNK, "mamba_cache_mode": "align"}
    prompt = _prompt(5, 300)
    a = harness(server.address, **kw)
    a.add("a", prompt)
    out = a.step()
    (save,) = out.kv_connector_metadata.saves
    assert (save.chunk_start, save.chunk_end) == (0, 256)
    a.run_until_done(["a"])
    a.flush()
    a.close()
    b = harness(server.address, **kw)
    b.add("b", prompt)
    b.step_until_scheduled("b")
    assert b.num_cached["b"] == 256
    for i, g in enumerate(b.groups):
        if g.kind == "mamba":
            assert b.read_state("b", 0, 256, i) == b.expected_state(prompt[:256], 0, i)
    _assert_groups_exact(b, "b", prompt[:256])
    # a prompt sharing the first 3 chunks: complete there, but no state to resume from
    c = harness(server.address, **kw)
    c.add("c", prompt[:192] + _prompt(6, 100))
    c.step()
    assert c.num_cached["c"] == 0
    c.run_until_done(["c"])
    assert not b.invalid_blocks_seen and not c.invalid_blocks_seen


@pytest.mark.parametrize("mode", list(COPY_MODES))
def test_mamba_without_prefix_caching_loads_the_running_state(
    mode: str, server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    # Nemotron-H on vLLM's CPU build: prefix caching off, mamba_cache_mode "none": one running
    # state block per request; steps of one chunk leave a state at every chunk's end
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    def specs(rank: int) -> dict[str, Any]:
        return {
            "model.layers.0.mixer": MambaSpec(
                block_size=1024,
                shapes=((3, 256), (4, 16, 16)),
                dtypes=(torch.float32, torch.float32),
            ),
            "model.layers.1.self_attn.attn": FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32
            ),
        }

    kw: dict[str, Any] = {
        "specs": specs,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": CHUNK,
    }
    prompt = _prompt(7, 300)
    _store(harness, server.address, prompt, **kw, extra=COPY_MODES[mode])
    b = harness(server.address, **kw, extra=COPY_MODES[mode])
    b.add("b", prompt)
    # the forward pass would advance the one state block past 256
    b.step_until_scheduled("b", forward=False)
    assert b.num_cached["b"] == 256
    assert not b.invalid_blocks_seen
    mamba = next(i for i, g in enumerate(b.groups) if g.kind == "mamba")
    assert b.read_state("b", 0, 256, mamba) == b.expected_state(prompt[:256], 0, mamba)
    _assert_groups_exact(b, "b", prompt[:256])


def test_sliding_window_request_preempted_resumes_from_kvtier(
    server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    b = harness(
        server.address,
        specs=sliding_specs(),
        num_blocks=30,
        max_model_len=300,
        max_num_batched_tokens=CHUNK,
    )
    x, y = _prompt(8, 150), _prompt(9, 130)
    b.add("x", x, max_tokens=120)
    b.add("y", y, max_tokens=50)
    preempted: set[str] = set()
    resumed = []
    for _ in range(800):
        if {"x", "y"} <= set(b.finished):
            break
        out = b.step()
        preempted |= set(out.preempted_req_ids or ())
        for load in out.kv_connector_metadata.loads:
            if load.request_id in preempted:
                resumed.append(load)
                tokens = b.scheduler.requests[load.request_id].all_token_ids[: load.end]
                _assert_groups_exact(b, load.request_id, list(tokens))
    assert preempted, "no request was preempted: shrink num_blocks"
    assert resumed and all(t.end % CHUNK == 0 for t in resumed)
    assert {"x", "y"} <= set(b.finished)
    assert not b.invalid_blocks_seen
    _null_block_untouched(b)


def test_sliding_window_request_aborted_while_its_save_runs(
    server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    from vllm.v1.request import RequestStatus

    prompt = _prompt(10, 300)
    a = harness(server.address, specs=sliding_specs())
    a.add("a", prompt, max_tokens=50)
    try:
        # the server stalls after the lookup: the sliding-window pieces are staged in the
        # step's wait_for_save, the store waits in the saver thread
        a.step(after_schedule=lambda: server.proc.send_signal(signal.SIGSTOP))
        a.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
        a.step()
        assert "a" in a.scheduler.requests, "blocks were freed while their save still ran"
    finally:
        server.proc.send_signal(signal.SIGCONT)

    def freed() -> bool:
        a.step()
        return "a" not in a.scheduler.requests

    wait_for(freed, timeout=5, interval=0.05)
    assert "a" not in a.scheduler.requests, "the save finished but vLLM never got the blocks back"
    b = harness(server.address, specs=sliding_specs())
    b.add("b", prompt)
    b.step_until_scheduled("b")
    assert b.num_cached["b"] == 256
    _assert_groups_exact(b, "b", prompt[:256])
    _null_block_untouched(b)


def test_what_cannot_be_stored_is_refused_at_start(
    server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from kvtier.errors import InvalidArgumentError

    def specs(rank: int) -> dict[str, Any]:
        return {
            "model.layers.0.mixer": MambaSpec(
                block_size=CHUNK,
                shapes=((3, 256),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
                num_speculative_blocks=1,
            ),
            "model.layers.1.self_attn.attn": FullAttentionSpec(
                block_size=CHUNK, num_kv_heads=2, head_size=64, dtype=torch.float32
            ),
        }

    with pytest.raises(InvalidArgumentError, match="speculative"):
        harness(server.address, specs=specs, block_size=CHUNK, mamba_cache_mode="align")
    odd = start_server("--l1-size", "16MiB", "--chunk-size", "48")
    try:
        with pytest.raises(InvalidArgumentError, match="multiple of"):
            harness(odd.address, specs=mamba_specs, block_size=CHUNK, mamba_cache_mode="align")
    finally:
        odd.stop()


def test_pipeline_stages_store_their_own_layers_and_a_hit_needs_every_stage(
    server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    prompt = _prompt(11, 300)
    kw: dict[str, Any] = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}
    _store(harness, server.address, prompt, **kw)
    b = harness(server.address, **kw)
    sides = [w.worker_side for w in b.workers]
    assert [s.worker_id for s in sides] == [0, 1, 2, 3]  # pp_rank * tp + tp_rank
    assert {s.config.world_size for s in sides} == {4}
    assert [b.stage_layers(r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    b.add("b", prompt)
    b.step()
    assert b.num_cached["b"] == 256
    for rank in range(4):
        got = b.read_back("b", rank, 256)
        assert got.numpy().tobytes() == b.expected(prompt[:256], rank).numpy().tobytes()
    b.run_until_done(["b"])
    assert not b.invalid_blocks_seen
    # one stage alone (a TP=2 engine without pipeline stages) never gets these shards
    c = harness(server.address, tensor_parallel_size=2)
    c.add("c", prompt)
    c.step()
    assert c.num_cached["c"] == 0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_server_lost_between_lookup_and_load_of_a_hybrid_model(
    server: ServerProcess, harness: Callable[..., Harness], policy: str
) -> None:
    """vLLM maps failed blocks to requests only for one KV cache group: a hybrid model's load
    is asynchronous, and a failed one is reported by request. Under `fail` that request fails
    and the engine goes on serving; under `recompute` it computes the same tokens."""
    from vllm.v1.engine import FinishReason

    prompt = _prompt(12, 300)
    _store(harness, server.address, prompt, specs=sliding_specs())
    b = harness(server.address, specs=sliding_specs(), kv_load_failure_policy=policy)
    b.add("b", prompt, max_tokens=5)
    # the server dies after the scheduler's lookup, before the workers' load
    out = b.step(after_schedule=lambda: server.stop(signal.SIGKILL))
    assert [(t.start, t.end) for t in out.kv_connector_metadata.loads] == [(0, 256)]
    assert b.failed_loads_seen == {"b"} and not b.invalid_blocks_seen
    other = _prompt(13, 200)
    b.add("c", other, max_tokens=5)
    if policy == "fail":
        b.run_until_done(["b", "c"])
        assert b.finish_reasons["b"] == FinishReason.ERROR  # that request fails ...
        assert b.finish_reasons["c"] != FinishReason.ERROR  # ... and the engine goes on
        assert b.num_cached["c"] == 0
    else:
        b.step_until_scheduled("b")
        assert b.num_cached["b"] == 0  # computed from the start, without kvtier
        _assert_groups_exact(b, "b", prompt)
        b.run_until_done(["b", "c"])
        assert b.finish_reasons["b"] != FinishReason.ERROR
    _null_block_untouched(b)

"""KVTierCache against a real `kvtier serve` subprocess: logits with reused KV must equal a full
recompute, across processes, across a 2-rank head split, and in half precision."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.errors import NotConnectedError
from kvtier.integrations.demo import connect, random_model, serve
from kvtier.integrations.seam import head_range
from kvtier.integrations.transformers import (
    KVGeometry,
    KVTierCache,
    ModelRunner,
    as_token_array,
    cache_to_chunks,
    chunks_to_cache,
    full_prefill,
    merge_heads,
    new_cache,
    split_heads,
)

pytestmark = pytest.mark.transformers

CHUNK = 16
TOL = 1e-4
SRC = str(Path(__file__).resolve().parents[2] / "src")
ARCHS = ["llama", "qwen2"]


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with serve(CHUNK, "64MiB") as addr:
        yield addr


@pytest.fixture
def client(address: str) -> Iterator[Any]:
    c = connect(address)
    yield c
    c.close()


def _prompt(seed: int, n: int, vocab: int = 256) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, vocab, n)


def _name() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


# -- without a server: the cache <-> chunk conversion and partial prefill ------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_round_trip_through_the_model_cache(arch: str) -> None:
    model = random_model(arch)
    _, cache = full_prefill(model, _prompt(0, 3 * CHUNK + 5))
    chunks = cache_to_chunks(cache, 0, 3 * CHUNK, CHUNK)
    geo = KVGeometry.from_model(model)
    assert chunks.shape == (3, *geo.chunk_shape(CHUNK))
    assert chunks.is_contiguous()
    rebuilt = chunks_to_cache(chunks, new_cache(model))
    assert rebuilt.get_seq_length() == 3 * CHUNK
    for layer in range(geo.num_layers):
        for kv, name in enumerate(("keys", "values")):
            original = getattr(cache.layers[layer], name)[:, :, : 3 * CHUNK]
            assert torch.equal(getattr(rebuilt.layers[layer], name), original)
            # token t of chunk n is token n * CHUNK + t, heads on the fourth axis
            assert torch.equal(chunks[1, layer, kv, 2], original[0, :, CHUNK + 2])
    middle = cache_to_chunks(cache, CHUNK, 3 * CHUNK, CHUNK)
    assert torch.equal(middle, chunks[1:])


def test_split_and_merge_heads() -> None:
    model = random_model("llama", num_heads=4, num_kv_heads=4)
    _, cache = full_prefill(model, _prompt(1, 2 * CHUNK))
    chunks = cache_to_chunks(cache, 0, 2 * CHUNK, CHUNK)
    shards = split_heads(chunks, 2)
    assert [s.shape[-2] for s in shards] == [2, 2]
    assert torch.equal(shards[1], cache_to_chunks(cache, 0, 2 * CHUNK, CHUNK, heads=slice(2, 4)))
    assert torch.equal(merge_heads(shards), chunks)
    assert head_range(8, 4, 3) == slice(6, 8)
    with pytest.raises(ValueError, match="world_size=3"):
        head_range(4, 3, 0)
    with pytest.raises(ValueError, match="worker_id=2"):
        head_range(4, 2, 2)


def test_misaligned_ranges_and_bad_prompts_are_refused() -> None:
    model = random_model("llama")
    _, cache = full_prefill(model, _prompt(2, 2 * CHUNK))
    with pytest.raises(ValueError, match="chunk_size=16"):
        cache_to_chunks(cache, 0, CHUNK + 1, CHUNK)
    with pytest.raises(ValueError, match="end=48"):
        cache_to_chunks(cache, 0, 3 * CHUNK, CHUNK)
    with pytest.raises(ValueError, match="empty"):
        as_token_array([])
    with pytest.raises(ValueError, match="one sequence"):
        as_token_array(np.zeros((2, 4), dtype=np.int64))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("reuse", [CHUNK, 2 * CHUNK, 3 * CHUNK])
def test_partial_prefill_on_a_rebuilt_cache_matches_full(arch: str, reuse: int) -> None:
    model = random_model(arch)
    prompt = as_token_array(_prompt(3, 3 * CHUNK + 7))
    ref, cache = full_prefill(model, prompt)
    rebuilt = chunks_to_cache(cache_to_chunks(cache, 0, reuse, CHUNK), new_cache(model))
    logits = ModelRunner(model).forward(prompt[reuse:], reuse, rebuilt)
    torch.testing.assert_close(logits, ref, atol=TOL, rtol=0)


# -- with a real server ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_reused_kv_gives_the_full_recompute_logits(arch: str, client: Any) -> None:
    model = random_model(arch)
    kv = KVTierCache(model, client, _name())
    a = _prompt(10, 4 * CHUNK)
    _, _ = kv.prefill(a)
    assert kv.last_hit_tokens == 0
    cases = [
        (np.concatenate([a[: 3 * CHUNK], _prompt(11, 20)]), 3 * CHUNK),  # shares exactly 3 chunks
        (np.concatenate([a[: 2 * CHUNK + 9], _prompt(12, 13)]), 2 * CHUNK),  # mid-chunk
        (a, 3 * CHUNK),  # all cached: one chunk is recomputed so logits exist
        (np.concatenate([a, _prompt(13, 1)]), 4 * CHUNK),  # all but the last token cached
    ]
    for prompt, expected_hit in cases:
        logits, cache = kv.prefill(prompt)
        assert kv.last_hit_tokens == expected_hit
        assert cache.get_seq_length() == len(prompt)
        assert kv.last_timings["retrieve"] > 0
        ref, _ = full_prefill(model, prompt)
        torch.testing.assert_close(logits, ref, atol=TOL, rtol=0)


def test_salt_and_model_name_isolate(client: Any) -> None:
    model = random_model("llama")
    name = _name()
    KVTierCache(model, client, name, cache_salt="tenant-a").prefill(_prompt(20, 3 * CHUNK))
    other = KVTierCache(model, client, name, cache_salt="tenant-b")
    other.prefill(_prompt(20, 3 * CHUNK))
    assert other.last_hit_tokens == 0
    same = KVTierCache(model, client, name, cache_salt="tenant-a")
    same.prefill(_prompt(20, 3 * CHUNK))
    assert same.last_hit_tokens == 2 * CHUNK


def _greedy_reference(model: Any, prompt: np.ndarray[Any, Any], n: int) -> list[int]:
    seq = [int(t) for t in prompt]
    for _ in range(n):
        logits, _ = full_prefill(model, seq)
        seq.append(int(torch.argmax(logits)))
    return seq


def test_generate_is_greedy_and_stores_generated_chunks(client: Any) -> None:
    model = random_model("llama")
    kv = KVTierCache(model, client, _name(), store_generated=True)
    prompt = _prompt(30, 2 * CHUNK + 10)
    out = kv.generate(prompt, max_new_tokens=12)
    assert out.shape == (1, len(prompt) + 12)
    assert out[0].tolist() == _greedy_reference(model, prompt, 12)
    # the generated tokens completed a third chunk, which the next turn reuses
    follow_up = np.concatenate([out[0].numpy(), _prompt(31, 5)])
    logits, _ = kv.prefill(follow_up)
    assert kv.last_hit_tokens == 3 * CHUNK
    torch.testing.assert_close(logits, full_prefill(model, follow_up)[0], atol=TOL, rtol=0)


_WORKER = textwrap.dedent(
    """
    import sys, json
    import numpy as np, torch
    from kvtier.integrations.demo import connect, random_model, serve
    from kvtier.integrations.transformers import KVTierCache, full_prefill

    role, address, name, arch = sys.argv[1:5]
    rng = np.random.default_rng(40)
    shared = rng.integers(0, 256, 3 * 16 + 4)
    first = np.concatenate([shared, rng.integers(0, 256, 9)])
    second = np.concatenate([shared, rng.integers(0, 256, 11)])
    model = random_model(arch, num_heads=4, num_kv_heads=4)
    client = connect(address)
    if role == "store":
        KVTierCache(model, client, name).prefill(first)
        print(json.dumps({"stored": True}))
    else:
        import torch.distributed as dist
        rank, init = int(sys.argv[5]), sys.argv[6]
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)

        def exchange(t):
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t)
            return parts

        kv = KVTierCache(model, client, name, world_size=2, worker_id=rank, exchange=exchange)
        kv.prefill(first)
        hit_first = kv.last_hit_tokens
        logits, cache = kv.prefill(second)
        ref, _ = full_prefill(model, second)
        err = float((logits - ref).abs().max())
        print(json.dumps({"hit_first": hit_first, "hit": kv.last_hit_tokens, "err": err,
                          "heads": cache.layers[0].keys.shape[1]}))
        dist.destroy_process_group()
    client.close()
    """
)


def _run_workers(tmp_path: Path, argvs: list[list[str]]) -> list[dict[str, Any]]:
    import json

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "PYTHONPATH": SRC}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_a_second_process_reuses_what_the_first_stored(
    address: str, client: Any, tmp_path: Path
) -> None:
    name = _name()
    _run_workers(tmp_path, [["store", address, name, "qwen2"]])
    model = random_model("qwen2", num_heads=4, num_kv_heads=4)
    rng = np.random.default_rng(40)
    shared = rng.integers(0, 256, 3 * CHUNK + 4)
    prompt = np.concatenate([shared, _prompt(41, 6)])
    kv = KVTierCache(model, client, name)
    logits, _ = kv.prefill(prompt)
    assert kv.last_hit_tokens == 3 * CHUNK
    torch.testing.assert_close(logits, full_prefill(model, prompt)[0], atol=TOL, rtol=0)


def test_two_ranks_each_store_and_retrieve_their_heads(address: str, tmp_path: Path) -> None:
    name = _name()
    init = f"file://{tmp_path / 'pg'}"
    results = _run_workers(
        tmp_path, [["tp", address, name, "llama", str(rank), init] for rank in (0, 1)]
    )
    for r in results:
        assert r["hit_first"] == 0
        assert r["hit"] == 3 * CHUNK
        assert r["heads"] == 4  # the cache holds every head, reassembled from both shards
        assert r["err"] <= TOL
    # both ranks' shards are stored: a lookup over the group finds the shared chunks
    rng = np.random.default_rng(40)
    first = np.concatenate([rng.integers(0, 256, 3 * CHUNK + 4), rng.integers(0, 256, 9)])
    with connect(address) as c:
        assert c.lookup("probe", first, model=name, world_size=2) == 3 * CHUNK
        c.end_session("probe")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_round_trip_is_exact(dtype: torch.dtype, client: Any) -> None:
    model = random_model("llama", dtype=dtype)
    name = _name()
    kv = KVTierCache(model, client, name)
    prompt = as_token_array(_prompt(50, 3 * CHUNK + 3))
    _, cache = kv.prefill(prompt)
    stored = cache_to_chunks(cache, 0, 3 * CHUNK, CHUNK)
    assert stored.dtype == dtype
    out = torch.empty_like(stored)
    request = uuid.uuid4().hex
    assert client.lookup(request, prompt, model=name) == 3 * CHUNK
    assert client.retrieve(request, prompt, out, model=name, end=3 * CHUNK) == 3 * CHUNK
    client.end_session(request)
    assert torch.equal(out.view(torch.int16), stored.view(torch.int16))  # bit for bit
    _, reused = kv.prefill(prompt)
    assert kv.last_hit_tokens == 3 * CHUNK
    assert reused.layers[0].keys.dtype == dtype


def test_reuse_after_a_disk_tier_round_trip_and_a_restart(tmp_path: Path) -> None:
    model = random_model("qwen2")
    name = _name()
    disk = ["--l2", f"disk://{tmp_path}/l2?size=64MiB", "--admin-port", "-1"]
    prompt = _prompt(60, 4 * CHUNK + 5)
    with serve(CHUNK, "64MiB", *disk) as addr, connect(addr) as c:
        KVTierCache(model, c, name).prefill(prompt)
    # a new server: its L1 is empty, so every hit below comes back from the disk tier
    with serve(CHUNK, "64MiB", *disk) as addr, connect(addr) as c:
        kv = KVTierCache(model, c, name)
        logits, _ = kv.prefill(prompt)
        assert kv.last_hit_tokens == 4 * CHUNK
        torch.testing.assert_close(logits, full_prefill(model, prompt)[0], atol=TOL, rtol=0)


def test_a_dead_server_costs_a_recompute_not_the_request() -> None:
    model = random_model("llama")
    prompt = _prompt(61, 3 * CHUNK + 3)
    with serve(CHUNK, "64MiB") as addr:
        c = connect(addr)  # 2 s request timeout
        kv = KVTierCache(model, c, _name())
        kv.prefill(prompt)
    try:
        # the server is gone: the lookup times out, the request's other kvtier calls are skipped
        logits, _ = kv.prefill(prompt)
        assert isinstance(kv.last_error, NotConnectedError)
        assert kv.last_hit_tokens == 0
        torch.testing.assert_close(logits, full_prefill(model, prompt)[0], atol=TOL, rtol=0)
        out = kv.generate(prompt, max_new_tokens=3)
        assert out.shape == (1, len(prompt) + 3)
    finally:
        c.close()

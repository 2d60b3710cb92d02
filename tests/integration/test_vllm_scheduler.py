"""KVTierConnector under vLLM's real Scheduler, with worker-role connectors in this process on
CPU tensors shaped like vLLM's paged KV cache (see vllm_harness.py), against a real
`kvtier serve`. A load is checked byte for byte against what a recompute writes."""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit.servers import ServerProcess, start_server
from testkit.vllm_harness import COPY_MODES, Harness
from testkit.waiting import wait_for

pytestmark = pytest.mark.vllm

CHUNK = 64  # kvtier chunk: two vLLM blocks of 32
MODES = COPY_MODES


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    srv = start_server("--l1-size", "64MiB", "--chunk-size", str(CHUNK), "--client-timeout", "5")
    yield srv
    srv.close()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(n)]


def _store(build: Callable[..., Harness], address: str, prompt: list[int], **kw: Any) -> None:
    """Engine A computes `prompt` and saves its full chunks; returns once they are stored."""
    a = build(address, **kw)
    a.add("a", prompt)
    a.run_until_done(["a"])
    a.flush()
    assert a.num_cached["a"] == 0
    a.close()


def _assert_exact(h: Harness, req_id: str, prompt: list[int], rank: int = 0) -> None:
    got = h.read_back(req_id, rank, len(prompt))
    assert got.dtype == h.dtype
    assert got.numpy().tobytes() == h.expected(prompt, rank).numpy().tobytes()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_round_trip_is_byte_exact(
    layout: str, mode: str, server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    prompt = _prompt(1, 300)  # 4 full chunks (256 tokens) and a tail
    _store(harness, server.address, prompt, layout=layout, extra=MODES[mode])
    b = harness(server.address, layout=layout, extra=MODES[mode])
    b.add("b", prompt)
    out = b.step()
    meta = out.kv_connector_metadata
    assert [(t.start, t.end) for t in meta.loads] == [(0, 256)]
    assert b.num_cached["b"] == 256  # loaded, not computed
    assert out.num_scheduled_tokens["b"] == 300 - 256
    _assert_exact(b, "b", prompt)
    b.run_until_done(["b"])
    assert not b.invalid_blocks_seen
    # the overlap figures vLLM's connector stats carry: a whole-request load hides nothing
    stats = b.workers[0].get_kv_connector_stats()
    assert stats is not None
    figures = stats.reduce()
    assert figures["loads"] == 1 and figures["load_copy_ms"] > 0
    if mode == "whole":
        assert figures["load_hidden"] == 0
    # vLLM rebuilds each worker's stats from their data and sums them
    summed = type(b.workers[0]).build_kv_connector_stats(dict(stats.data))
    assert summed is not None and summed.aggregate(stats).reduce()["loads"] == 2
    assert b.workers[0].get_kv_connector_stats() is None  # nothing copied since
    # ... and counts them in its /metrics
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvtier.integrations.vllm.stats import KVTierStats

    registry = CollectorRegistry()
    kinds = {k: functools.partial(k, registry=registry) for k in (Counter, Gauge, Histogram)}
    prom = type(b.workers[0]).build_prom_metrics(
        b.scheduler.vllm_config, kinds, ["engine"], {0: ["0"]}
    )
    prom.observe(stats.data, 0)
    copied = registry.get_sample_value("vllm:kvtier_load_copy_seconds_total", {"engine": "0"})
    waited = registry.get_sample_value("vllm:kvtier_load_waited_seconds_total", {"engine": "0"})
    assert copied == pytest.approx(stats.data["load_copy_s"])
    assert waited == pytest.approx(stats.data["load_exposed_s"])
    # the scheduler counts its lookups and their time; vLLM sums them with the workers' figures
    asked = b.scheduler.connector.scheduler_side.timing.snapshot()
    assert asked["lookups"] == 1 and asked["lookup_s"] > 0
    both = summed.aggregate(KVTierStats(data=asked)).reduce()
    assert both["lookups"] == 1 and both["lookup_ms"] > 0 and both["loads"] == 2
    prom.observe(asked, 0)
    looked = registry.get_sample_value("vllm:kvtier_lookup_seconds_total", {"engine": "0"})
    assert looked == pytest.approx(asked["lookup_s"])


def test_layerwise_wait_returns_once_its_own_layer_is_in_place(
    server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    prompt = _prompt(11, 300)
    _store(harness, server.address, prompt)
    b = harness(server.address, extra={"layerwise": True})
    names = [name for _, _, name in b.forward_layers()]
    first, last = names[0], names[-1]
    worker = b.workers[0]
    release = threading.Event()
    # the loader holds after the first layer is in place, until the test lets it go on
    worker.worker_side.layer_hook = lambda name: name == first and release.wait(30)
    try:
        b.add("b", prompt)
        out = b.scheduler.schedule()
        assert [(t.start, t.end) for t in out.kv_connector_metadata.loads] == [(0, 256)]
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)
        worker.wait_for_layer_load(first)  # returns while the later layer is still pending
        got, want = b.read_back("b", 0, 256), b.expected(prompt[:256], 0)
        assert got[:, 0].numpy().tobytes() == want[:, 0].numpy().tobytes()
        assert got[:, -1].numpy().tobytes() != want[:, -1].numpy().tobytes()
        step = worker.worker_side._step
        assert step is not None and not step.gate.is_open(last)
    finally:
        release.set()
    worker.wait_for_layer_load(last)
    assert b.read_back("b", 0, 256).numpy().tobytes() == want.numpy().tobytes()
    worker.wait_for_save()
    assert not worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()


@pytest.mark.parametrize("mode", list(MODES))
def test_partial_local_prefix_hit_loads_only_the_missing_blocks(
    mode: str, server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    prompt = _prompt(2, 300)
    _store(harness, server.address, prompt, extra=MODES[mode])
    b = harness(server.address, extra=MODES[mode])
    # vLLM's own prefix cache in engine B holds the first 3 blocks (96 tokens) of the prompt
    other = prompt[:96] + _prompt(3, 40)
    b.add("other", other)
    b.run_until_done(["other"])
    b.add("b", prompt)
    out = b.step()
    (load,) = out.kv_connector_metadata.loads
    assert (load.chunk_start, load.start, load.end) == (64, 96, 256)  # mid-chunk start
    assert len(load.block_ids[0]) == (256 - 96) // 32
    assert b.num_cached["b"] == 256
    _assert_exact(b, "b", prompt)


@pytest.mark.parametrize("mode", list(MODES))
def test_preempted_request_resumes_from_kvtier(
    mode: str, server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    # 16 usable blocks of 32 tokens: y (7 blocks) is preempted when x (8 blocks) grows; x then
    # grows over y's freed blocks, so y's prefix is gone from vLLM's cache when it resumes
    b = harness(server.address, num_blocks=17, extra=MODES[mode])
    x, y = _prompt(4, 250), _prompt(5, 200)
    b.add("x", x, max_tokens=200)
    b.add("y", y, max_tokens=60)
    preempted: set[str] = set()
    resumed_loads = []
    for _ in range(600):
        if {"x", "y"} <= set(b.finished):
            break
        out = b.step()
        preempted |= set(out.preempted_req_ids or ())
        for load in out.kv_connector_metadata.loads:
            if load.request_id in preempted:
                resumed_loads.append(load)
                _assert_exact(b, load.request_id, y[: load.end])
    assert preempted == {"y"}, f"expected y to be preempted, got {preempted}"
    # y's 3 stored chunks come back from kvtier (less any leading block vLLM still caches)
    assert [t.end for t in resumed_loads] == [192] and resumed_loads[0].start < 192
    assert {"x", "y"} <= set(b.finished)
    assert not b.invalid_blocks_seen


def test_request_aborted_while_its_save_runs(
    server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    from vllm.v1.request import RequestStatus

    prompt = _prompt(6, 300)
    a = harness(server.address)
    a.add("a", prompt, max_tokens=50)
    try:
        # the server stalls after the lookup: the prefill's 4 chunks wait in the saver thread
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
    # what the aborted request computed is in kvtier
    b = harness(server.address)
    b.add("b", prompt)
    b.step()
    assert b.num_cached["b"] == 256
    _assert_exact(b, "b", prompt)


def test_server_lost_between_lookup_and_load_costs_a_recompute(
    server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    prompt = _prompt(7, 300)
    _store(harness, server.address, prompt)
    b = harness(server.address)
    b.add("b", prompt, max_tokens=20)
    # the server dies after the scheduler's lookup, before the worker's load
    out = b.step(after_schedule=lambda: server.stop(signal.SIGKILL))
    assert [(t.start, t.end) for t in out.kv_connector_metadata.loads] == [(0, 256)]
    assert b.invalid_blocks_seen  # reported to vLLM, which recomputes them
    for _ in range(5):
        b.step()
    _assert_exact(b, "b", prompt)
    # kvtier is back, holding the prompt again: when vLLM asks for this request's hit again
    # (it was preempted: a new scheduling round), the first answer is a miss, without asking
    # the server, so a load that fails again cannot make vLLM loop; the next one looks up
    back = start_server(
        "--l1-size", "64MiB", "--chunk-size", str(CHUNK), address=server.address
    )  # fmt: skip
    try:
        _store(harness, back.address, prompt)
        connector, request = b.scheduler.connector, b.scheduler.requests["b"]
        request.num_preemptions += 1  # as vLLM's preemption counts it
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
        last: list[int | None] = [0]

        def hits() -> bool:
            if last[0] == 0:  # a new round (a miss while the client still re-joins the server)
                request.num_preemptions += 1
            last[0], _ = connector.get_num_new_matched_tokens(request, 0)
            return last[0] == 256

        assert wait_for(hits, timeout=10), f"the hit after the server came back: {last[0]}"
    finally:
        back.close()
    b.run_until_done(["b"])


@pytest.mark.parametrize("mode", list(MODES))
def test_server_lost_between_lookup_and_load_fails_that_request_under_fail(
    mode: str, server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    from vllm.v1.engine import FinishReason

    prompt = _prompt(17, 300)
    _store(harness, server.address, prompt)
    b = harness(server.address, kv_load_failure_policy="fail", extra=MODES[mode])
    b.add("b", prompt, max_tokens=20)
    out = b.step(after_schedule=lambda: server.stop(signal.SIGKILL))
    assert [(t.start, t.end) for t in out.kv_connector_metadata.loads] == [(0, 256)]
    assert b.invalid_blocks_seen
    assert b.finish_reasons["b"] == FinishReason.ERROR  # vLLM's `fail`: that request fails
    # ... and the engine goes on serving: the next request is computed without kvtier
    other = _prompt(18, 200)
    b.add("c", other, max_tokens=5)
    b.step()
    assert b.num_cached["c"] == 0
    _assert_exact(b, "c", other)
    b.run_until_done(["c"])
    assert b.finish_reasons["c"] != FinishReason.ERROR


def test_no_server_at_all_still_serves_requests(
    model_dir: Path, harness: Callable[..., Harness], tmp_path: Path
) -> None:
    b = harness(f"ipc://{tmp_path}/nobody.sock")
    prompt = _prompt(8, 200)
    b.add("b", prompt, max_tokens=5)
    b.step()
    assert b.num_cached["b"] == 0
    _assert_exact(b, "b", prompt)
    b.run_until_done(["b"])


@pytest.mark.parametrize("mode", list(MODES))
def test_two_tensor_parallel_ranks_store_and_load_their_heads(
    mode: str, server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    prompt = _prompt(9, 300)
    _store(harness, server.address, prompt, tensor_parallel_size=2, extra=MODES[mode])
    b = harness(server.address, tensor_parallel_size=2, extra=MODES[mode])
    b.add("b", prompt)
    b.step()
    assert b.num_cached["b"] == 256
    for rank in (0, 1):
        _assert_exact(b, "b", prompt, rank)
    # a TP=1 engine never gets TP=2 shards
    c = harness(server.address)
    c.add("c", prompt)
    c.step()
    assert c.num_cached["c"] == 0


def test_config_is_checked_at_start(
    model_dir: Path, server: ServerProcess, harness: Callable[..., Harness]
) -> None:
    from kvtier.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"unknown key\(s\) \['adress'\]"):
        harness(server.address, extra={"adress": "ipc:///tmp/x.sock"})
    with pytest.raises(InvalidArgumentError, match=r"layerwise='yes' must be true, false"):
        harness(server.address, extra={"layerwise": "yes"})
    # "auto", the default, copies whole requests where the KV cache is on the CPU
    auto = harness(server.address).workers[0].worker_side
    assert auto.config.layerwise == "auto" and auto.layerwise == (auto.layout.device.type == "cuda")
    odd = start_server("--l1-size", "16MiB", "--chunk-size", "48")
    try:
        with pytest.raises(InvalidArgumentError, match="multiple of the engine's block size"):
            harness(odd.address)
    finally:
        odd.stop()

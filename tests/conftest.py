"""Shared fixtures: real `kvtier serve` processes and the real Redis."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

#: the home folder of the user running the tests; tests themselves run with HOME elsewhere
REAL_HOME = os.path.expanduser("~")

REDIS_URL = os.environ.get("KVTIER_TEST_REDIS", "redis://127.0.0.1:6379/0")
REDIS_HINT = (
    "these tests need the Redis at 127.0.0.1:6379; start it with: redis-server --daemonize yes "
    '--bind 127.0.0.1 --port 6379 --save "" --appendonly no'
)


#: Test files whose servers use what a reader's commands use (the README's socket and admin port
#: 8080): under `pytest -n`, one worker runs them one after another.
SHARES_DEFAULTS = ("test_readme.py", "test_deploy.py")

#: Files that start engines, clusters or venvs, slowest first: under `pytest -n` they are handed
#: out first, so that the workers finish together instead of one waiting on a late engine test.
SLOW_FIRST = (
    "test_vllm_hybrid_engines.py",
    "test_traffic.py",
    "test_vllm_engine.py",
    "test_vllm_lora.py",
    "test_packaging.py",
    "test_vllm033.py",
    "SHARES_DEFAULTS",
    "test_demo.py",
    "test_vllm_scheduler.py",
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


class FakeClock:
    """A clock that moves only when the test moves it (`advance`, or set `now`)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


#: the ports `free_port` handed out in this process: the kernel may offer a port it just freed
#: again, and two picks that are used together (a master's RPC and HTTP ports) must differ
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now and that this process has not
    been handed before."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def start_redis(port: int) -> subprocess.Popen[bytes]:
    """A private redis-server on `port` (tests that stop and restart Redis use it)."""
    from .kv_servers import start_kv_server

    return start_kv_server("redis", port)


@dataclass
class ServerProcess:
    """A `kvtier serve` child process and what it printed at start."""

    proc: subprocess.Popen[str]
    address: str
    admin_url: str | None
    args: list[str]
    log: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15.0) -> int:
        """Stop the server (Ctrl-C by default) and return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    @property
    def output(self) -> str:
        return "".join(self.log)

    def close(self) -> None:
        """Stop the server, and remove the shared-memory segment a crash (a test's SIGKILL)
        left behind: a test machine must not fill /dev/shm run after run."""
        self.stop()
        for line in self.log:
            if line.startswith("kvtier: L1 ") and "/dev/shm/" in line:
                segment = line.split("/dev/shm/")[1].split(";")[0].split()[0]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"/dev/shm/{segment}")
                break


def start_server(*args: str, address: str | None = None, timeout: float = 30.0) -> ServerProcess:
    """Start `kvtier serve` in its own process and wait until it says it is ready.

    Without an explicit `--l2`, the server gets none: the embedded default (a disk folder that
    outlives the test) would let one test's chunks leak into another.
    """
    if "--l2" not in args:
        args = (*args, "--l2", "none")
    address = address or f"ipc:///tmp/kvtier-test-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    argv = [
        sys.executable, "-m", "kvtier.cli", "serve", "--address", address,
        "--admin-port", "0", *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    server = ServerProcess(proc, address, None, argv)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        server.log.append(line)
        m = re.match(r"admin: (\S+)", line)
        if m:
            server.admin_url = m.group(1)
        if line.startswith("kvtier: ready"):
            _drain(server)
            return server
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"kvtier serve did not start: {' '.join(argv)}\n{server.output}")


def _drain(server: ServerProcess) -> None:
    """Keep reading the server's output in the background so its pipe never fills."""
    import threading

    def pump() -> None:
        assert server.proc.stdout is not None
        for line in server.proc.stdout:
            server.log.append(line)

    threading.Thread(target=pump, daemon=True).start()


@pytest.fixture
def server_factory() -> Iterator[Callable[..., ServerProcess]]:
    """Start servers with `server_factory(*cli_args)`; all are stopped after the test."""
    started: list[ServerProcess] = []

    def factory(*args: str, address: str | None = None) -> ServerProcess:
        server = start_server(*args, address=address)
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

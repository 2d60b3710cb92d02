"""A real Mooncake Store master on free loopback ports for the tests, with its HTTP metadata
server (tests/integration/conftest.py's `mooncake_master` and `private_mooncake` fixtures start
one with `start_master`); for the benchmarks, a master with Mooncake's default read lease and a
`kvtier serve` holding the pool's segment (`held_pool`), and a tier storing in that pool
(`pooled_tier`).

`--client_ttl=2` makes a dead client's segment (and the objects in it) go in about 1.6 s, and
reads' leases last 0.5 s (`lease_ms`) so a full pool can evict what was just read.
The transfer engine's own ports stay in a window of this test run (`MC_MIN_RPC_PORT`,
`MC_MAX_RPC_PORT`), inherited by the `kvtier serve` processes the tests start.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvtier.storage.tiers import open_tier
from kvtier.storage.tiers.mooncake import MooncakeTier
from testkit.servers import ServerProcess, free_port, start_server

HINT = (
    "the Mooncake tests need mooncake_master and Mooncake's client: pip install "
    "'kvtier[mooncake]' (make install-test does) and apt-get install libibverbs1 (make browser)"
)


def master_binary() -> str:
    """mooncake_master beside this interpreter (the virtualenv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    exe = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if exe is None:
        pytest.fail(HINT, pytrace=False)
    return exe


def _pick_transfer_ports() -> None:
    if "MC_MIN_RPC_PORT" not in os.environ:
        low = random.randrange(31000, 39000, 200)
        os.environ["MC_MIN_RPC_PORT"] = str(low)
        os.environ["MC_MAX_RPC_PORT"] = str(low + 199)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


@dataclass
class MooncakeMaster:
    """One mooncake_master process; `url(...)` is a tier URL for it."""

    rpc_port: int = field(default_factory=free_port)
    metadata_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    #: how long a read's lease keeps an object from removal and eviction (Mooncake's default
    #: is 10 s; tests shorten it so a full pool evicts what was just read)
    lease_ms: int = 500
    proc: subprocess.Popen[bytes] | None = None

    def url(self, **options: str) -> str:
        query = {
            "metadata": f"http://127.0.0.1:{self.metadata_port}/metadata",
            "metrics": f"http://127.0.0.1:{self.metrics_port}",
            "host": "127.0.0.1",
            **options,
        }
        q = "&".join(f"{k}={v}" for k, v in query.items())
        return f"mooncake://127.0.0.1:{self.rpc_port}/?{q}"

    def start(self, timeout: float = 20.0) -> None:
        _pick_transfer_ports()
        self.proc = subprocess.Popen(
            [
                master_binary(), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.metadata_port}",
                "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
                "--client_ttl=2", f"--default_kv_lease_ttl={self.lease_ms}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}")
            try:
                url = f"http://127.0.0.1:{self.metrics_port}/health"
                with urllib.request.urlopen(url, timeout=1) as reply:
                    if b"service_ready" in reply.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"mooncake_master not ready after {timeout} s")

    def kill(self) -> None:
        """SIGKILL the master (a lost machine); `start()` brings it back on the same ports."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP the master: a master that takes calls and never answers them."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def figures(self) -> dict[str, float]:
        """The master's Prometheus gauges and counters (no labels), by name."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as reply:
            text = reply.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name and not name.startswith("#") and "{" not in name:
                out[name] = float(value)
        return out


def start_master() -> MooncakeMaster:
    """A started master; fails the test (never skips it) when none can start."""
    master = MooncakeMaster()
    try:
        master.start()
    except (RuntimeError, OSError) as exc:
        pytest.fail(f"cannot start mooncake_master: {exc}; {HINT}", pytrace=False)
    return master


@contextmanager
def held_pool(segment: str = "1GiB") -> Iterator[MooncakeMaster]:
    """A started master with Mooncake's default read lease (10 s: no test shortcuts) and a
    `kvtier serve` that gives its pool a `segment` segment, until the block exits: a tier opened
    with `pooled_tier` gives the pool no segment, so the objects it stores live in that one."""
    master = MooncakeMaster(lease_ms=10_000)
    master.start()
    holder: ServerProcess | None = None
    try:
        holder = start_server(
            "--admin-port", "-1", "--l1-size", "64MiB", "--l2", master.url(segment=segment)
        )
        yield master
    finally:
        if holder is not None:
            holder.close()
        master.kill()


def pooled_tier(master: MooncakeMaster, memory: memoryview, **options: str) -> MooncakeTier:
    """A Mooncake tier over `master`'s pool that gives it no segment, with `memory` (the one
    mapping a run's buffers live in, as the server's arena is) registered for in-place moves;
    `options` are further tier URL options (prefix, timeout, codec...)."""
    tier = open_tier(master.url(segment="0", **options))
    assert isinstance(tier, MooncakeTier)
    tier.register_memory(memory)
    return tier

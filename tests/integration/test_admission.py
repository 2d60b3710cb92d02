"""Cache admission in a real server: a chunk the policy declined is never announced in KV events
nor written to the L2 disk tier, yet stays readable for the request that stored it, however full
L1 gets; `kvtier serve --policy` refuses an unknown name."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from testkit.kv import CS, SHAPE, kv_for
from testkit.servers import ServerProcess
from testkit.waiting import wait_for

from kvtier.client import Client

from .kv_follower import Follower

CHUNKS = 4


def prompt(i: int) -> list[int]:
    return [(i * 100_003 + t * 7919) % 150_000 for t in range(CHUNKS * CS)]


@pytest.fixture
def events() -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:8]
    paths = [f"/tmp/kvtier-adm-{tag}.pub", f"/tmp/kvtier-adm-{tag}.rep"]
    yield f"ipc://{paths[0]}", f"ipc://{paths[1]}"
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            Path(path).unlink()


def _l2_puts(server: ServerProcess) -> int:
    status = httpx.get(f"{server.admin_url}/status", timeout=10).json()
    return sum(tier["puts"] for tier in status["l2"]["tiers"])


def _announced(follower: Follower, medium: str = "CPU") -> int:
    """Blocks announced stored in `medium` (CPU: L1; STORAGE: the disk tier) so far: the live
    stream, and the publisher's replay buffer for whatever came before the subscription took."""
    follower.poll(0.1)
    follower.replay()
    return sum(len(e.block_hashes) for _, e in follower.stored if e.medium == medium)


def test_a_declined_chunk_is_never_announced_nor_written_to_disk(
    server_factory: Callable[..., ServerProcess], events: tuple[str, str], tmp_path: Path
) -> None:
    pub, rep = events
    server = server_factory(
        "--l1-size", "16MiB", "--chunk-size", str(CS), "--policy", "doorkeeper",
        "--l2", f"disk://{tmp_path}/l2?size=64MiB",
        "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep,
    )  # fmt: skip
    follower = Follower(pub, rep)
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        # first sighting: stored for the request, declined as cache
        assert c.lookup("a", prompt(1), model="m") == 0
        assert c.store("a", prompt(1), kv_for(1, CHUNKS), model="m") == CHUNKS * CS
        assert c.lookup("a", prompt(1), model="m") == CHUNKS * CS  # its own, while it lives
        c.end_session("a")
        assert _announced(follower) == _announced(follower, "STORAGE") == 0
        assert _l2_puts(server) == 0
        # a second request finds them (cold, not gone): now worth keeping, announced once
        assert c.lookup("b", prompt(1), model="m") == CHUNKS * CS
        c.end_session("b")
        assert wait_for(lambda: _announced(follower) >= CHUNKS, 10)
        assert _announced(follower) == CHUNKS  # not twice: the declined store announced none
        assert _l2_puts(server) == 0  # admitted after its store: never written through
        # a prompt two requests looked up before its store is admitted: announced and written
        c.lookup("c", prompt(2), model="m")
        c.end_session("c")
        c.lookup("d", prompt(2), model="m")
        c.store("d", prompt(2), kv_for(2, CHUNKS), model="m")
        c.end_session("d")
        assert wait_for(lambda: _l2_puts(server) == CHUNKS, 10)
        assert wait_for(lambda: _announced(follower) == 2 * CHUNKS, 10)
        assert wait_for(lambda: _announced(follower, "STORAGE") == CHUNKS, 10)
    assert sum(1 for p in (tmp_path / "l2").rglob("*") if p.is_file()) >= CHUNKS


def test_a_requests_own_declined_prefix_stays_readable_under_pressure(
    server_factory: Callable[..., ServerProcess],
) -> None:
    # an L1 of 16 chunks (64 KiB, a chunk a page); the doorkeeper declines every first store
    server = server_factory("--l1-size", "64KiB", "--chunk-size", str(CS), "--policy", "doorkeeper")
    with Client(server.address) as mine, Client(server.address) as other:
        for c in (mine, other):
            c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert mine.lookup("mine", prompt(0), model="m") == 0
        mine.store("mine", prompt(0), kv_for(0, CHUNKS), model="m")
        for i in range(1, 40):  # other traffic fills L1 many times over
            other.lookup(f"o{i}", prompt(i), model="m")
            other.store(f"o{i}", prompt(i), kv_for(i, CHUNKS), model="m")
            other.end_session(f"o{i}")
        assert mine.lookup("mine", prompt(0), model="m") == CHUNKS * CS
        out = np.zeros((CHUNKS, *SHAPE), np.float16)
        assert mine.retrieve("mine", prompt(0), out, model="m") == CHUNKS * CS
        assert np.array_equal(out, kv_for(0, CHUNKS))
        mine.end_session("mine")


def test_serve_refuses_an_unknown_policy() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "serve", "--policy", "bogus", "--l2", "none"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "unknown cache policy 'bogus'" in done.stderr and "adaptive" in done.stderr

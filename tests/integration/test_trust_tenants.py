"""One tenant cannot deny service to another through the server's shared limits.

Each test runs a real `kvtier serve` with a tokens file of two tenants, an honest one (a client
in the test) and a flooding or lying one (client processes of its own), and checks that what the
liar holds stays within its share while the honest tenant's stores and lookups go on.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from testkit.admin import status
from testkit.kv import CS, prompt
from testkit.servers import ServerProcess
from testkit.trust import SPAWN, kv_for, register, reserve, retrieve_lease
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.errors import InvalidArgumentError, KVTierError

HONEST = "honest-tenant-token-0123456789"
LIAR = "lying-tenant-token-0123456789"
SLOT = 16 << 10  # one chunk of SHAPE in float16; a 64 KiB L1 holds four
SMALL = ("--l1-size", "64KiB", "--chunk-size", str(CS), "--reap-interval", "0.2")


@pytest.fixture
def tokens(tmp_path: Path) -> str:
    path = tmp_path / "tokens"
    path.write_text(f"{HONEST} honest\n{LIAR} liar\n")
    return str(path)


def _usage(server: ServerProcess, tenant: str) -> dict[str, int]:
    for row in status(server)["l1"]["tenants"]:
        if row["tenant"] == tenant:
            return row  # type: ignore[no-any-return]
    return {"staging_bytes": 0, "fenced_bytes": 0, "pinned_bytes": 0}


def _store_and_check(c: Client, n: int, num_chunks: int) -> bool:
    """Store prompt n and read it back: True when every chunk came back with its bytes."""
    kv = kv_for(n, num_chunks)
    stored = c.store(f"h{n}", prompt(n, num_chunks), kv, model="m")
    out = np.zeros_like(kv)
    got = c.retrieve(f"hr{n}", prompt(n, num_chunks), out, model="m")
    return stored == got == num_chunks * CS and bool(np.array_equal(out, kv))


def _reserver(address: str, token: str, prompts: list[int], queue: Any) -> None:
    """The liar: reserve two-chunk prompts one after the other and never commit, saying what
    each reserve got; then stay (heartbeating, unless the test stops this process)."""
    try:
        with Client(address, token=token, timeout=10) as c:
            register(c)
            for n in prompts:
                try:
                    reply = reserve(c, f"l{n}", prompt(n, 2))
                    queue.put(("reserved", len([o for o in reply.offsets if o >= 0])))
                except KVTierError as exc:
                    queue.put(("refused", type(exc).__name__, exc.message))
            time.sleep(600)  # on purpose: hold what it got until the test kills it
    except Exception as exc:
        queue.put(("error", repr(exc)))


@pytest.fixture
def processes() -> Iterator[list[Any]]:
    """Liar processes started by a test; resumed and killed after it."""
    started: list[Any] = []
    yield started
    for proc in started:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.join(10)


def test_a_tenants_quarantine_is_bounded_and_never_blocks_another_tenant(
    server_factory: Callable[..., ServerProcess], tokens: str, processes: list[Any]
) -> None:
    """The liar's client reserves half the L1 and is stopped (SIGSTOP) for good: swept, its
    slots stay quarantined while its process lives. A second liar client's reserve gets
    NO_SPACE naming the quarantine share; the honest tenant still stores into the rest."""
    server = server_factory(
        *SMALL, "--staging-lease", "2", "--client-timeout", "2", "--auth-tokens-file", tokens
    )
    queue = SPAWN.Queue()
    first = SPAWN.Process(target=_reserver, args=(server.address, LIAR, [1], queue))
    first.start()
    processes.append(first)
    assert queue.get(timeout=60) == ("reserved", 2)
    os.kill(first.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    assert wait_for(lambda: status(server)["fencing"]["fenced_slots"] == 2, timeout=20)

    # a queue of its own: the stopped process may have stopped holding the first one's lock
    queue2 = SPAWN.Queue()
    second = SPAWN.Process(target=_reserver, args=(server.address, LIAR, [2], queue2))
    second.start()
    processes.append(second)
    got = queue2.get(timeout=60)
    if got[0] == "reserved":  # unbounded: the liar quarantines the whole L1
        os.kill(second.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        wait_for(lambda: status(server)["fencing"]["fenced_slots"] == 4, timeout=20)

    with Client(server.address, token=HONEST) as honest:
        register(honest)
        assert _store_and_check(honest, 5, 2)  # the half the liar cannot take
        assert _store_and_check(honest, 6, 2)  # again: its own chunks are evicted for it
    assert got[:2] == ("refused", "NoSpaceError")
    assert "--tenant-quarantine-share" in got[2] and "32768 bytes quarantined" in got[2]
    assert _usage(server, "liar")["fenced_bytes"] == 2 * SLOT
    assert server.admin_url is not None
    metrics = httpx.get(server.admin_url + "/metrics", timeout=5).text
    assert 'kvtier_tenant_l1_bytes{kind="quarantined",tenant="liar"} 32768.0' in metrics
    os.kill(first.pid, signal.SIGKILL)  # type: ignore[arg-type]  # the pidfd ends the quarantine
    assert wait_for(lambda: _usage(server, "liar")["fenced_bytes"] == 0, timeout=10)


def test_a_tenants_staging_is_bounded_by_its_share(
    server_factory: Callable[..., ServerProcess], tokens: str, processes: list[Any]
) -> None:
    """The liar reserves and holds staging slots (heartbeating, never committing): past half
    the L1 its reserve gets NO_SPACE naming the staging share, and the honest tenant stores."""
    server = server_factory(*SMALL, "--staging-lease", "60", "--auth-tokens-file", tokens)
    queue = SPAWN.Queue()
    liar = SPAWN.Process(target=_reserver, args=(server.address, LIAR, [1, 2], queue))
    liar.start()
    processes.append(liar)
    first, second = queue.get(timeout=60), queue.get(timeout=60)
    assert first == ("reserved", 2)
    with Client(server.address, token=HONEST) as honest:
        register(honest)
        assert _store_and_check(honest, 5, 2)
    assert second[:2] == ("refused", "NoSpaceError") and "--tenant-staging-share" in second[2]
    assert _usage(server, "liar")["staging_bytes"] == 2 * SLOT


def _reader(address: str, token: str, n: int, queue: Any) -> None:
    """The liar: store a two-chunk prompt, take a retrieve lease on it and never say done."""
    try:
        with Client(address, token=token, timeout=10) as c:
            register(c)
            c.store(f"s{n}", prompt(n, 2), kv_for(n, 2), model="m")
            queue.put(retrieve_lease(c, f"r{n}", prompt(n, 2)).num_chunks)
            time.sleep(600)  # on purpose: hold what it got until the test kills it
    except Exception as exc:
        queue.put(("error", repr(exc)))


def test_a_tenants_retrieve_leases_hold_at_most_its_quarantine_share(
    server_factory: Callable[..., ServerProcess], tokens: str, processes: list[Any]
) -> None:
    """A reader stopped mid-copy keeps its chunks held (never evicted) while its process lives.
    The liar's readers hold at most the quarantine share: a second one is handed no slots, and
    the honest tenant's stores evict the liar's other chunks."""
    server = server_factory(
        *SMALL, "--staging-lease", "2", "--client-timeout", "2", "--auth-tokens-file", tokens
    )
    readers = []
    for n in (1, 2):
        queue = SPAWN.Queue()
        reader = SPAWN.Process(target=_reader, args=(server.address, LIAR, n, queue))
        reader.start()
        processes.append(reader)
        readers.append(queue.get(timeout=60))
        if readers[-1]:
            os.kill(reader.pid, signal.SIGSTOP)  # type: ignore[arg-type]
            assert wait_for(lambda n=n: status(server)["fencing"]["lapsed"] == n, timeout=20)
    with Client(server.address, token=HONEST) as honest:
        register(honest)
        assert _store_and_check(honest, 5, 2)
    assert readers == [2, 0]


def _pinner(address: str, token: str, queue: Any) -> None:
    """The liar: store four one-chunk prompts, look each up (pinning it), then stay."""
    try:
        with Client(address, token=token, timeout=10) as c:
            register(c)
            for n in range(1, 5):
                c.store(f"s{n}", prompt(n), kv_for(n), model="m")
            queue.put([c.lookup(f"pin{n}", prompt(n), model="m") for n in range(1, 5)])
            time.sleep(600)  # on purpose: hold what it got until the test kills it
    except Exception as exc:
        queue.put(("error", repr(exc)))


def test_a_tenants_pins_hold_at_most_its_share(
    server_factory: Callable[..., ServerProcess], tokens: str, processes: list[Any]
) -> None:
    """The liar pins all four slots of the L1 for the pin lease (60 s). Its pins stop at half:
    the lookups past it are misses, and the honest tenant's store evicts the rest."""
    server = server_factory(*SMALL, "--auth-tokens-file", tokens)
    queue = SPAWN.Queue()
    liar = SPAWN.Process(target=_pinner, args=(server.address, LIAR, queue))
    liar.start()
    processes.append(liar)
    hits = queue.get(timeout=60)
    with Client(server.address, token=HONEST) as honest:
        register(honest)
        assert _store_and_check(honest, 5, 2)
    assert hits == [CS, CS, 0, 0]
    assert _usage(server, "liar")["pinned_bytes"] == 2 * SLOT


def _looker(address: str, token: str, queue: Any) -> None:
    """The liar: four non-blocking lookups of prompts whose loads hang on a silent tier."""
    try:
        with Client(address, token=token, timeout=30) as c:
            register(c)
            handles = [c.lookup(f"l{n}", prompt(10 + n), model="m", wait=False) for n in range(4)]
            queue.put("looked")
            queue.put([h.result(timeout=60) for h in handles])
            time.sleep(600)  # on purpose: hold what it got until the test kills it
    except Exception as exc:
        queue.put(("error", repr(exc)))


@pytest.fixture
def silent_tier() -> Iterator[str]:
    """A Redis URL whose server accepts connections and never answers: reads hang 3 s."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        port = listener.getsockname()[1]
        yield f"redis://127.0.0.1:{port}/0?timeout=3&cooldown=0"


def test_a_tenants_lookups_take_at_most_its_share_of_prefetch_jobs(
    server_factory: Callable[..., ServerProcess],
    tokens: str,
    processes: list[Any],
    tmp_path: Path,
    silent_tier: str,
) -> None:
    """The liar's lookups start loads that hang (a silent L2 tier), so they hold prefetch
    jobs. With two jobs and a share of one, the honest tenant's lookup still gets a job and
    loads its chunk from the disk tier."""
    disk = f"disk://{tmp_path}/l2?size=16MiB"
    first = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS), "--l2", disk,
                           "--auth-tokens-file", tokens)  # fmt: skip
    with Client(first.address, token=HONEST) as honest:
        register(honest)
        assert honest.store("h", prompt(7), kv_for(7), model="m") == CS
    assert first.stop() == 0  # flushes the write-through: prompt 7 is on disk, not in L1

    server = server_factory(
        "--l1-size", "1MiB", "--chunk-size", str(CS), "--l2", disk, "--l2", silent_tier,
        "--max-prefetch-jobs", "2", "--auth-tokens-file", tokens,
    )  # fmt: skip
    queue = SPAWN.Queue()
    liar = SPAWN.Process(target=_looker, args=(server.address, LIAR, queue))
    liar.start()
    processes.append(liar)
    assert queue.get(timeout=60) == "looked"
    with Client(server.address, token=HONEST) as honest:
        register(honest)
        assert honest.lookup("h", prompt(7), model="m") == CS
        out = np.zeros_like(kv_for(7))
        assert honest.retrieve("h", prompt(7), out, model="m") == CS
        assert np.array_equal(out, kv_for(7))
    assert queue.get(timeout=60) == [0, 0, 0, 0]  # its loads found nothing


def test_one_lookup_cannot_ask_the_tiers_about_millions_of_shards(
    server_factory: Callable[..., ServerProcess], tokens: str, tmp_path: Path
) -> None:
    """A 1M-token lookup at world size 1024 is 4096 chunks x 1024 ranks = 4M tier lookups.
    The default --max-lookup-shards refuses it with a typed error naming the bound, before
    any work; a lookup within the bound is answered."""
    server = server_factory("--l2", f"disk://{tmp_path}/l2?size=16MiB",
                            "--auth-tokens-file", tokens)  # fmt: skip
    with Client(server.address, token=HONEST) as c:
        c.register(model="m", world_size=1024, chunk_shape=(1, 2, 256, 1, 8), dtype="float16")
        started = time.monotonic()
        with pytest.raises(InvalidArgumentError, match="--max-lookup-shards") as info:
            c.lookup("big", list(range(1 << 20)), model="m", world_size=1024)
        assert time.monotonic() - started < 5
        assert "4194304 shards" in info.value.message and "262144" in info.value.message
        with pytest.raises(InvalidArgumentError, match="--max-lookup-shards"):
            c.exists_keys([f"k{i}" for i in range(300)], model="m", world_size=1024)
        assert c.lookup("ok", list(range(256 * 256)), model="m", world_size=1024) == 0
    assert status(server)["prefetch"]["started"] == 1  # only the lookup within the bound


def test_shares_leave_a_lone_tenant_the_whole_l1_when_it_commits(
    server_factory: Callable[..., ServerProcess], tokens: str
) -> None:
    """The shares bound what a tenant holds uncommitted or pinned, not what it stores: one
    tenant storing chunk by chunk fills the whole L1."""
    server = server_factory(*SMALL, "--auth-tokens-file", tokens)
    with Client(server.address, token=HONEST) as honest:
        register(honest)
        for n in range(1, 5):
            assert honest.store(f"s{n}", prompt(n), kv_for(n), model="m") == CS
        assert status(server)["l1"]["used_bytes"] == 4 * SLOT
        assert all(honest.lookup(f"l{n}", prompt(n), model="m") == CS for n in (1, 2))

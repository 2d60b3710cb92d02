"""The client API connectors use, against real servers: a non-blocking lookup that loads from
the disk tier, the slot API on both byte paths, lapsed leases, fail-fast connects and goodbye."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtier import protocol as p
from kvtier.client import Client, LookupHandle
from kvtier.errors import InvalidArgumentError, LeaseExpiredError, NotConnectedError

from ..conftest import ServerProcess, free_port
from .test_serve import CS, SHAPE, kv_for, status, wait_for
from .test_tiers import written

NBYTES = int(np.prod(SHAPE)) * 2  # float16


def test_a_lookup_that_loads_from_disk_is_polled_to_completion(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    disk = f"disk://{tmp_path}/l2?size=64MiB"
    tokens = list(range(8 * CS))
    kv = kv_for(31, 8)
    first = server_factory("--chunk-size", str(CS), "--l2", disk)
    with Client(first.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.store("w", tokens, kv, model="m") == 8 * CS
        assert wait_for(lambda: written(first, 8))
    first.stop()
    second = server_factory("--chunk-size", str(CS), "--l2", disk)
    with Client(second.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        handle = c.lookup("r", tokens, model="m", wait=False)
        assert isinstance(handle, LookupHandle)
        # nothing is in L1: the answer came at once, before the loads ran on the server
        assert "pending" in repr(handle)
        assert handle.result(timeout=20) == 8 * CS
        assert handle.poll() == 8 * CS  # known now: no further round trip
        out = np.zeros_like(kv)
        assert c.retrieve("r", tokens, out, model="m") == 8 * CS
        assert np.array_equal(out, kv)
        # everything is in L1 now: a non-blocking lookup answers with the hit at once
        again = c.lookup("r2", tokens, model="m", wait=False)
        assert "hit_tokens=128" in repr(again) and again.poll() == 8 * CS
        c.end_session("r2")
    st = status(second)
    assert st["prefetch"]["started"] == 1 and st["prefetch"]["loaded_groups"] == 8
    assert st["l1"]["pinned_groups"] == 0  # retrieved or ended: no pins left


def test_a_blocking_lookup_waits_for_its_loads_and_polls_need_a_lookup(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    disk = f"disk://{tmp_path}/l2?size=64MiB"
    tokens = list(range(4 * CS))
    first = server_factory("--chunk-size", str(CS), "--l2", disk)
    with Client(first.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.store("w", tokens, kv_for(32, 4), model="m")
        assert wait_for(lambda: written(first, 4))
    first.stop()
    second = server_factory("--chunk-size", str(CS), "--l2", disk)
    with Client(second.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.lookup("r", tokens, model="m") == 4 * CS
        with pytest.raises(InvalidArgumentError, match="send a Lookup first"):
            c._call(p.LookupPoll("never-looked-up"))


@pytest.mark.parametrize("transfer", ["shm", "inline"])
def test_slots_round_trip(server: ServerProcess, transfer: str) -> None:
    tokens = list(range(1000, 1000 + 4 * CS))
    kv = kv_for(33, 4)
    rows = kv.reshape(4, -1).view(np.uint8)
    with Client(server.address, transfer=transfer) as c:  # type: ignore[arg-type]
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.store("a", tokens[: 2 * CS], kv[:2], model="m")  # chunks 0-1 are stored already
        common = {"model": "m", "chunk_shape": SHAPE, "dtype": "float16"}
        with c.store_slots("s", tokens, end=4 * CS, **common) as slots:  # type: ignore[arg-type]
            listed = [i for i, _ in slots.targets()]
            for i, view in slots.targets():
                assert view.nbytes == NBYTES and view.flags.writeable
                view[:] = rows[i]
        assert listed == ([2, 3] if transfer == "shm" else [0, 1, 2, 3])
        assert slots.stored_tokens == 4 * CS
        assert c.lookup("r", tokens, model="m") == 4 * CS
        with c.retrieve_slots("r", tokens, end=4 * CS, **common) as got:  # type: ignore[arg-type]
            assert got.num_chunks == 4 and got.chunk_nbytes == NBYTES
            for i, view in enumerate(got.views):
                assert not view.flags.writeable
                assert np.array_equal(view, rows[i])
        # store() and retrieve() are built on them and keep their meaning
        out = np.zeros_like(kv)
        assert c.retrieve("r2", tokens, out, model="m") == 4 * CS
        assert np.array_equal(out, kv)


def test_an_exception_in_store_slots_stores_nothing(server: ServerProcess) -> None:
    tokens = list(range(2000, 2000 + 2 * CS))
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        with (
            pytest.raises(RuntimeError, match="engine failed"),
            c.store_slots(
                "s", tokens, model="m", end=2 * CS, chunk_shape=SHAPE, dtype="float16"
            ) as slots,
        ):
            for _, view in slots.targets():
                view[:] = 7
            raise RuntimeError("engine failed mid-copy")
        assert c.lookup("r", tokens, model="m") == 0
    assert status(server)["l1"]["staging_shards"] == 0


def test_lapsed_leases_raise_lease_expired(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory(
        "--chunk-size", str(CS), "--staging-lease", "1", "--reap-interval", "0.1"
    )
    tokens = list(range(3000, 3000 + 2 * CS))
    common = {"model": "m", "chunk_shape": SHAPE, "dtype": "float16"}
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        slots = c.store_slots("s", tokens, end=2 * CS, **common)  # type: ignore[arg-type]
        for _, view in slots.targets():
            view[:] = 1
        time.sleep(1.6)  # past the staging lease: the reaper took the slots back
        with pytest.raises(LeaseExpiredError, match="expired"):
            slots.commit()
        assert c.lookup("r", tokens, model="m") == 0  # nothing of it is stored
        c.store("s2", tokens, kv_for(34, 2), model="m")
        got = c.retrieve_slots("r", tokens, end=2 * CS, **common)  # type: ignore[arg-type]
        assert got.num_chunks == 2
        time.sleep(1.6)
        with pytest.raises(LeaseExpiredError):
            got.done()


def test_the_client_fails_fast_with_typed_errors(server: ServerProcess) -> None:
    t0 = time.monotonic()
    with pytest.raises(NotConnectedError, match="running") as info:
        Client(f"ipc:///tmp/kvtier-nobody-{free_port()}.sock")
    assert type(info.value) is NotConnectedError  # not a private subclass
    assert time.monotonic() - t0 < 3.5  # the 2 s connect timeout, not the 30 s request one
    with pytest.raises(NotConnectedError):
        Client(f"ipc:///tmp/kvtier-nobody-{free_port()}.sock", connect_timeout=0.2)
    with pytest.raises(InvalidArgumentError, match="needs a scheme"):
        Client("/tmp/kvtier.sock")
    c = Client(server.address)
    c.close()
    with pytest.raises(NotConnectedError, match="closed"):
        c.lookup("r", [1, 2, 3], model="m")


def test_close_says_goodbye_and_the_log_tells_it_from_a_lost_client(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory("--chunk-size", str(CS), "--client-timeout", "1")
    polite = Client(server.address)
    polite.register(model="m", chunk_shape=SHAPE, dtype="float16")
    polite.close()
    assert wait_for(lambda: f"client {polite.client_id} closed" in server.output, timeout=5)
    assert status(server)["clients"] == []  # forgotten at once, not after --client-timeout
    lost = Client(server.address, heartbeat_interval=100)  # stops heartbeating right away
    assert wait_for(
        lambda: f"client {lost.client_id} stopped heartbeating" in server.output, timeout=10
    )
    lost._unreachable_since = time.monotonic()  # skip the goodbye: the server forgot it
    lost.close()
    assert f"client {polite.client_id} stopped heartbeating" not in server.output

"""The client API connectors use, against real servers: a non-blocking lookup that loads from
the disk tier (and one that waits on a stalled L2), the slot API on both byte paths (and across
a restart to an arena it cannot map), lapsed leases, fail-fast connects and goodbye."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from testkit.admin import metric_samples, status, written
from testkit.kv import CS, SHAPE, SlotArgs, SlotRangeArgs, kv_for
from testkit.servers import ServerProcess, free_port, start_redis
from testkit.waiting import wait_for

from kvtier import protocol as p
from kvtier.client import ChunkRange, Client, LookupHandle
from kvtier.errors import BadArrayError, InvalidArgumentError, LeaseExpiredError, NotConnectedError
from kvtier.integrations.seam import Recompute

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
            c.connection.call(p.LookupPoll("never-looked-up"))


@pytest.mark.parametrize("transfer", ["shm", "inline"])
def test_slots_round_trip(server: ServerProcess, transfer: str) -> None:
    tokens = list(range(1000, 1000 + 4 * CS))
    kv = kv_for(33, 4)
    rows = kv.reshape(4, -1).view(np.uint8)
    with Client(server.address, transfer=transfer) as c:  # type: ignore[arg-type]
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.store("a", tokens[: 2 * CS], kv[:2], model="m")  # chunks 0-1 are stored already
        common: SlotArgs = {"model": "m", "chunk_shape": SHAPE, "dtype": "float16"}
        with c.store_slots("s", tokens, end=4 * CS, **common) as slots:
            listed = [i for i, _ in slots.targets()]
            for i, view in slots.targets():
                assert view.nbytes == NBYTES and view.flags.writeable
                view[:] = rows[i]
        assert listed == ([2, 3] if transfer == "shm" else [0, 1, 2, 3])
        assert slots.stored_tokens == 4 * CS
        assert c.lookup("r", tokens, model="m") == 4 * CS
        with c.retrieve_slots("r", tokens, end=4 * CS, **common) as got:
            assert got.num_chunks == 4 and got.chunk_nbytes == NBYTES
            for i, view in enumerate(got.views):
                assert not view.flags.writeable
                assert np.array_equal(view, rows[i])
        # store() and retrieve() are built on them and keep their meaning
        out = np.zeros_like(kv)
        assert c.retrieve("r2", tokens, out, model="m") == 4 * CS
        assert np.array_equal(out, kv)


def test_a_chunk_range_names_what_the_keywords_name(server: ServerProcess) -> None:
    tokens = list(range(1500, 1500 + 4 * CS))
    kv = kv_for(34, 4)
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        head = ChunkRange("w", tokens, model="m", end=2 * CS)
        assert c.store(head, kv[:2]) == 2 * CS
        tail = ChunkRange("w", tokens, model="m", start=2 * CS, end=4 * CS)
        with c.store_slots(tail, chunk_shape=SHAPE, dtype="float16") as slots:
            for i, view in slots.targets():
                view[:] = kv[2 + i].reshape(-1).view(np.uint8)
        assert c.lookup("r", tokens, model="m") == 4 * CS
        out = np.zeros_like(kv)
        assert c.retrieve(ChunkRange("r", tokens, model="m"), out) == 4 * CS
        assert np.array_equal(out, kv)
        with c.retrieve_slots(tail, chunk_shape=SHAPE, dtype="float16") as got:
            assert got.num_chunks == 2
        with pytest.raises(InvalidArgumentError, match="set them on the range"):
            c.store(head, kv[:2], model="m")  # type: ignore[call-overload]
        with pytest.raises(InvalidArgumentError, match="needs the range's end"):
            c.retrieve_slots(ChunkRange("r", tokens, model="m"), chunk_shape=SHAPE, dtype="f2")


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


def lapsed(server: ServerProcess) -> int:
    """Reservations and retrieve leases that lapsed and wait for their owner's answer."""
    return int(status(server)["fencing"]["lapsed"])


def staging(server: ServerProcess) -> int:
    return int(status(server)["l1"]["staging_shards"])


def test_lapsed_leases_raise_lease_expired(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory(
        "--chunk-size", str(CS), "--staging-lease", "1", "--reap-interval", "0.1"
    )
    tokens = list(range(3000, 3000 + 2 * CS))
    common: SlotArgs = {"model": "m", "chunk_shape": SHAPE, "dtype": "float16"}
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        slots = c.store_slots("s", tokens, end=2 * CS, **common)
        for _, view in slots.targets():
            view[:] = 1
        # past the staging lease: the reaper took the slots back (fenced until acknowledged)
        assert wait_for(lambda: lapsed(server) == 1 and staging(server) == 0, timeout=10)
        with pytest.raises(LeaseExpiredError, match="expired"):
            slots.commit()
        assert c.lookup("r", tokens, model="m") == 0  # nothing of it is stored
        c.store("s2", tokens, kv_for(34, 2), model="m")
        got = c.retrieve_slots("r", tokens, end=2 * CS, **common)
        assert got.num_chunks == 2
        assert wait_for(lambda: lapsed(server) == 1, timeout=10)  # the retrieve lease lapsed
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
    lost.connection._unreachable_since = time.monotonic()  # skip the goodbye: the server forgot it
    lost.close()
    assert f"client {polite.client_id} stopped heartbeating" not in server.output


def _lookup_polls(server: ServerProcess) -> float:
    """LookupPoll requests the server answered, from its /metrics."""
    assert server.admin_url is not None
    got = metric_samples(httpx.get(server.admin_url + "/metrics", timeout=5).text)
    return got.get(("kvtier_requests_total", (("operation", "lookup"), ("step", "poll"))), 0.0)


def test_result_waits_on_the_server_with_one_request_and_poll_never_waits(
    server_factory: Callable[..., ServerProcess],
) -> None:
    port = free_port()
    stalled = start_redis(port)  # a real Redis that the test stops: each L2 read waits 2 s
    try:
        l2 = f"redis://127.0.0.1:{port}/0?prefix=kvtier-wait-{uuid.uuid4().hex[:8]}"
        server = server_factory("--chunk-size", str(CS), "--l2", f"{l2}&timeout=2&cooldown=0")
        tokens = list(range(6000, 6000 + 4 * CS))
        with Client(server.address) as c:
            c.register(model="m", chunk_shape=SHAPE, dtype="float16")
            stalled.send_signal(signal.SIGSTOP)
            handle = c.lookup("r", tokens, model="m", wait=False)
            t0 = time.monotonic()
            assert handle.poll() is None  # still loading: poll answers at once
            assert time.monotonic() - t0 < 1.0
            assert handle.result(timeout=30) == 0  # the stalled L2 loaded nothing
            assert time.monotonic() - t0 >= 1.0  # it waited for the loads to end
            stalled.send_signal(signal.SIGCONT)  # /metrics asks the tier for its figures
            assert _lookup_polls(server) == 2  # poll() and one waiting request: no polling
            # a timeout bounds the wait, and leaves the client usable (not "unreachable")
            stalled.send_signal(signal.SIGSTOP)
            other = c.lookup("r2", tokens, model="m", wait=False)
            t0 = time.monotonic()
            with pytest.raises(NotConnectedError, match="still loading"):
                other.result(timeout=0.3)
            assert time.monotonic() - t0 < 1.5
            c.release("r")
            assert other.result(timeout=30) == 0
    finally:
        stalled.send_signal(signal.SIGCONT)
        stalled.kill()
        stalled.wait()


def _restart(old: ServerProcess, factory: Callable[..., ServerProcess]) -> ServerProcess:
    """The server again at the same address, with its arena's name gone from /dev/shm: a
    client on this machine can no longer map it (as when the new server runs in a container
    with its own /dev/shm), so it moves bytes inline from its re-join on."""
    old.stop()
    new = factory("--chunk-size", str(CS), address=old.address)
    segment = next(line for line in new.log if "/dev/shm/" in line)
    os.unlink("/dev/shm/" + segment.split("/dev/shm/")[1].split(";")[0].strip())
    return new


def test_slots_that_rejoin_a_server_whose_arena_cannot_be_mapped_fail_typed(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    tokens = list(range(7000, 7000 + 2 * CS))
    kv = kv_for(36, 2)
    common: SlotArgs = {"model": "m", "chunk_shape": SHAPE, "dtype": "float16"}
    first = server_factory("--chunk-size", str(CS), address=f"ipc://{tmp_path}/kvtier.sock")
    # no heartbeats: the requests themselves meet each restarted server
    with Client(first.address, heartbeat_interval=3600) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        assert c.transfer == "shm"
        second = _restart(first, server_factory)
        recompute = Recompute("test")  # what every engine adapter runs its kvtier calls under
        assert recompute.call("store", -1, c.store, "w", tokens, kv, model="m") == -1
        assert isinstance(recompute.last_error, NotConnectedError)
        assert "cannot map" in recompute.last_error.message
        assert c.transfer == "inline"
        assert status(second)["l1"]["staging_shards"] == 0  # the reservation was given back
        assert c.store("w", tokens, kv, model="m") == 2 * CS  # inline from now on
        second.stop()
        third = server_factory("--chunk-size", str(CS), address=first.address)
        assert c.lookup("r", tokens, model="m") == 0  # re-joined: this arena maps again
        assert c.transfer == "shm"
        c.store("w", tokens, kv, model="m")
        _restart(third, server_factory)
        with pytest.raises(NotConnectedError, match="cannot map"):
            c.retrieve_slots("r", tokens, end=2 * CS, **common)
        out = np.zeros_like(kv)
        assert c.retrieve("r", tokens, out, model="m") == 0  # inline again; nothing stored here


def test_a_lookup_for_two_readers_of_one_shard_holds_its_pin_until_both_retrieved(
    server: ServerProcess,
) -> None:
    # MLA: one shard per chunk (world_size 1), retrieved by every TP rank under one pin.
    tokens = list(range(8000, 8000 + 3 * CS))
    kv = kv_for(37, 3)
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        c.store("w", tokens, kv, model="m")
        assert c.lookup("r", tokens, model="m", readers=2) == 3 * CS
        assert status(server)["l1"]["pinned_groups"] == 3
        for reader in (0, 1):
            assert status(server)["l1"]["pinned_groups"] == 3  # still held for this reader
            out = np.zeros_like(kv)
            assert c.retrieve("r", tokens, out, model="m", reader=reader) == 3 * CS
            assert np.array_equal(out, kv)
        assert status(server)["l1"]["pinned_groups"] == 0  # both read: released
        # the slot API names its reader the same way, and a repeated reader does not count twice
        assert c.lookup("r", tokens, model="m", readers=2) == 3 * CS
        common: SlotRangeArgs = {
            "model": "m",
            "chunk_shape": SHAPE,
            "dtype": "float16",
            "end": 3 * CS,
        }
        for _ in range(2):
            with c.retrieve_slots("r", tokens, reader=1, **common) as got:
                assert got.num_chunks == 3
        assert status(server)["l1"]["pinned_groups"] == 3
        with pytest.raises(InvalidArgumentError, match=r"outside range\(readers=2\)"):
            c.retrieve("r", tokens, np.zeros_like(kv), model="m", reader=2)
        with c.retrieve_slots("r", tokens, reader=0, **common) as got:
            assert got.num_chunks == 3
        assert status(server)["l1"]["pinned_groups"] == 0
        # without readers, world_size ranks: the one rank's retrieve releases the pin
        assert c.lookup("r", tokens, model="m") == 3 * CS
        c.retrieve("r", tokens, np.zeros_like(kv), model="m")
        assert status(server)["l1"]["pinned_groups"] == 0
        for bad in ({"readers": -1}, {"readers": 1 << 20}):
            with pytest.raises(InvalidArgumentError, match="readers"):
                c.lookup("r", tokens, model="m", **bad)  # type: ignore[call-overload]
        for reader in (-2, 1 << 20):
            with pytest.raises(InvalidArgumentError, match="reader"):
                c.retrieve("r", tokens, np.zeros_like(kv), model="m", reader=reader)


def test_a_hit_ends_at_the_last_resume_point_of_the_stored_chunks(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    # Two ranks; chunk 3 of rank 1 and chunk 4 of rank 0 are no resume points (a Mamba state
    # the engine did not materialize there): the group is one only when every shard is.
    disk = f"disk://{tmp_path}/l2?size=64MiB"
    tokens = list(range(9000, 9000 + 6 * CS))
    kv = kv_for(38, 6)
    flags = {0: [True, True, True, True, False, True], 1: [True, True, True, False, True, True]}
    first = server_factory("--chunk-size", str(CS), "--l2", disk)
    with Client(first.address) as c:
        for rank in (0, 1):
            c.register(model="m", world_size=2, worker_id=rank, chunk_shape=SHAPE, dtype="float16")
        c.store("w", tokens, kv, model="m", worker_id=0, resumable=flags[0])
        assert c.lookup("r", tokens, model="m", world_size=2) == 0  # rank 1 stored nothing yet
        # inline, as a client without the arena stores (StoreInline carries the same flags)
        with Client(first.address, transfer="inline") as remote:
            remote.register(
                model="m", world_size=2, worker_id=1, chunk_shape=SHAPE, dtype="float16"
            )
            remote.store("w", tokens, kv, model="m", worker_id=1, resumable=flags[1])
        # chunks 0..5 are complete; 3 and 4 are no resume points, 5 is: all six are a hit
        assert c.lookup("r", tokens, model="m", world_size=2) == 6 * CS
        # a prompt ending inside the chain ends its hit at the last resume point before it
        assert c.lookup("r2", tokens[: 5 * CS], model="m", world_size=2) == 3 * CS
        with pytest.raises(BadArrayError, match="resumable has 2 flags for 6 chunks"):
            c.store("w", tokens, kv, model="m", worker_id=0, resumable=[True, False])
        for r in ("r", "r2"):
            c.end_session(r)
        assert wait_for(lambda: written(first, 2 * 6))
    first.stop()
    # the disk tier keeps each shard's mark: loaded back after a restart, the same hits
    second = server_factory("--chunk-size", str(CS), "--l2", disk)
    with Client(second.address) as c:
        for rank in (0, 1):
            c.register(model="m", world_size=2, worker_id=rank, chunk_shape=SHAPE, dtype="float16")
        assert c.lookup("r2", tokens[: 5 * CS], model="m", world_size=2) == 3 * CS
        assert c.lookup("r", tokens, model="m", world_size=2) == 6 * CS
        out = np.zeros_like(kv)
        assert c.retrieve("r", tokens, out, model="m", worker_id=0) == 6 * CS
        assert np.array_equal(out, kv)
        assert status(second)["prefetch"]["loaded_groups"] == 6
        for r in ("r", "r2"):
            c.end_session(r)
        # an engine that later holds a resume point at chunks 3 and 4 stores it over the old
        # shards: the hit of the 5-chunk prompt now reaches its end
        for rank in (0, 1):
            assert c.store("w2", tokens, kv, model="m", worker_id=rank) == 6 * CS
        assert c.lookup("r3", tokens[: 5 * CS], model="m", world_size=2) == 5 * CS

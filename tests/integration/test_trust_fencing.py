"""Issue 10, findings 1, 2 and 8: no slot is reused while a client granted it may touch it.

Each test reproduces the finding with real processes: a `kvtier serve` with a 64 KiB L1 (four
16 KiB slots) and a 2 s staging lease, a client process that is slow or SIGSTOPped between
being granted a slot and touching it, and another client filling the L1 meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from testkit.admin import status
from testkit.kv import CS, prompt
from testkit.servers import ServerProcess
from testkit.trust import SPAWN, kv_for, register, reserve, retrieve_lease, verify
from testkit.waiting import wait_for

from kvtier import protocol as p
from kvtier.client import Client
from kvtier.errors import KVTierError, LeaseExpiredError, UnknownReservationError

SMALL: tuple[str, ...] = ("--l1-size", "64KiB", "--chunk-size", str(CS), "--staging-lease", "2")
SMALL += ("--reap-interval", "0.2")


def _fencing(server: ServerProcess) -> dict[str, int]:
    return status(server)["fencing"]  # type: ignore[no-any-return]


def _late_writer(address: str, queue: Any, go: Any) -> None:
    """Client A: reserve one chunk, wait (heartbeating, or SIGSTOPped by the parent) until told,
    then copy a pattern into the slot and commit, reporting what the commit said."""
    try:
        with Client(address, timeout=10) as c:
            register(c)
            reply = reserve(c, "a", prompt(0))
            queue.put(("reserved", reply.offsets[0]))
            go.wait(60)
            arena = c.arena_bytes
            assert arena is not None
            offset = reply.offsets[0]
            arena[offset : offset + reply.chunk_nbytes] = 0xAA  # the late copy
            try:
                c.connection.call(p.Commit(reply.reservation_id))
                queue.put(("committed", None))
            except KVTierError as exc:
                queue.put(("refused", type(exc).__name__))
    except Exception as exc:
        queue.put(("error", repr(exc)))


def _fill_and_check(c: Client, server: ServerProcess) -> list[int]:
    """Client B stores four one-chunk prompts (more than the free slots, so anything that was
    freed is reused), returns the prompts it can still retrieve."""
    register(c)
    for n in range(1, 5):
        with contextlib.suppress(KVTierError):
            c.store(f"b{n}", prompt(n), kv_for(n), model="m")
    return [n for n in range(1, 5) if c.lookup(f"probe{n}", prompt(n), model="m")]


@pytest.mark.parametrize("pause", ["slow", "sigstop"])
def test_a_late_writer_never_lands_in_a_slot_given_to_another_chunk(
    server_factory: Callable[..., ServerProcess], pause: str
) -> None:
    """Finding 1: A's copy outlives its staging lease (slow, or SIGSTOPped past the client
    timeout too); B stores meanwhile; A's late bytes must not reach B's chunks, and A's commit
    must report LEASE_EXPIRED."""
    server = server_factory(*SMALL, "--client-timeout", "2" if pause == "sigstop" else "30")
    queue, go = SPAWN.Queue(), SPAWN.Event()
    a = SPAWN.Process(target=_late_writer, args=(server.address, queue, go))
    a.start()
    try:
        kind, _offset = queue.get(timeout=60)
        assert kind == "reserved"
        if pause == "sigstop":
            os.kill(a.pid, signal.SIGSTOP)  # type: ignore[arg-type]
            # silent past --client-timeout: swept as a dead client, but its process is alive
            assert wait_for(lambda: status(server)["clients"] == [], timeout=20)
        assert wait_for(lambda: _fencing(server)["fenced_slots"] == 1, timeout=20)
        with Client(server.address) as b:
            present = _fill_and_check(b, server)
            assert len(present) == 3  # one slot of four is quarantined
            if pause == "sigstop":
                os.kill(a.pid, signal.SIGCONT)  # type: ignore[arg-type]
            go.set()
            assert queue.get(timeout=60) == ("refused", "LeaseExpiredError")
            for n in present:  # no wrong bytes: A's late copy landed in its own slot
                assert verify(b, n, n, f"v{n}") == 1
            assert b.lookup("a2", prompt(0), model="m") == 0  # A's chunk was never stored
        # the acknowledgement ended the quarantine
        assert wait_for(lambda: _fencing(server)["fenced_slots"] == 0)
    finally:
        if a.is_alive():
            os.kill(a.pid, signal.SIGCONT)  # type: ignore[arg-type]
            a.kill()
        a.join(10)


def test_a_quarantined_slot_is_freed_when_its_process_dies(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """The other way out of quarantine: the pidfd says the owner exited (kill -9 while it was
    stopped); the slot is usable again without any acknowledgement."""
    server = server_factory(*SMALL, "--client-timeout", "2")
    queue, go = SPAWN.Queue(), SPAWN.Event()
    a = SPAWN.Process(target=_late_writer, args=(server.address, queue, go))
    a.start()
    assert queue.get(timeout=60)[0] == "reserved"
    os.kill(a.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    assert wait_for(lambda: _fencing(server)["fenced_slots"] == 1, timeout=20)
    a.kill()
    a.join(10)
    assert wait_for(lambda: _fencing(server)["fenced_slots"] == 0, timeout=10)
    assert status(server)["l1"]["used_bytes"] == 0
    with Client(server.address) as b:
        assert len(_fill_and_check(b, server)) == 4  # the whole L1 is usable again


def _late_reader(address: str, queue: Any, go: Any) -> None:
    """Reader R: take a retrieve lease on prompt 0, wait past it, then copy and say done."""
    try:
        with Client(address, timeout=10) as c:
            register(c)
            reply = retrieve_lease(c, "r", prompt(0))
            queue.put(("leased", reply.num_chunks))
            go.wait(60)
            arena = c.arena_bytes
            assert arena is not None
            off = reply.offsets[0]
            copied = np.array(arena[off : off + reply.chunk_nbytes])
            same = bool(np.array_equal(copied, kv_for(0).view(np.uint8).reshape(-1)))
            try:
                c.connection.call(p.RetrieveDone(reply.lease_id))
                queue.put(("done", same))
            except KVTierError as exc:
                queue.put(("refused", type(exc).__name__, same))
    except Exception as exc:
        queue.put(("error", repr(exc)))


def test_a_late_reader_copies_a_slot_that_was_not_reused_and_is_told_so(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Finding 1, the mirror: a reader whose retrieve lease lapses mid-copy. The slot is kept
    (not evicted, not reused) while it may still read, and RetrieveDone says LEASE_EXPIRED, so
    the client discards what it copied."""
    server = server_factory(*SMALL, "--client-timeout", "30")
    with Client(server.address) as b:
        register(b)
        b.store("p0", prompt(0), kv_for(0), model="m")
        queue, go = SPAWN.Queue(), SPAWN.Event()
        r = SPAWN.Process(target=_late_reader, args=(server.address, queue, go))
        r.start()
        try:
            assert queue.get(timeout=60) == ("leased", 1)
            assert wait_for(lambda: _fencing(server)["lapsed"] == 1, timeout=20)
            for n in range(1, 6):  # eviction pressure: prompt 0's slot would be the LRU victim
                b.store(f"b{n}", prompt(n), kv_for(n), model="m")
            go.set()
            assert queue.get(timeout=60) == ("refused", "LeaseExpiredError", True)
        finally:
            r.kill()
            r.join(10)
        assert wait_for(lambda: _fencing(server)["lapsed"] == 0)


def test_retrieve_raises_instead_of_returning_bytes_it_cannot_vouch_for(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """The client API: a retrieve that is SIGSTOPped while it holds its slots, past its lease,
    raises LeaseExpiredError when it leaves `retrieve_slots` (the bytes it copied are to be
    discarded), and the slots it read were not reused meanwhile."""
    server = server_factory(*SMALL, "--client-timeout", "30")
    with Client(server.address) as b:
        register(b)
        b.store("p0", prompt(0), kv_for(0), model="m")
        queue, go = SPAWN.Queue(), SPAWN.Event()
        r = SPAWN.Process(target=_paused_retrieve, args=(server.address, queue, go))
        r.start()
        try:
            assert queue.get(timeout=60) == "holding"
            os.kill(r.pid, signal.SIGSTOP)  # type: ignore[arg-type]
            assert wait_for(lambda: _fencing(server)["lapsed"] == 1, timeout=20)
            for n in range(1, 6):  # eviction pressure while it sleeps
                b.store(f"b{n}", prompt(n), kv_for(n), model="m")
            os.kill(r.pid, signal.SIGCONT)  # type: ignore[arg-type]
            go.set()
            assert queue.get(timeout=60) == ("LeaseExpiredError", True)
        finally:
            os.kill(r.pid, signal.SIGCONT)  # type: ignore[arg-type]
            r.kill()
            r.join(10)


def _paused_retrieve(address: str, queue: Any, go: Any) -> None:
    expected = kv_for(0)
    out = np.zeros_like(expected)
    with Client(address, timeout=10) as c:
        register(c)
        try:
            with c.retrieve_slots(
                "r", prompt(0), model="m", end=CS, chunk_shape=list(expected.shape[1:]),
                dtype="float16",
            ) as got:  # fmt: skip
                queue.put("holding")
                go.wait(60)
                out.reshape(1, -1).view(np.uint8)[0] = got.views[0]
            queue.put(("returned", bool(np.array_equal(out, expected))))
        except LeaseExpiredError:
            queue.put(("LeaseExpiredError", bool(np.array_equal(out, expected))))
        except Exception as exc:
            queue.put(("error", repr(exc)))


def test_reservation_ids_from_before_a_restart_name_nothing(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Finding 2: a client that re-joined a restarted server commits a reservation id of the
    old server; it must not commit (and make readable) another client's unwritten slots."""
    first = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS))
    with Client(first.address, timeout=10) as old:
        register(old)
        stale = reserve(old, "x", prompt(1))
        assert first.stop() == 0
        second = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS), address=first.address)
        with Client(second.address) as other:
            register(other)
            fresh = reserve(other, "y", prompt(2))  # unwritten: zeros
            assert fresh.reservation_id != stale.reservation_id
            with pytest.raises(UnknownReservationError):
                old.connection.call(p.Commit(stale.reservation_id))  # re-joins, then is refused
            assert other.lookup("y2", prompt(2), model="m") == 0  # still not readable
            other.connection.call(p.Abort(fresh.reservation_id))
    assert second.stop() == 0


def test_a_store_of_chunks_another_client_is_storing_does_not_report_them_stored(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Finding 8: B stores chunks A is in the middle of storing; B must not be told "stored",
    since A may abort or die and then the chunks are gone."""
    server = server_factory("--l1-size", "1MiB", "--chunk-size", str(CS))
    with Client(server.address) as a, Client(server.address) as b:
        register(a)
        register(b)
        held = reserve(a, "a", prompt(3, 2))
        assert b.store("b", prompt(3, 2), kv_for(3, 2), model="m") == 0
        a.connection.call(p.Abort(held.reservation_id))
        assert b.lookup("b2", prompt(3, 2), model="m") == 0  # B was right not to count them
        assert b.store("b", prompt(3, 2), kv_for(3, 2), model="m") == 2 * CS
        assert verify(b, 3, 3, "b3") in (1,) or b.lookup("b4", prompt(3, 2), model="m") == 2 * CS
    assert status(server)["l1"]["staging_shards"] == 0

"""server/fencing.py and the lease book's quarantine: lapsed leases wait for their owner."""

from __future__ import annotations

import subprocess
import sys

from testkit.clock import FakeClock

from kvtier.keys import ChunkKey
from kvtier.server.fencing import CopyGuard, watch_process
from kvtier.server.leases import LeaseBook, Reservation, RetrieveLease

KEY = ChunkKey("m", "", 1, b"h" * 32)


def test_a_pidfd_watch_sees_its_process_exit() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    watch = watch_process(child.pid)
    assert watch is not None and watch.alive()
    assert child.stdin is not None
    child.stdin.close()
    child.wait()
    assert not watch.alive()
    watch.release()
    assert watch_process(0) is None and watch_process(2**22 + 12345) is None


def test_lapsed_items_stay_quarantined_until_the_owner_acknowledges_or_exits() -> None:
    clock = FakeClock(0.0)
    book = LeaseBook(clock)
    guard = CopyGuard()
    rid = book.add_reservation(Reservation("c", 0, [KEY], [KEY], 64, 5.0, watch=guard))
    gone = CopyGuard()
    gone.finish()
    lid = book.add_lease(RetrieveLease("c", "r", 0, [KEY], 64, 5.0, watch=gone))
    clock.now = 6
    out = book.sweep(client_timeout=100)
    assert [r.lapsed for r in out.fenced] == [True] and out.reservations == []
    assert out.leases and out.leases[0].lapsed is False  # its copier is done: ended outright
    assert book.num_lapsed == 1
    assert book.sweep(client_timeout=100).reservations == []  # still copying: still fenced
    guard.finish()
    ended = book.sweep(client_timeout=100)
    assert [r.owner for r in ended.reservations] == ["c"] and book.num_lapsed == 0
    del rid, lid


def test_ids_are_random_and_never_zero() -> None:
    book = LeaseBook(FakeClock(0.0))
    ids = {book.add_reservation(Reservation("c", 0, [KEY], [KEY], 64, 5.0)) for _ in range(200)}
    assert len(ids) == 200 and 0 not in ids and max(ids) > 2**40

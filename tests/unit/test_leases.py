"""LeaseBook: clients, reservations and retrieve leases, swept by deadline and silence."""

from __future__ import annotations

import pytest
from testkit.clock import FakeClock

from kvtier.errors import UnknownReservationError
from kvtier.keys import ChunkKey
from kvtier.server.leases import LeaseBook, Reservation, RetrieveLease

KEY = ChunkKey("m", "", 1, b"h" * 32)


def test_peers_are_known_by_socket_after_hello() -> None:
    clock = FakeClock(0.0)
    book = LeaseBook(clock)
    assert book.peer(b"sock") is None
    book.connect(b"sock", "c1")
    book.connect(b"sock2", "c1")  # a second socket of the same client
    clock.now = 5
    peer = book.peer(b"sock2")
    assert peer is not None and peer.client_id == "c1" and peer.last_seen == 5
    assert list(book.peers) == ["c1"]


def test_reservations_and_leases_belong_to_their_owner() -> None:
    book = LeaseBook(FakeClock(0.0))
    rid = book.add_reservation(Reservation("c1", 0, [KEY], [KEY], 64, 10.0))
    with pytest.raises(UnknownReservationError, match="staging-lease 30s"):
        book.take_reservation("c2", rid, 30)
    assert book.take_reservation("c1", rid, 30).reserved == [KEY]
    with pytest.raises(UnknownReservationError):
        book.take_reservation("c1", rid, 30)
    lid = book.add_lease(RetrieveLease("c1", "req", 0, [KEY], 64, 10.0))
    with pytest.raises(UnknownReservationError):
        book.take_lease("c2", lid)
    assert book.take_lease("c1", lid).request_id == "req"


def test_sweep_takes_silent_clients_and_everything_past_its_deadline() -> None:
    clock = FakeClock(0.0)
    book = LeaseBook(clock)
    book.connect(b"a", "quiet")
    book.connect(b"b", "busy")
    book.add_reservation(Reservation("quiet", 0, [KEY], [KEY], 64, 100.0))
    book.add_reservation(Reservation("busy", 0, [KEY], [KEY], 64, 5.0))  # short deadline
    keep = book.add_lease(RetrieveLease("busy", "r", 0, [KEY], 64, 100.0))
    clock.now = 8
    book.peer(b"b")  # busy is seen; quiet is not
    out = book.sweep(client_timeout=7)
    assert out.dead_clients == ["quiet"]
    assert sorted(r.owner for r in out.reservations) == ["busy", "quiet"]
    assert out.leases == []
    assert book.peer(b"a") is None
    assert book.take_lease("busy", keep).owner == "busy"

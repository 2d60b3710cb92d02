"""Who is connected, and what each client holds until when: the engine's lease book.

A client holds staging slots between Reserve and Commit (a `Reservation`) and chunks it is
copying out between Retrieve and RetrieveDone (a `RetrieveLease`). Both end by the client's next
request, by their deadline, or when the client stops heartbeating. The book only records; the
engine releases the L1 state of whatever the book hands back. Not thread-safe: the engine's lock
guards it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import LeaseExpiredError, UnknownReservationError
from kvtier.keys import ChunkKey

__all__ = ["Expired", "LeaseBook", "Peer", "Reservation", "RetrieveLease"]


@dataclass(slots=True)
class Peer:
    """A connected client (one client id, possibly several sockets)."""

    client_id: str
    connected_at: float
    last_seen: float
    registrations: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Reservation:
    """Staging shards handed to one client's store, committed together."""

    owner: str
    worker_id: int
    keys: list[ChunkKey]  # every chunk of the range, in chain order
    reserved: list[ChunkKey]  # the ones that got a staging slot
    nbytes: int
    deadline: float


@dataclass(slots=True)
class RetrieveLease:
    """Chunks a retrieve handed out; held (never evicted) until the client copied them."""

    owner: str
    request_id: str
    worker_id: int
    keys: list[ChunkKey]
    nbytes: int
    deadline: float


@dataclass(slots=True)
class Expired:
    """What a sweep took out of the book; the caller releases it in L1."""

    dead_clients: list[str] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)
    leases: list[RetrieveLease] = field(default_factory=list)


class LeaseBook:
    """Connections, clients, reservations and retrieve leases, by id."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.peers: dict[str, Peer] = {}
        self._connections: dict[bytes, str] = {}  # ZMQ routing identity -> client id
        self._reservations: dict[int, Reservation] = {}
        self._leases: dict[int, RetrieveLease] = {}
        self._ids = itertools.count(1)
        # ids taken out by a sweep, so a late Commit or RetrieveDone hears "lease expired"
        self._expired_ids: set[int] = set()
        self._expired_order: deque[int] = deque()

    _EXPIRED_MEMORY = 65536  # expired ids remembered (oldest forgotten first)

    def _remember_expired(self, ids: list[int]) -> None:
        for i in ids:
            self._expired_ids.add(i)
            self._expired_order.append(i)
        while len(self._expired_order) > self._EXPIRED_MEMORY:
            self._expired_ids.discard(self._expired_order.popleft())

    def _lapsed(self, what: str, id_: int, knob: str) -> LeaseExpiredError | None:
        if id_ not in self._expired_ids:
            return None
        self._expired_ids.discard(id_)
        return LeaseExpiredError(f"{what} {id_} expired before this request ({knob})")

    # -- clients ----------------------------------------------------------------------------------

    def connect(self, identity: bytes, client_id: str) -> Peer:
        """A socket said Hello for `client_id`."""
        now = self.clock()
        self._connections[identity] = client_id
        peer = self.peers.get(client_id)
        if peer is None:
            peer = self.peers[client_id] = Peer(client_id, now, now)
        peer.last_seen = now
        return peer

    def peer(self, identity: bytes) -> Peer | None:
        """The client behind a socket, marked as seen now; None before its Hello."""
        client_id = self._connections.get(identity)
        if client_id is None:
            return None
        peer = self.peers[client_id]
        peer.last_seen = self.clock()
        return peer

    # -- reservations and leases ------------------------------------------------------------------

    def add_reservation(self, reservation: Reservation) -> int:
        reservation_id = next(self._ids)
        self._reservations[reservation_id] = reservation
        return reservation_id

    def take_reservation(
        self, client_id: str, reservation_id: int, staging_lease: float
    ) -> Reservation:
        """Remove and return a client's reservation (for Commit or Abort)."""
        res = self._reservations.get(reservation_id)
        if res is None and (
            lapsed := self._lapsed(
                "staging lease of reservation",
                reservation_id,
                f"--staging-lease {staging_lease:g}s",
            )
        ):
            raise lapsed
        if res is None or res.owner != client_id:
            raise UnknownReservationError(
                f"no reservation {reservation_id} held by this client: it was committed, "
                f"aborted, or expired (--staging-lease {staging_lease:g}s)"
            )
        del self._reservations[reservation_id]
        return res

    def add_lease(self, lease: RetrieveLease) -> int:
        lease_id = next(self._ids)
        self._leases[lease_id] = lease
        return lease_id

    def take_lease(self, client_id: str, lease_id: int) -> RetrieveLease:
        """Remove and return a client's retrieve lease (for RetrieveDone)."""
        lease = self._leases.get(lease_id)
        if lease is None and (
            lapsed := self._lapsed("retrieve lease", lease_id, "--staging-lease, --client-timeout")
        ):
            raise lapsed
        if lease is None or lease.owner != client_id:
            raise UnknownReservationError(
                f"no retrieve lease {lease_id} held by this client: already done or expired"
            )
        del self._leases[lease_id]
        return lease

    def disconnect(self, client_id: str) -> Expired:
        """The client said goodbye: take it out with everything it holds."""
        self.peers.pop(client_id, None)
        self._connections = {i: c for i, c in self._connections.items() if c != client_id}
        out = Expired(dead_clients=[client_id])
        for rid in [r for r, res in self._reservations.items() if res.owner == client_id]:
            out.reservations.append(self._reservations.pop(rid))
        for lid in [i for i, lease in self._leases.items() if lease.owner == client_id]:
            out.leases.append(self._leases.pop(lid))
        return out

    # -- expiry -----------------------------------------------------------------------------------

    def sweep(self, client_timeout: float) -> Expired:
        """Take out clients silent for longer than `client_timeout` with everything they hold,
        and every reservation or lease past its deadline."""
        now = self.clock()
        out = Expired()
        out.dead_clients = [
            p.client_id for p in self.peers.values() if now - p.last_seen > client_timeout
        ]
        dead = set(out.dead_clients)
        for client_id in dead:
            del self.peers[client_id]
        self._connections = {i: c for i, c in self._connections.items() if c not in dead}
        rids = [
            r for r, res in self._reservations.items() if res.owner in dead or res.deadline < now
        ]
        for rid in rids:
            out.reservations.append(self._reservations.pop(rid))
        lids = [
            i for i, lease in self._leases.items() if lease.owner in dead or lease.deadline < now
        ]
        for lid in lids:
            out.leases.append(self._leases.pop(lid))
        self._remember_expired(rids + lids)
        return out

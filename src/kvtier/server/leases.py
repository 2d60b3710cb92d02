"""Who is connected, and what each client holds until when: the engine's lease book.

A client holds staging slots between Reserve and Commit (a `Reservation`) and chunks it is
copying out between Retrieve and RetrieveDone (a `RetrieveLease`). Both end by the client's next
request, by their deadline, or when the client stops heartbeating. The book only records; the
engine releases the L1 state of whatever the book hands back. Not thread-safe: the engine's lock
guards it.

A reservation or lease that lapses while its owner's process may still be copying is not ended
but *lapsed* (see `fencing`): the engine quarantines its slots, and the book keeps it until the
owner acknowledges (its Commit, Abort or RetrieveDone is answered LEASE_EXPIRED) or its process
is gone. Ids are random 63-bit numbers, so an id from before a server restart never names a
reservation of the new server.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvtier.errors import LeaseExpiredError, UnauthorizedError, UnknownReservationError
from kvtier.keys import ChunkKey
from kvtier.server.auth import ANONYMOUS, Credential
from kvtier.server.fencing import ProcessWatch, Watch
from kvtier.storage.l1 import Held

__all__ = ["Expired", "LeaseBook", "Peer", "Reservation", "RetrieveLease"]


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    """A layout a client registered for one rank of one model."""

    model: str
    world_size: int
    worker_id: int
    chunk_shape: list[int]
    dtype: str
    role: str = ""  # its part in prefill/decode hand-offs (p.HANDOFF_ROLES), "" for none


@dataclass(slots=True)
class Peer:
    """A connected client (one client id, possibly several sockets)."""

    client_id: str
    connected_at: float
    last_seen: float
    #: its layouts by (model, world size, rank): one entry each, found in one step
    registrations: dict[tuple[str, int, int], Registration] = field(default_factory=dict)
    credential: Credential = ANONYMOUS  # what its Hello's token allows
    watch: ProcessWatch | None = None  # its process, when the server can watch it (same host)
    connections: set[bytes] = field(default_factory=set)  # the sockets that said Hello for it

    @property
    def tenant(self) -> str:
        """The credential's tenant; "" without authentication."""
        return self.credential.tenant


@dataclass(slots=True)
class Reservation:
    """Staging shards handed to one client's store, committed together."""

    owner: str
    worker_id: int
    keys: list[ChunkKey]  # every chunk of the range, in chain order
    reserved: list[ChunkKey]  # the ones that got a staging slot
    nbytes: int
    deadline: float
    watch: Watch | None = None  # whoever copies, while it may still touch the slots
    lapsed: bool = False  # the lease ran out before the owner acknowledged
    fenced: list[tuple[int, int]] = field(default_factory=list)  # quarantined (offset, nbytes)
    tenant: str = ""  # whose staging and quarantine bytes its slots count in
    request_id: str | None = None  # the session that stores (None: chunks named by the caller)
    handoff: str | None = None  # the hand-off's pin holder (handoffs.py), for a hand-off's store


@dataclass(slots=True)
class RetrieveLease:
    """Chunks a retrieve handed out; held (never evicted) until the client copied them."""

    owner: str
    request_id: str | None  # the session whose pins the retrieve serves; None for named chunks
    reader: int  # the rank marked done on the session's pin at RetrieveDone
    keys: list[ChunkKey]
    nbytes: int
    deadline: float
    watch: Watch | None = None
    lapsed: bool = False
    tenant: str = ""  # whose held bytes its chunks count in (see `LeaseBook.held_bytes`)
    # the L1's holds on their groups, one per key (each names its group, not its key)
    held: list[Held] = field(default_factory=list)

    @property
    def held_bytes(self) -> int:
        return len(self.keys) * self.nbytes


@dataclass(slots=True)
class Expired:
    """What a sweep took out of the book or moved within it; the caller acts on it in L1.

    `reservations` and `leases` are over: their owner can no longer touch their slots (free
    them). `fenced` and `held` lapsed while the owner may still be copying: quarantine them
    (fence the staging slots; keep the retrieve holds) until they come back in a later sweep's
    `reservations`/`leases` or are acknowledged.
    """

    dead_clients: list[str] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)
    leases: list[RetrieveLease] = field(default_factory=list)
    fenced: list[Reservation] = field(default_factory=list)
    held: list[RetrieveLease] = field(default_factory=list)


def _may_touch(item: Reservation | RetrieveLease) -> bool:
    return item.watch is not None and item.watch.alive()


class LeaseBook:
    """Connections, clients, reservations and retrieve leases, by id."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.peers: dict[str, Peer] = {}
        self._connections: dict[bytes, str] = {}  # ZMQ routing identity -> client id
        self._tenant_clients: dict[str, int] = {}  # connected client ids per tenant
        self._reservations: dict[int, Reservation] = {}
        self._leases: dict[int, RetrieveLease] = {}
        self._lapsed: dict[int, Reservation | RetrieveLease] = {}  # quarantined, by id
        # bytes of the shards each tenant's retrieve leases hold, lapsed ones included
        self._held: dict[str, int] = {}
        # ids a sweep ended outright (the owner's process is gone), so a late Commit or
        # RetrieveDone still hears "lease expired" rather than "unknown"
        self._expired_ids: set[int] = set()
        self._expired_order: deque[int] = deque()
        self.num_expired_answers = 0  # commits and retrieve-dones answered LEASE_EXPIRED

    _EXPIRED_MEMORY = 65536  # expired ids remembered (oldest forgotten first)

    def _remember_expired(self, ids: list[int]) -> None:
        for i in ids:
            self._expired_ids.add(i)
            self._expired_order.append(i)
        while len(self._expired_order) > self._EXPIRED_MEMORY:
            self._expired_ids.discard(self._expired_order.popleft())

    def _ended(self, what: str, id_: int, knob: str) -> LeaseExpiredError | None:
        if id_ not in self._expired_ids:
            return None
        self._expired_ids.discard(id_)
        return LeaseExpiredError(f"{what} {id_} expired before this request ({knob})")

    # -- clients ----------------------------------------------------------------------------------

    def connect(
        self,
        identity: bytes,
        client_id: str,
        *,
        credential: Credential = ANONYMOUS,
        watch: ProcessWatch | None = None,
    ) -> Peer:
        """A socket said Hello for `client_id`; a client id stays with the tenant that made it."""
        now = self.clock()
        peer = self.peers.get(client_id)
        if peer is not None and peer.credential != credential:
            if watch is not None:
                watch.release()
            raise UnauthorizedError(
                "this client id belongs to another tenant's connection; use a fresh random id"
            )
        before = self._connections.get(identity)
        if before is not None and before != client_id and before in self.peers:
            self.peers[before].connections.discard(identity)  # the socket now speaks for another
        self._connections[identity] = client_id
        if peer is None:
            peer = self.peers[client_id] = Peer(client_id, now, now, credential=credential)
            tenant = credential.tenant
            self._tenant_clients[tenant] = self._tenant_clients.get(tenant, 0) + 1
        peer.connections.add(identity)
        if watch is not None:
            if peer.watch is not None:
                peer.watch.release()
            peer.watch = watch
        peer.last_seen = now
        return peer

    def is_connected(self, identity: bytes) -> bool:
        """Whether a socket has said Hello (one dictionary read: safe without the lock, for
        the transport's check of what it reads before a Hello)."""
        return identity in self._connections

    def num_clients(self, tenant: str) -> int:
        """Client ids of `tenant` connected now."""
        return self._tenant_clients.get(tenant, 0)

    def lapsed_watch(self, client_id: str) -> Watch | None:
        """The process of a client id that the book still holds quarantined slots for, after
        the client itself was taken out (swept); None when it holds none."""
        for item in self._lapsed.values():
            if item.owner == client_id and item.watch is not None:
                return item.watch
        return None

    def _forget_peer(self, peer: Peer) -> None:
        for identity in peer.connections:
            if self._connections.get(identity) == peer.client_id:
                del self._connections[identity]
        tenant = peer.tenant
        left = self._tenant_clients.get(tenant, 0) - 1
        if left > 0:
            self._tenant_clients[tenant] = left
        else:
            self._tenant_clients.pop(tenant, None)
        if peer.watch is not None:
            peer.watch.release()

    def peer(self, identity: bytes) -> Peer | None:
        """The client behind a socket, marked as seen now; None before its Hello."""
        client_id = self._connections.get(identity)
        if client_id is None:
            return None
        peer = self.peers[client_id]
        peer.last_seen = self.clock()
        return peer

    # -- reservations and leases ------------------------------------------------------------------

    def _new_id(self) -> int:
        """A random id in 1..2**63-1 not in use: ids of an earlier server lifetime (a client
        that re-joined still holds them) name nothing here, except with odds of 2**-63."""
        while True:
            new_id = secrets.randbits(63)
            if new_id and not (
                new_id in self._reservations or new_id in self._leases or new_id in self._lapsed
            ):
                return new_id

    def add_reservation(self, reservation: Reservation) -> int:
        reservation_id = self._new_id()
        self._reservations[reservation_id] = reservation
        return reservation_id

    def take_reservation(
        self, client_id: str, reservation_id: int, staging_lease: float
    ) -> Reservation:
        """Remove and return a client's reservation (for Commit or Abort); `lapsed` is set on
        one whose lease ran out (its slots are quarantined, `fenced`)."""
        res = self._reservations.get(reservation_id)
        if res is not None and res.owner == client_id:
            del self._reservations[reservation_id]
            return res
        lapsed = self._lapsed.get(reservation_id)
        if isinstance(lapsed, Reservation) and lapsed.owner == client_id:
            del self._lapsed[reservation_id]
            return lapsed
        ended = self._ended(
            "staging lease of reservation", reservation_id, f"--staging-lease {staging_lease:g}s"
        )
        if ended is not None:
            raise ended
        raise UnknownReservationError(
            f"no reservation {reservation_id} held by this client: it was committed, "
            f"aborted, or expired (--staging-lease {staging_lease:g}s)"
        )

    def add_lease(self, lease: RetrieveLease) -> int:
        lease_id = self._new_id()
        self._leases[lease_id] = lease
        self._held[lease.tenant] = self._held.get(lease.tenant, 0) + lease.held_bytes
        return lease_id

    def held_bytes(self, tenant: str) -> int:
        """Bytes the tenant's retrieve leases hold (never evicted), lapsed ones included: a
        reader that went silent keeps its chunks held while its process lives."""
        return self._held.get(tenant, 0)

    def _lease_ended(self, lease: RetrieveLease) -> RetrieveLease:
        left = self._held.pop(lease.tenant, 0) - lease.held_bytes
        if left:
            self._held[lease.tenant] = left
        return lease

    def take_lease(self, client_id: str, lease_id: int) -> RetrieveLease:
        """Remove and return a client's retrieve lease (for RetrieveDone); `lapsed` is set on
        one whose lease ran out (its holds were kept while the owner might still copy)."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.owner == client_id:
            del self._leases[lease_id]
            return self._lease_ended(lease)
        lapsed = self._lapsed.get(lease_id)
        if isinstance(lapsed, RetrieveLease) and lapsed.owner == client_id:
            del self._lapsed[lease_id]
            return self._lease_ended(lapsed)
        ended = self._ended("retrieve lease", lease_id, "--staging-lease, --client-timeout")
        if ended is not None:
            raise ended
        raise UnknownReservationError(
            f"no retrieve lease {lease_id} held by this client: already done or expired"
        )

    def expired(self, what: str, staging_lease: float) -> LeaseExpiredError:
        """The answer to an owner acknowledging a lapsed reservation or lease; counted."""
        self.num_expired_answers += 1
        return LeaseExpiredError(
            f"{what} expired before it was acknowledged (--staging-lease "
            f"{staging_lease:g}s): nothing of it counts; recompute"
        )

    @property
    def num_lapsed(self) -> int:
        """Reservations and leases quarantined until their owner acknowledges or exits."""
        return len(self._lapsed)

    def disconnect(self, client_id: str) -> Expired:
        """The client said goodbye: take it out with everything it holds. Goodbye is its
        acknowledgement that it touches none of its slots any more, quarantined ones included."""
        peer = self.peers.pop(client_id, None)
        if peer is not None:
            self._forget_peer(peer)
        out = Expired(dead_clients=[client_id])
        for rid in [r for r, res in self._reservations.items() if res.owner == client_id]:
            out.reservations.append(self._reservations.pop(rid))
        for lid in [i for i, lease in self._leases.items() if lease.owner == client_id]:
            out.leases.append(self._lease_ended(self._leases.pop(lid)))
        for xid in [i for i, x in self._lapsed.items() if x.owner == client_id]:
            item = self._lapsed.pop(xid)
            if isinstance(item, Reservation):
                out.reservations.append(item)
            else:
                out.leases.append(self._lease_ended(item))
        return out

    # -- expiry -----------------------------------------------------------------------------------

    def sweep(self, client_timeout: float) -> Expired:
        """Take out clients silent for longer than `client_timeout`, and every reservation or
        lease past its deadline or of a silent client: ended when its owner's process is gone,
        lapsed (quarantined) while it may still touch the slots. Lapsed ones whose owner has
        exited since come back as ended."""
        now = self.clock()
        out = Expired()
        out.dead_clients = [
            p.client_id for p in self.peers.values() if now - p.last_seen > client_timeout
        ]
        dead = set(out.dead_clients)
        for client_id in dead:
            self._forget_peer(self.peers.pop(client_id))
        for rid in [
            r for r, res in self._reservations.items() if res.owner in dead or res.deadline < now
        ]:
            res = self._reservations.pop(rid)
            if _may_touch(res):
                res.lapsed = True
                self._lapsed[rid] = res
                out.fenced.append(res)
            else:
                out.reservations.append(res)
                self._remember_expired([rid])
        for lid in [
            i for i, lease in self._leases.items() if lease.owner in dead or lease.deadline < now
        ]:
            lease = self._leases.pop(lid)
            if _may_touch(lease):
                lease.lapsed = True
                self._lapsed[lid] = lease
                out.held.append(lease)
            else:
                out.leases.append(self._lease_ended(lease))
                self._remember_expired([lid])
        fresh = {id(x) for x in (*out.fenced, *out.held)}
        for xid in [i for i, x in self._lapsed.items() if id(x) not in fresh and not _may_touch(x)]:
            item = self._lapsed.pop(xid)
            if isinstance(item, Reservation):
                out.reservations.append(item)
            else:
                out.leases.append(self._lease_ended(item))
            self._remember_expired([xid])
        return out

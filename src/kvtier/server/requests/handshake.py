"""The handshake: Hello (protocol, hash contract, credential) and Register (a worker's layout).

A client says Hello once per connection: the server refuses another protocol version and a
hasher whose chunk names would differ (naming the setting that differs), authenticates its
token, and watches its process when it runs on this machine (the pidfd that fences its copies,
see `fencing.py`). Register records a worker's KV layout per model in the client's tenant's
namespace. Both run under the engine lock, which the caller holds.

What a Hello may make the server hold is bounded: its fields (`limits.py`), the client ids of
one tenant (--max-clients-per-tenant), the sockets of one client id
(--max-connections-per-client) and the processes watched (--max-watched-processes, one pidfd
per process however many clients it runs).

The process is the one the transport proved for the connection (`prove`: the ipc:// peer
credential), never the pid the Hello names: a tcp:// client, or one whose process the server
cannot watch, is told that the arena is not for it (its HelloReply's host id is not the
server's, so a kvtier Client moves bytes inline) and is refused arena slots.

A client id acts only for the tenant and the process that made it: a Hello that names a known
client id from a new socket must come with the same credential and the same proven process, and
so must one naming a client id that a sweep took out while its slots are still quarantined (the
socket of a paused process says Hello again when it wakes; anyone else is refused).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier import protocol as p
from kvtier._version import __version__
from kvtier.errors import (
    HashContractError,
    InvalidArgumentError,
    NoSpaceError,
    ProtocolVersionError,
    UnauthorizedError,
)
from kvtier.hashing import TokenHasher
from kvtier.layouts import LayoutRegistry
from kvtier.server import tenants
from kvtier.server.auth import Authenticator, Credential
from kvtier.server.fencing import ProcessWatch, ProcessWatches, Watch
from kvtier.server.leases import LeaseBook, Peer, Registration
from kvtier.storage.arena import Arena

__all__ = ["NO_ARENA", "Handshake"]

#: appended to the host id a HelloReply gives a client the server grants no arena slots: it
#: cannot equal the client's own host id, so the client moves bytes inline
NO_ARENA = " (no arena: the server cannot prove this connection's process; bytes go inline)"


def _pid(watch: Watch | None) -> int | None:
    return watch.pid if isinstance(watch, ProcessWatch) else None


class Handshake:
    """Answers Hello and Register for the engine."""

    def __init__(
        self,
        *,
        hasher: TokenHasher,
        auth: Authenticator,
        leases: LeaseBook,
        layouts: LayoutRegistry,
        arena: Arena,
        chunk_size: int,
        host_id: str,
        server_id: str,
        max_clients_per_tenant: int = 1024,
        max_connections_per_client: int = 256,
        max_watched_processes: int = 1024,
        max_registrations_per_client: int = 1024,
    ) -> None:
        self.hasher = hasher
        self.contract = hasher.contract()
        self.auth = auth
        self.leases = leases
        self.layouts = layouts
        self.arena = arena
        self.chunk_size = chunk_size
        self.host_id = host_id
        self.server_id = server_id
        self.max_clients_per_tenant = max_clients_per_tenant
        self.max_connections_per_client = max_connections_per_client
        self.watches = ProcessWatches(max_watched_processes)
        self.max_registrations_per_client = max_registrations_per_client
        # the process behind a connection, as the transport proved it for the Hello it is
        # handing over right now (set and taken on the transport thread)
        self._proofs: dict[bytes, int] = {}
        #: told a model's KV cache groups when a worker registers them (the KV events label
        #: each chunk's announcement per group); tenant-scoped model, groups
        self.on_kv_groups: Callable[[str, tuple[p.KVGroup, ...]], None] | None = None

    def prove(self, identity: bytes, pid: int) -> None:
        """The connection `identity` is process `pid` (the kernel said so): for its Hello."""
        self._proofs[identity] = pid

    def forget_proof(self, identity: bytes) -> None:
        self._proofs.pop(identity, None)

    def hello(self, identity: bytes, req: p.Hello) -> p.HelloReply:
        """Check the protocol version, the hash contract and the credential; connect the
        client (watching its process when the connection proves it runs on this machine)."""
        if req.protocol_version != p.PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"client speaks protocol version {req.protocol_version}, this server speaks "
                f"{p.PROTOCOL_VERSION}: install matching kvtier versions "
                f"(server {__version__})"
            )
        server_info = self.hasher.contract_info()
        if req.contract is not None and req.contract != self.contract:
            # every quoted value is bounded by limits.py; repr cut again, to be sure
            diffs = [
                f"{k}: client {repr(req.contract_info.get(k))[:64]}, server {v!r}"
                for k, v in server_info.items()
                if req.contract_info.get(k) != v
            ]
            detail = "; ".join(diffs) or "same settings, different hash implementation"
            raise HashContractError(
                f"hash contract mismatch (client {req.contract[:64]}, server {self.contract}): "
                f"{detail}. Chunk names would differ; use the server's settings "
                "(--chunk-size, --hash-algorithm, --hash-seed)"
            )
        credential = self.auth.authenticate(req.token)
        # Only a process on this machine can touch the arena, and only one the server can watch:
        # the pidfd is what fences it. The pid is the connection's, never the Hello's word.
        pid = self._proofs.pop(identity, None)
        if req.host_id != self.host_id:
            pid = None
        self._admit(identity, req.client_id, credential, pid)
        watch = self.watches.watch(pid) if pid is not None else None
        self.leases.connect(identity, req.client_id, credential=credential, watch=watch)
        return p.HelloReply(
            server_version=__version__,
            protocol_version=p.PROTOCOL_VERSION,
            contract=self.contract,
            contract_info=dict(server_info),
            chunk_size=self.chunk_size,
            arena_name=self.arena.name,
            arena_size=self.arena.size,
            host_id=self.host_id if watch is not None else self.host_id + NO_ARENA,
            server_id=self.server_id,
        )

    def _admit(
        self, identity: bytes, client_id: str, credential: Credential, pid: int | None
    ) -> None:
        """Refuse a Hello that would act for another connection's client id, or pass a bound."""
        peer = self.leases.peers.get(client_id)
        if peer is not None:
            if peer.credential != credential:
                raise UnauthorizedError(
                    "this client id belongs to another tenant's connection; use a fresh random id"
                )
            if identity in peer.connections:
                return  # this socket again
            if _pid(peer.watch) != pid:
                raise UnauthorizedError(
                    "this client id belongs to another process's connection: a client id acts "
                    "only for the process that made it; use a fresh random id"
                )
            if len(peer.connections) >= self.max_connections_per_client:
                raise NoSpaceError(
                    f"client id {client_id[:16]!r}... has said Hello on {len(peer.connections)} "
                    f"sockets, the most (--max-connections-per-client "
                    f"{self.max_connections_per_client})"
                )
            return
        held = self.leases.lapsed_watch(client_id)
        if isinstance(held, ProcessWatch) and held.alive() and held.pid != pid:
            raise UnauthorizedError(
                "this client id belongs to a process whose arena slots are still quarantined: "
                "only that process may say Hello for it again; use a fresh random id"
            )
        tenant = credential.tenant
        if self.leases.num_clients(tenant) >= self.max_clients_per_tenant:
            who = f"tenant {tenant!r}" if tenant else "the anonymous tenant"
            raise NoSpaceError(
                f"{who} has {self.leases.num_clients(tenant)} clients connected, the most "
                f"(--max-clients-per-tenant {self.max_clients_per_tenant}): close idle clients"
            )

    def register(self, client: Peer, req: p.Register) -> p.Ok:
        """Record a worker's KV layout for a model (refused, and not recorded, when one chunk
        cannot fit L1: see `LayoutRegistry.register`, or past the client's bound). The layout
        is kept while the client lives (see `LayoutRegistry.expire`)."""
        slot = (req.model, req.world_size, req.worker_id)
        if req.role:
            self._check_handoff_peers(client, req)
        if (
            slot not in client.registrations
            and len(client.registrations) >= self.max_registrations_per_client
        ):
            raise NoSpaceError(
                f"this client registered {len(client.registrations)} layouts, the most "
                f"(--max-registrations-per-client {self.max_registrations_per_client})"
            )
        # Layouts live in the tenant's namespace: another tenant registering a bogus layout for
        # the same model name first cannot lock this tenant's workers out.
        layout = self.layouts.register(
            tenants.scoped_model(client, req.model),
            req.world_size,
            req.worker_id,
            req.chunk_shape,
            req.dtype,
            max_group_bytes=self.arena.size,
            user=client.client_id,
        )
        registration = Registration(
            model=req.model,
            world_size=req.world_size,
            worker_id=req.worker_id,
            chunk_shape=list(layout.chunk_shape),
            dtype=layout.dtype,
            role=req.role,
        )
        client.registrations[slot] = registration
        if req.kv_groups and self.on_kv_groups is not None:
            self.on_kv_groups(tenants.scoped_model(client, req.model), tuple(req.kv_groups))
        return p.Ok()

    def _check_handoff_peers(self, client: Peer, req: p.Register) -> None:
        """A hand-off producer and consumer of one model in one tenant must store and read the
        same shards: refuse the second to start when the first has another world size (so the
        mismatch shows at start, not as every hand-off refused)."""
        other = "kv_consumer" if req.role == "kv_producer" else "kv_producer"
        for peer in self.leases.peers.values():
            if peer is client or peer.tenant != client.tenant:
                continue
            for reg in peer.registrations.values():
                if reg.role != other or reg.model != req.model:
                    continue
                if reg.world_size != req.world_size:
                    raise InvalidArgumentError(
                        f"a {req.role} of {req.model!r} over {req.world_size} shards cannot "
                        f"share hand-offs with the {other} connected here, which uses "
                        f"{reg.world_size}: run prefill and decode instances with the same "
                        "tensor- and pipeline-parallel sizes (MLA models: the same "
                        "pipeline-parallel size; their latent cache is one shard per stage)"
                    )

"""The handshake: Hello (protocol, hash contract, credential) and Register (a worker's layout).

A client says Hello once per connection: the server refuses another protocol version and a
hasher whose chunk names would differ (naming the setting that differs), authenticates its
token, and watches its process when it runs on this machine (the pidfd that fences its copies,
see `fencing.py`). Register records a worker's KV layout per model in the client's tenant's
namespace. Both run under the engine lock, which the caller holds.
"""

from __future__ import annotations

from kvtier import protocol as p
from kvtier._version import __version__
from kvtier.errors import HashContractError, ProtocolVersionError
from kvtier.hashing import TokenHasher
from kvtier.server import tenants
from kvtier.server.auth import Authenticator
from kvtier.server.fencing import watch_process
from kvtier.server.layouts import LayoutRegistry
from kvtier.server.leases import LeaseBook, Peer
from kvtier.snapshots import Registration
from kvtier.storage.arena import Arena

__all__ = ["Handshake"]


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

    def hello(self, identity: bytes, req: p.Hello) -> p.HelloReply:
        """Check the protocol version, the hash contract and the credential; connect the
        client (watching its process when it runs on this machine)."""
        if req.protocol_version != p.PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"client speaks protocol version {req.protocol_version}, this server speaks "
                f"{p.PROTOCOL_VERSION}: install matching kvtier versions "
                f"(server {__version__})"
            )
        server_info = self.hasher.contract_info()
        if req.contract is not None and req.contract != self.contract:
            diffs = [
                f"{k}: client {req.contract_info.get(k)!r}, server {v!r}"
                for k, v in server_info.items()
                if req.contract_info.get(k) != v
            ]
            detail = "; ".join(diffs) or "same settings, different hash implementation"
            raise HashContractError(
                f"hash contract mismatch (client {req.contract}, server {self.contract}): "
                f"{detail}. Chunk names would differ; use the server's settings "
                "(--chunk-size, --hash-algorithm, --hash-seed)"
            )
        credential = self.auth.authenticate(req.token)
        # Only a process on this machine can touch the arena; the pidfd is what fences it.
        watch = watch_process(req.pid) if req.host_id == self.host_id else None
        self.leases.connect(identity, req.client_id, credential=credential, watch=watch)
        return p.HelloReply(
            server_version=__version__,
            protocol_version=p.PROTOCOL_VERSION,
            contract=self.contract,
            contract_info=dict(server_info),
            chunk_size=self.chunk_size,
            arena_name=self.arena.name,
            arena_size=self.arena.size,
            host_id=self.host_id,
            server_id=self.server_id,
        )

    def register(self, client: Peer, req: p.Register) -> p.Ok:
        """Record a worker's KV layout for a model (refused, and not recorded, when one chunk
        cannot fit L1: see `LayoutRegistry.register`)."""
        # Layouts live in the tenant's namespace: another tenant registering a bogus layout for
        # the same model name first cannot lock this tenant's workers out.
        layout = self.layouts.register(
            tenants.scoped_model(client, req.model),
            req.world_size,
            req.worker_id,
            req.chunk_shape,
            req.dtype,
            max_group_bytes=self.arena.size,
        )
        registration = Registration(
            model=req.model,
            world_size=req.world_size,
            worker_id=req.worker_id,
            chunk_shape=list(layout.chunk_shape),
            dtype=layout.dtype,
        )
        if registration not in client.registrations:
            client.registrations.append(registration)
        return p.Ok()

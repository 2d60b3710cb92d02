"""Tenants: every request handled in its client's namespace.

With `--auth-tokens-file`, a credential names a tenant; without one a client is the anonymous
tenant "". Every name a request carries is composed with its tenant (`keys.compose`, which is
injective): a model becomes (tenant, model), a cache salt (tenant, salt), a session id (tenant,
the salt for the anonymous tenant, request id). So no tenant can see, end or evict another's
state by choosing its names, whatever strings it sends. A credential must allow the salt it
uses. (A request's extra key goes into its chunk hashes instead: `keys.with_extra_key`.) Pure
functions of the client and the request: no state, no lock. Each request's route (`routes.py`)
names the one that puts it in its tenant.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from kvtier import protocol as p
from kvtier.errors import InvalidArgumentError
from kvtier.keys import compose
from kvtier.server.leases import Peer

__all__ = [
    "require_watch",
    "scope",
    "scope_names",
    "scope_session",
    "scoped_model",
    "session_id",
]

Scoped = TypeVar("Scoped", p.Lookup, p.Reserve, p.StoreInline, p.Retrieve)
ScopedNames = TypeVar(
    "ScopedNames", p.ExistsKeys, p.ReserveKeys, p.StoreKeysInline, p.RetrieveKeys, p.EndHandoff
)
ScopedSession = TypeVar("ScopedSession", p.LookupPoll, p.Release, p.EndSession)


def session_id(client: Peer, request_id: str, cache_salt: str) -> str:
    """A session lives in its tenant (its credential's; without one, its salt's): reusing
    another's request id, or choosing one that spells another's composed id, neither sees nor
    ends the other's session. One tenant's requests of one id share a session whatever salt
    each names, as its credential already decides which salts it may use."""
    return compose(client.tenant, "" if client.tenant else cache_salt, request_id)


def scoped_model(client: Peer, model: str) -> str:
    """The model in the client's tenant's namespace (layouts and chunk keys use this)."""
    return compose(client.tenant, model)


def scoped_salt(client: Peer, cache_salt: str) -> str:
    """The salt in the client's tenant's namespace."""
    return compose(client.tenant, cache_salt)


def scope(client: Peer, req: Scoped) -> Scoped:
    """The request as the engine handles it: session id, model and salt in the client's
    tenant's namespace, after checking that its credential may use the salt."""
    client.credential.check_salt(req.cache_salt)
    return msgspec.structs.replace(
        req,
        request_id=session_id(client, req.request_id, req.cache_salt),
        model=scoped_model(client, req.model),
        cache_salt=scoped_salt(client, req.cache_salt),
    )


def scope_names(client: Peer, req: ScopedNames) -> ScopedNames:
    """A key-addressed request in the client's tenant's namespace (model and salt), after
    checking that its credential may use the salt. Named chunks have no session."""
    client.credential.check_salt(req.cache_salt)
    return msgspec.structs.replace(
        req,
        model=scoped_model(client, req.model),
        cache_salt=scoped_salt(client, req.cache_salt),
    )


def scope_session(client: Peer, req: ScopedSession) -> ScopedSession:
    """A request about an existing session (poll, release, end) with its session id in the
    client's tenant; its salt only picks the session (see `session_id`)."""
    return msgspec.structs.replace(
        req, request_id=session_id(client, req.request_id, req.cache_salt)
    )


def require_watch(client: Peer, what: str) -> None:
    """Refuse arena slots to a client whose process the server cannot watch (fence)."""
    if client.watch is None:
        raise InvalidArgumentError(
            f"{what} hands out arena slots, which only a client on this machine whose "
            "process the server can watch may use (name its pid at Hello); move the bytes "
            "inline instead (StoreInline, Retrieve with inline=True)"
        )

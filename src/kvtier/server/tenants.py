"""Tenants: every request handled in its client's namespace.

With `--auth-tokens-file`, a credential names a tenant: its session ids, models and cache salts
are prefixed with the tenant (`auth.scoped`), so one tenant can neither see nor end nor evict
another's state by reusing its names, and its credential must allow the salt it uses. Anonymous
clients (no tenant) keep their names unchanged, and scope sessions by cache salt. Pure
functions of the client and the request: no state, no lock.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from kvtier import protocol as p
from kvtier.errors import InvalidArgumentError
from kvtier.server.auth import scoped
from kvtier.server.leases import Peer

__all__ = ["require_watch", "scope", "scope_names", "session_id"]

Scoped = TypeVar("Scoped", p.Lookup, p.Reserve, p.StoreInline, p.Retrieve)
ScopedNames = TypeVar("ScopedNames", p.ExistsKeys, p.ReserveKeys, p.StoreKeysInline, p.RetrieveKeys)


def session_id(client: Peer, request_id: str, cache_salt: str) -> str:
    """Sessions and pins are scoped per tenant: its credential's, or with none its salt, so
    one tenant reusing another's request id neither sees nor ends the other's session."""
    return scoped(client.tenant or cache_salt, request_id)


def scope(client: Peer, req: Scoped) -> Scoped:
    """The request as the engine handles it: session id, model and salt in the client's
    tenant's namespace (the anonymous tenant's names are unchanged), after checking that its
    credential may use the salt."""
    client.credential.check_salt(req.cache_salt)
    request_id = session_id(client, req.request_id, req.cache_salt)
    if not client.tenant:
        if request_id == req.request_id:
            return req
        return msgspec.structs.replace(req, request_id=request_id)
    return msgspec.structs.replace(
        req,
        request_id=request_id,
        model=scoped(client.tenant, req.model),
        cache_salt=scoped(client.tenant, req.cache_salt),
    )


def scope_names(client: Peer, req: ScopedNames) -> ScopedNames:
    """A key-addressed request in the client's tenant's namespace (model and salt), after
    checking that its credential may use the salt. Named chunks have no session."""
    client.credential.check_salt(req.cache_salt)
    if not client.tenant:
        return req
    return msgspec.structs.replace(
        req,
        model=scoped(client.tenant, req.model),
        cache_salt=scoped(client.tenant, req.cache_salt),
    )


def require_watch(client: Peer, what: str) -> None:
    """Refuse arena slots to a client whose process the server cannot watch (fence)."""
    if client.watch is None:
        raise InvalidArgumentError(
            f"{what} hands out arena slots, which only a client on this machine whose "
            "process the server can watch may use (name its pid at Hello); move the bytes "
            "inline instead (StoreInline, Retrieve with inline=True)"
        )

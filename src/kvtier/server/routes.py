"""Routes: every request type the server answers, declared once.

A `Route` says everything the server needs to know about one request type: its bounds (checked
before any work), whether a handler thread takes it (long work, so the transport thread only
decodes, routes and replies), whether it needs a client whose process the server can watch,
how it is put in its client's tenant (see `tenants.py`), and its handler. The engine looks a
request's route up and runs it. A new request type is its message (`protocol.py`), one route
here beside its handler, the work itself in its request family's module (`requests/`), and its
metrics labels (`observe/operations.py`).

The handlers are short: they call the request families the engine built, which do the work and
say what runs under the engine lock. Nothing here holds state. The order of the server's
request path: the engine runs the routes, the routes call the request families, the families
answer through `answers.py`, and everything reports into `observe/`; none imports one above it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from kvtier import protocol as p
from kvtier.errors import InternalError, InvalidArgumentError, NotConnectedError
from kvtier.layouts import LayoutRegistry
from kvtier.names import named_chunk_keys
from kvtier.server import naming, tenants
from kvtier.server.answers import Answer
from kvtier.server.leases import Peer
from kvtier.server.limits import Limits
from kvtier.server.locking import TimedLock
from kvtier.server.requests.handoffs import HandoffBook
from kvtier.server.requests.handshake import Handshake
from kvtier.server.requests.lookups import LookupBook
from kvtier.server.requests.retrieves import RetrieveBook
from kvtier.server.requests.sessions import SessionBook
from kvtier.server.requests.stores import StoreBook
from kvtier.storage.l1 import L1Store

__all__ = ["ROUTES", "Call", "Route", "RouteHost", "route_of"]

R = TypeVar("R")


class RouteHost(Protocol):
    """What the handlers use of the engine that runs them (`engine.Engine` is the one): the
    request families it built, its lock and its parts. The engine imports the routes; the
    routes see it only through this."""

    handshake: Handshake
    lookups: LookupBook
    session_book: SessionBook
    stores: StoreBook
    retrieves: RetrieveBook
    layouts: LayoutRegistry
    l1: L1Store
    handoffs: HandoffBook

    @property
    def lock(self) -> TimedLock: ...

    def goodbye(self, client_id: str) -> None: ...


#: what a handler answers: a reply, the reply's frames (header first), or None when the
#: request's `Answer` is kept to answer later
Answered = p.Reply | list[Any] | None


@dataclass(slots=True)
class Call(Generic[R]):
    """One request as its handler gets it: bounded, and in its client's tenant."""

    identity: bytes  # the transport's name for the connection
    request: R
    peer: Peer | None  # None only for a Hello, which makes the client
    payloads: Sequence[Any]  # the inline KV bytes that came with it, one frame per chunk
    answer: Answer

    @property
    def client(self) -> Peer:
        """The client that sent the request (the engine found it before the handler runs)."""
        if self.peer is None:
            raise NotConnectedError(
                f"send Hello before {type(self.request).__name__}: no handshake yet"
            )
        return self.peer

    @property
    def operation(self) -> str:
        """The request's name: what the engine lock's hold times are kept by."""
        return self.answer.operation


def _quick(req: object, chunk_size: int) -> bool:
    return False


def _never(req: object) -> bool:
    return False


def _always(req: object) -> bool:
    return True


def _always_offloaded(req: object, chunk_size: int) -> bool:
    return True  # deletes from the L2 tiers: I/O, never on the transport thread


def _unless_inline(req: p.Retrieve | p.RetrieveKeys) -> bool:
    return not req.inline


def _unscoped(client: Peer, req: R) -> R:
    return req


@dataclass(frozen=True, slots=True)
class Route(Generic[R]):
    """How the server answers one request type."""

    request: type[R]
    #: refuses a request whose counts or sizes are out of bounds (see `limits.py`)
    bounds: Callable[[Limits, R], None]
    handle: Callable[[RouteHost, Call[R]], Answered]
    #: whether a handler thread takes it, given the server's chunk size
    offloaded: Callable[[R, int], bool] = _quick
    #: the request in its client's tenant, before any session is made for it
    scope: Callable[[Peer, R], R] = _unscoped
    #: whether it hands out arena slots, which only a client the server can watch may use
    watched: Callable[[R], bool] = _never
    #: False for the one request that makes the client (Hello); every other needs one
    connected: bool = True


# -- which requests are long work --------------------------------------------------------------

#: prompts of at least this many chunks are hashed and named on a handler thread (with 256-token
#: chunks, 64k tokens). A shorter one stays on the transport thread: its work (2-3 us a chunk:
#: hashing, naming, the L1) ends within the GIL's 1 ms switch interval, and a handler thread
#: holds the GIL while it hashes, so handing it off would let no other request in sooner; it
#: would only add two thread hand-offs (~0.1 ms each), more than a 16k-token lookup's work.
OFFLOAD_CHUNKS = 256
#: key-addressed requests with at least this many names (about 1 ms of name hashing) likewise
OFFLOAD_NAMES = 256


def _long_prompt(req: p.Lookup | p.RangeRequest, chunk_size: int) -> bool:
    return len(req.tokens) >= OFFLOAD_CHUNKS * chunk_size * 4  # bytes of packed uint32 tokens


def _many_names(req: p.ExistsKeys | p.KeyRequest | p.EndHandoff, chunk_size: int) -> bool:
    return len(req.names) >= OFFLOAD_NAMES


def _bytes_inline(req: object, chunk_size: int) -> bool:
    return True


def _retrieve_offloaded(req: p.Retrieve, chunk_size: int) -> bool:
    return req.inline or _long_prompt(req, chunk_size)


def _retrieve_keys_offloaded(req: p.RetrieveKeys, chunk_size: int) -> bool:
    return req.inline or _many_names(req, chunk_size)


# -- handshake ---------------------------------------------------------------------------------


def _hello(engine: RouteHost, call: Call[p.Hello]) -> Answered:
    with engine.lock.hold(call.operation):
        return engine.handshake.hello(call.identity, call.request)


def _heartbeat(engine: RouteHost, call: Call[p.Heartbeat]) -> Answered:
    return p.Ok()


def _register(engine: RouteHost, call: Call[p.Register]) -> Answered:
    with engine.lock.hold(call.operation):
        return engine.handshake.register(call.client, call.request)


def _goodbye(engine: RouteHost, call: Call[p.Goodbye]) -> Answered:
    with engine.lock.hold(call.operation):
        engine.goodbye(call.client.client_id)
    return p.Ok()


# -- lookups -----------------------------------------------------------------------------------


def _lookup(engine: RouteHost, call: Call[p.Lookup]) -> Answered:
    """Name the prompt's chunks (no lock), then look them up (see `LookupBook`)."""
    req, client = call.request, call.client
    if req.world_size < 1:
        raise InvalidArgumentError(f"world_size must be >= 1, got {req.world_size}")
    # The prompt's own tokens and hashes: another request of this id may be setting its
    # session's tokens to another prompt right now (see `naming.py`).
    session, hashes = engine.session_book.session(req.request_id, req.tokens)
    num_tokens = len(req.tokens) // 4
    keys = naming.chunk_keys(
        session, hashes, req.model, req.cache_salt, req.world_size, extra_key=req.extra_key
    )
    layout = engine.layouts.get(req.model, req.world_size)
    with engine.lock.hold(call.operation):
        return engine.lookups.lookup(
            req, keys, num_tokens, layout, call.answer, tenant=client.tenant, owner=client.client_id
        )


def _poll(engine: RouteHost, call: Call[p.LookupPoll]) -> Answered:
    with engine.lock.hold(call.operation):
        return engine.lookups.poll(call.request, call.answer)


def _exists_keys(engine: RouteHost, call: Call[p.ExistsKeys]) -> Answered:
    """Name the chunks (no lock), then count them (see `LookupBook.exists`)."""
    req = call.request
    keys = named_chunk_keys(
        req.names,
        model=req.model,
        cache_salt=req.cache_salt,
        world_size=req.world_size,
        extra_key=req.extra_key,
    )
    layout = engine.layouts.get(req.model, req.world_size)
    with engine.lock.hold(call.operation):
        return engine.lookups.exists(
            keys,
            layout,
            call.answer,
            tenant=call.client.tenant,
            each=req.each,
            prefill_tokens_per_s=req.prefill_tokens_per_s,
        )


# -- stores ------------------------------------------------------------------------------------


def _reserve(engine: RouteHost, call: Call[p.Reserve]) -> Answered:
    req, client = call.request, call.client
    # refuse a bad array before its session is made and its tokens counted
    engine.layouts.check(req.model, req.world_size, req.worker_id, req.chunk_shape, req.dtype)
    keys, parent = engine.session_book.range_chain(req)
    return engine.stores.reserve(client.client_id, req, keys, client.watch, parent)


def _reserve_keys(engine: RouteHost, call: Call[p.ReserveKeys]) -> Answered:
    keys = engine.session_book.range_keys(call.request)
    return engine.stores.reserve(call.client.client_id, call.request, keys, call.client.watch)


def _commit(engine: RouteHost, call: Call[p.Commit]) -> Answered:
    with engine.lock.hold(call.operation):
        committed = engine.stores.commit(call.client.client_id, call.request.reservation_id)
    return engine.stores.write_committed(committed, call.answer)


def _abort(engine: RouteHost, call: Call[p.Abort]) -> Answered:
    with engine.lock.hold(call.operation):
        return engine.stores.abort(call.client.client_id, call.request.reservation_id)


def _store_inline(
    engine: RouteHost, call: Call[p.StoreInline] | Call[p.StoreKeysInline]
) -> Answered:
    return engine.stores.store_inline(
        call.client.client_id, call.request, call.payloads, call.answer
    )


# -- retrieves ---------------------------------------------------------------------------------


def _retrieve(engine: RouteHost, call: Call[p.Retrieve] | Call[p.RetrieveKeys]) -> Answered:
    return engine.retrieves.retrieve(call.client.client_id, call.request, call.client.watch)


def _retrieve_done(engine: RouteHost, call: Call[p.RetrieveDone]) -> Answered:
    with engine.lock.hold(call.operation):
        return engine.retrieves.done(call.client.client_id, call.request.lease_id)


def _end_handoff(engine: RouteHost, call: Call[p.EndHandoff]) -> Answered:
    """Drop the hand-off's chunks from L1 (under the lock), then from the L2 tiers."""
    req = call.request
    keys = named_chunk_keys(
        req.names,
        model=req.model,
        cache_salt=req.cache_salt,
        world_size=req.world_size,
        extra_key=req.extra_key,
    )
    holder = engine.handoffs.holder(call.client.tenant, req.request_id)
    with engine.lock.hold(call.operation):
        gone = engine.handoffs.end(holder, keys)
    engine.handoffs.delete_l2(gone)
    return p.Ok()


# -- sessions ----------------------------------------------------------------------------------


def _release(engine: RouteHost, call: Call[p.Release]) -> Answered:
    engine.session_book.require(call.request.request_id)
    with engine.lock.hold(call.operation):
        engine.l1.unpin(call.request.request_id)
    return p.Ok()


def _end_session(engine: RouteHost, call: Call[p.EndSession]) -> Answered:
    engine.session_book.require(call.request.request_id)
    with engine.lock.hold(call.operation):
        engine.session_book.remove(call.request.request_id)
    return p.Ok()


def _by_prompt(
    request: type[tenants.Scoped],
    bounds: Callable[[Limits, tenants.Scoped], None],
    handle: Callable[[RouteHost, Call[tenants.Scoped]], Answered],
    *,
    offloaded: Callable[[tenants.Scoped, int], bool] = _long_prompt,
    watched: Callable[[tenants.Scoped], bool] = _never,
) -> Route[tenants.Scoped]:
    """The route of a request about a prompt's chunks: put in its client's tenant (`tenants.scope`),
    on a handler thread from OFFLOAD_CHUNKS chunks of prompt unless `offloaded` says otherwise."""
    return Route(request, bounds, handle, offloaded=offloaded, scope=tenants.scope, watched=watched)


def _by_names(
    request: type[tenants.ScopedNames],
    bounds: Callable[[Limits, tenants.ScopedNames], None],
    handle: Callable[[RouteHost, Call[tenants.ScopedNames]], Answered],
    *,
    offloaded: Callable[[tenants.ScopedNames, int], bool] = _many_names,
    watched: Callable[[tenants.ScopedNames], bool] = _never,
) -> Route[tenants.ScopedNames]:
    """The route of a request about chunks the caller names: put in its client's tenant
    (`tenants.scope_names`), on a handler thread from OFFLOAD_NAMES names unless `offloaded` says
    otherwise."""
    return Route(
        request, bounds, handle, offloaded=offloaded, scope=tenants.scope_names, watched=watched
    )


# -- the table ---------------------------------------------------------------------------------

#: one route per member of `protocol.Request` (a unit test holds every one to exactly one)
ROUTES: tuple[Route[Any], ...] = (
    # handshake
    Route(p.Hello, Limits.hello, _hello, connected=False),
    Route(p.Heartbeat, Limits.nothing, _heartbeat),
    Route(p.Register, Limits.register, _register),
    Route(p.Goodbye, Limits.nothing, _goodbye),
    # lookups
    _by_prompt(p.Lookup, Limits.lookup, _lookup),
    Route(p.LookupPoll, Limits.poll, _poll, scope=tenants.scope_session),
    _by_names(p.ExistsKeys, Limits.exists, _exists_keys),
    # stores
    _by_prompt(p.Reserve, Limits.store, _reserve, watched=_always),
    _by_names(p.ReserveKeys, Limits.named, _reserve_keys, watched=_always),
    Route(p.Commit, Limits.nothing, _commit),
    Route(p.Abort, Limits.nothing, _abort),
    _by_prompt(p.StoreInline, Limits.store, _store_inline, offloaded=_bytes_inline),
    _by_names(p.StoreKeysInline, Limits.named, _store_inline, offloaded=_bytes_inline),
    # retrieves
    _by_prompt(
        p.Retrieve,
        Limits.retrieve,
        _retrieve,
        offloaded=_retrieve_offloaded,
        watched=_unless_inline,
    ),
    _by_names(
        p.RetrieveKeys,
        Limits.named,
        _retrieve,
        offloaded=_retrieve_keys_offloaded,
        watched=_unless_inline,
    ),
    Route(p.RetrieveDone, Limits.nothing, _retrieve_done),
    _by_names(p.EndHandoff, Limits.end_handoff, _end_handoff, offloaded=_always_offloaded),
    # sessions
    Route(p.Release, Limits.session, _release, scope=tenants.scope_session),
    Route(p.EndSession, Limits.session, _end_session, scope=tenants.scope_session),
)

_BY_TYPE: dict[type, Route[Any]] = {route.request: route for route in ROUTES}


def route_of(req: object) -> Route[Any]:
    """The route of a decoded request."""
    route = _BY_TYPE.get(type(req))
    if route is None:
        raise InternalError(f"no handler for {type(req).__name__}")
    return route

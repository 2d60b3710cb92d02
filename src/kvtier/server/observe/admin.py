"""The admin HTTP API: health, status, sessions, threads, Prometheus metrics, cache clearing and
the status page, served by uvicorn on a background thread of the server process.

Every backend call may wait for the engine lock, so handlers run it on the thread pool rather
than on the event loop.

Access, per route (`ACCESS`): `/health`, the page and its assets are always open (probes must not
need a secret; the page holds no data). Reads (status, sessions, metrics...) are open on loopback
when no `--admin-token` was given, and need the token otherwise. Changes (clear, ending a session)
always need the token: without `--admin-token` the server generates one into a 0600 file that
`kvtier clear` reads (`kvtier.config.admin_token_file`). The token travels in an
`Authorization: Bearer` header, or, for the page's reads, in an HttpOnly SameSite=Strict cookie
set by `POST /login`; never in a URL.

Bounds: a request body (`/clear`, `/login`) is at most `MAX_BODY_BYTES` (413 beyond, read no
further), and JSON nested too deeply is a 400. When reads are open (loopback, no
`--admin-token`), a request whose `Host` is not a loopback name or address gets 403: a web page
that rebinds its own DNS name to 127.0.0.1 can make a browser connect, but not with
`Host: localhost`, so it cannot read `/sessions` or `/status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from kvtier._version import __version__
from kvtier.config import ADMIN_TOKEN_ENV
from kvtier.periodic import PeriodicThreadRegistry
from kvtier.server.observe.http_cap import capped_protocol
from kvtier.server.observe.metrics import Metrics
from kvtier.server.observe.snapshots import Health, ServerStatus, SessionInfo, TierChunks

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"
COOKIE = "kvtier_admin"
DEFAULT_SESSIONS_LIMIT = 50
MAX_SESSIONS_LIMIT = 1000
DEFAULT_CHUNKS_LIMIT = 10_000
MAX_CHUNKS_LIMIT = 1_000_000
#: connections waiting to be accepted, and accepted in one round (see start_admin_server)
_ACCEPT_BACKLOG = 32
#: the largest admin request body read (the bodies are a few small JSON fields)
MAX_BODY_BYTES = 64 << 10

T = TypeVar("T")


class AdminBackend(Protocol):
    """What the admin API reads from and acts on: the server engine."""

    metrics: Metrics

    def health(self) -> Health:
        """ok, degraded (serving with a failing part) or unavailable, with the reasons."""
        ...

    def status(self) -> ServerStatus:
        """The typed snapshot of the whole server."""
        ...

    def list_sessions(self, offset: int, limit: int) -> tuple[int, list[SessionInfo]]:
        """(total, one page of sessions, newest first)."""
        ...

    def get_session(self, request_id: str) -> SessionInfo | None:
        """The session named `request_id`, or None."""
        ...

    def end_session(self, request_id: str) -> bool:
        """End the session named `request_id`; False if there was none."""
        ...

    def clear(
        self, *, model: str | None = None, cache_salt: str | None = None, tenant: str = ""
    ) -> int:
        """Drop cached chunks matching the filters (None = any) from L1 and L2; how many."""
        ...

    def chunks(self, tier: str, limit: int) -> TierChunks | None:
        """The complete chunk groups `tier` holds (None: no such tier, or it cannot list)."""
        ...


class BadRequestError(ValueError):
    """Admin API input the server refuses; becomes a 400 reply naming the parameter."""


async def _json_body(request: Request) -> Any:
    """The request's JSON body (None when empty), read only up to MAX_BODY_BYTES: a bigger one
    is a 413, whatever its Content-Length says; bad or too deeply nested JSON is a 400."""
    too_large = HTTPException(
        413, f"request body larger than {MAX_BODY_BYTES} bytes: the admin API takes small JSON"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequestError("request body is JSON nested too deeply") from None


# -- route table ---------------------------------------------------------------------------------

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class _Endpoint:
    """One route and its OpenAPI operation, so the served schema cannot drift from the routes."""

    path: str
    method: str
    handler: Handler
    summary: str
    responses: dict[str, str]
    parameters: list[dict[str, Any]] = field(default_factory=list)
    request_body: dict[str, Any] | None = None
    content_type: str = "application/json"


def _json_error(status_code: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status_code)


def _struct_response(value: Any, status_code: int = 200) -> Response:
    """A msgspec Struct (or anything msgspec encodes) as a JSON response."""
    return Response(msgspec.json.encode(value), status_code, media_type="application/json")


def _query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    """An integer query parameter within [lo, hi]; BadRequestError names it otherwise."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequestError(f"query parameter {name!r} must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise BadRequestError(f"query parameter {name!r} must be in [{lo}, {hi}], got {value}")
    return value


class _Handlers:
    """The route handlers over one backend and one thread registry."""

    def __init__(self, backend: AdminBackend, registry: PeriodicThreadRegistry, token: str) -> None:
        self.backend = backend
        self.registry = registry
        self.token = token

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await run_in_threadpool(partial(fn, *args, **kwargs))

    async def health(self, request: Request) -> Response:
        health = await self._call(self.backend.health)
        body: dict[str, Any] = {"status": health.state}
        if health.reasons:
            body["reasons"] = health.reasons
        return JSONResponse(body, status_code=503 if health.state == "unavailable" else 200)

    async def status(self, request: Request) -> Response:
        return _struct_response(await self._call(self.backend.status))

    async def list_sessions(self, request: Request) -> Response:
        offset = _query_int(request, "offset", 0, 0, 2**62)
        limit = _query_int(request, "limit", DEFAULT_SESSIONS_LIMIT, 1, MAX_SESSIONS_LIMIT)
        total, sessions = await self._call(self.backend.list_sessions, offset, limit)
        return _struct_response(
            {"total": total, "offset": offset, "limit": limit, "sessions": sessions}
        )

    async def get_session(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        session = await self._call(self.backend.get_session, request_id)
        if session is None:
            return _json_error(404, f"no session with request_id {request_id!r}")
        return _struct_response(session)

    async def end_session(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        if not await self._call(self.backend.end_session, request_id):
            return _json_error(404, f"no session with request_id {request_id!r}")
        return JSONResponse({"ended": request_id})

    async def chunks(self, request: Request) -> Response:
        tier = request.query_params.get("tier", "l1")
        limit = _query_int(request, "limit", DEFAULT_CHUNKS_LIMIT, 0, MAX_CHUNKS_LIMIT)
        held = await self._call(self.backend.chunks, tier, limit)
        if held is None:
            return _json_error(
                404,
                f"tier {tier!r} cannot list its chunks: give tier=l1 or the name of a disk tier "
                "(see /status, l2.tiers)",
            )
        return _struct_response(held)

    async def threads(self, request: Request) -> Response:
        threads = [thread.to_dict() for thread in self.registry.get_all()]
        return JSONResponse({"threads": threads, "health": await self._call(self.registry.health)})

    async def metrics(self, request: Request) -> Response:
        body = await self._call(self.backend.metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def clear(self, request: Request) -> Response:
        body = await _json_body(request)
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise BadRequestError(f"request body must be a JSON object, got {type(body).__name__}")
        unknown = sorted(set(body) - {"model", "cache_salt", "tenant"})
        if unknown:
            raise BadRequestError(
                f"unknown fields {unknown}; expected 'model', 'cache_salt' and 'tenant'"
            )
        filters: dict[str, str | None] = {}
        for name in ("model", "cache_salt", "tenant"):
            value = body.get(name)
            if value is not None and not isinstance(value, str):
                raise BadRequestError(f"field {name!r} must be a string or null, got {value!r}")
            filters[name] = value
        cleared = await self._call(
            self.backend.clear,
            model=filters["model"],
            cache_salt=filters["cache_salt"],
            tenant=filters["tenant"] or "",
        )
        return JSONResponse({"cleared": cleared})

    async def index(self, request: Request) -> Response:
        page = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    async def login(self, request: Request) -> Response:
        """Trade the token for a cookie, so the page's reads carry it without a URL."""
        body = await _json_body(request)
        candidate = body.get("token") if isinstance(body, dict) else None
        if not isinstance(candidate, str) or not hmac.compare_digest(
            candidate.encode(), self.token.encode()
        ):
            return _json_error(401, "wrong token (see --admin-token, or the server's token file)")
        response = JSONResponse({"ok": True})
        response.set_cookie(
            COOKIE, cookie_value(self.token), httponly=True, samesite="strict", path="/",
            max_age=86400,
        )  # fmt: skip
        return response


def _endpoints(h: _Handlers) -> list[_Endpoint]:
    session_id = [
        {"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    return [
        _Endpoint(
            "/health",
            "GET",
            h.health,
            "Health, never behind a token: 200 `ok`; 200 `degraded` with `reasons` while an L2 "
            "tier is failing (L1 still serves); 503 `unavailable` before the arena is ready or "
            "while a critical or high periodic thread is stalled.",
            {"200": "Serving (ok or degraded).", "503": "Not serving; `reasons` says why."},
        ),
        _Endpoint(
            "/status",
            "GET",
            h.status,
            "Server snapshot: health, config (credentials redacted), L1, L2 tiers, clients, "
            "sessions, lookups per model, hit-rate history, traffic, latency, recent errors.",
            {"200": "The snapshot."},
        ),
        _Endpoint(
            "/sessions",
            "GET",
            h.list_sessions,
            "One page of sessions, newest first.",
            {"200": "{total, offset, limit, sessions}.", "400": "Bad offset or limit."},
            parameters=[
                {"name": "offset", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                {
                    "name": "limit",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_SESSIONS_LIMIT},
                },
            ],
        ),
        _Endpoint(
            "/sessions/{request_id}",
            "GET",
            h.get_session,
            "One session.",
            {"200": "The session.", "404": "No such session."},
            parameters=session_id,
        ),
        _Endpoint(
            "/sessions/{request_id}",
            "DELETE",
            h.end_session,
            "End a session and release its pins.",
            {"200": "Ended.", "404": "No such session."},
            parameters=session_id,
        ),
        _Endpoint(
            "/chunks",
            "GET",
            h.chunks,
            "The complete chunk groups one tier holds: the L1 (`tier=l1`, the default) or a "
            "tier that lists what it holds (a disk tier, by its name).",
            {
                "200": "{tier, total, chunks: [{model, cache_salt, world_size, chunk_hash}]}.",
                "400": "Bad limit.",
                "404": "No such tier, or a shared store (it cannot list its chunks).",
            },
            parameters=[
                {"name": "tier", "in": "query", "schema": {"type": "string"}},
                {
                    "name": "limit",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 0, "maximum": MAX_CHUNKS_LIMIT},
                },
            ],
        ),
        _Endpoint(
            "/threads",
            "GET",
            h.threads,
            "Every periodic background thread, and their health.",
            {"200": "{threads, health}."},
        ),
        _Endpoint(
            "/metrics",
            "GET",
            h.metrics,
            "Prometheus metrics.",
            {"200": "Prometheus text exposition format."},
            content_type=CONTENT_TYPE_LATEST,
        ),
        _Endpoint(
            "/clear",
            "POST",
            h.clear,
            "Drop cached chunks from L1 and L2, optionally only one model's and/or cache salt's.",
            {"200": "{cleared: number of chunks dropped}.", "400": "Bad body."},
            request_body={
                "required": False,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "model": {"type": ["string", "null"]},
                                "cache_salt": {"type": ["string", "null"]},
                            },
                            "additionalProperties": False,
                        }
                    }
                },
            },
        ),
        _Endpoint(
            "/",
            "GET",
            h.index,
            "The status page (it asks for the token when reads need one).",
            {"200": "HTML."},
            content_type="text/html",
        ),
        _Endpoint(
            "/login",
            "POST",
            h.login,
            "Trade the admin token for an HttpOnly cookie that the status page's reads carry.",
            {"200": "Cookie set.", "401": "Wrong token."},
            request_body={
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {"token": {"type": "string"}},
                            "required": ["token"],
                        }
                    }
                },
            },
        ),
    ]


def _openapi(endpoints: list[_Endpoint], secured: bool) -> dict[str, Any]:
    """An OpenAPI 3.1 description of `endpoints`."""
    paths: dict[str, dict[str, Any]] = {}
    for ep in endpoints:
        responses: dict[str, Any] = {}
        for code, text in ep.responses.items():
            media = ep.content_type if code.startswith("2") else "application/json"
            responses[code] = {"description": text, "content": {media: {}}}
        if secured:
            responses["401"] = {"description": "Missing or wrong bearer token."}
        operation: dict[str, Any] = {"summary": ep.summary, "responses": responses}
        if ep.parameters:
            operation["parameters"] = ep.parameters
        if ep.request_body is not None:
            operation["requestBody"] = ep.request_body
        paths.setdefault(ep.path, {})[ep.method.lower()] = operation
    schema: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "kvtier admin API", "version": __version__},
        "paths": paths,
    }
    if secured:
        schema["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
        schema["security"] = [{"bearer": []}]
    return schema


# -- auth ----------------------------------------------------------------------------------------


#: who may call a route: anyone, a reader (open on loopback without --admin-token) or the token
OPEN, READ, WRITE = "open", "read", "write"


def cookie_value(token: str) -> str:
    """What the login cookie holds: a digest of the token, not the token (cookie-safe text, and
    a leaked cookie does not give the bearer token that changes need)."""
    return hmac.new(token.encode(), b"kvtier admin cookie", "sha256").hexdigest()


def access_of(method: str, path: str) -> str:
    """The access level a request needs (see the module docstring)."""
    if path in ("/health", "/", "/login") or path.startswith("/static/"):
        return OPEN
    return READ if method in ("GET", "HEAD") else WRITE


def _loopback_host(scope: Scope) -> bool:
    """Whether the request's Host header names this machine's loopback (a request without one,
    HTTP/1.0, came from no browser: allowed); /health is for probes and always answered."""
    if scope["path"] == "/health":
        return True
    for name, value in scope["headers"]:
        if name == b"host":
            return is_loopback_name(value.decode("latin-1"))
    return True


def is_loopback_name(host: str) -> bool:
    """True for a Host header value naming loopback: localhost, 127.x.y.z or [::1], with or
    without a port."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        port = host[end + 1 :].removeprefix(":") if end >= 0 else "x"
        if end < 0 or (port and not port.isdigit()) or host[end + 1 :] == ":":
            return False
        name = host[1:end]
    else:
        name, _, port = host.partition(":")
        if port and not port.isdigit():
            return False
    if name in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class _TokenAuth:
    """ASGI middleware enforcing `access_of`: the token from a bearer header, or (for reads) the
    cookie `POST /login` sets."""

    def __init__(self, app: ASGIApp, token: str, open_reads: bool) -> None:
        self.app = app
        self._token = token.encode()
        self._cookie = cookie_value(token).encode()
        self._open_reads = open_reads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._open_reads and not _loopback_host(scope):
            forbidden = JSONResponse(
                {
                    "error": "forbidden: without --admin-token the admin API answers only "
                    "requests addressed to a loopback name (Host: localhost, 127.0.0.1, [::1])"
                },
                status_code=403,
            )
            await forbidden(scope, receive, send)
            return
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            {
                "error": "unauthorized: send 'Authorization: Bearer <token>' (--admin-token, or "
                "the token file the server wrote at start)"
            },
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="kvtier"'},
        )
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        access = access_of(scope["method"], scope["path"])
        if access == OPEN or (access == READ and self._open_reads):
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, credential = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(
                    credential.strip(), self._token
                ):
                    return True
            elif name == b"cookie" and access == READ:
                for part in value.split(b";"):
                    key, _, cookie = part.strip().partition(b"=")
                    if key == COOKIE.encode() and hmac.compare_digest(cookie, self._cookie):
                        return True
        return False


# -- the app -------------------------------------------------------------------------------------


def create_admin_app(
    backend: AdminBackend,
    *,
    token: str,
    open_reads: bool = False,
    registry: PeriodicThreadRegistry | None = None,
) -> Starlette:
    """The admin ASGI app over `backend`; `registry` (default: the process-wide one) gives
    thread health. `token` guards changes always and reads unless `open_reads`."""
    if not token:
        raise ValueError(f"the admin token must not be empty (--admin-token / {ADMIN_TOKEN_ENV})")
    handlers = _Handlers(
        backend, registry if registry is not None else PeriodicThreadRegistry.get_instance(), token
    )
    endpoints = _endpoints(handlers)
    schema = _openapi(endpoints, secured=True)

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema)

    routes: list[BaseRoute] = [
        Route(ep.path, ep.handler, methods=[ep.method], name=f"{ep.method} {ep.path}")
        for ep in endpoints
    ]
    routes.append(Route("/openapi.json", openapi, methods=["GET"], include_in_schema=False))
    routes.append(Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        reads = "open on loopback" if open_reads else "need the token"
        logger.info("admin API up (reads %s)", reads)
        yield
        logger.info("admin API down")

    async def bad_request(request: Request, exc: Exception) -> Response:
        return _json_error(400, str(exc))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={BadRequestError: bad_request, HTTPException: http_error},
    )
    app.add_middleware(_TokenAuth, token=token, open_reads=open_reads)
    return app


# -- serving -------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """True when `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


class AdminServer:
    """A running admin API: uvicorn on a daemon thread. Use `start_admin_server` to make one."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, host: str, token: str) -> None:
        self._server = server
        self._socket = sock
        self.host = host
        self.token = token  # what the changing routes need (generated unless configured)
        self.port: int = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name="kvtier-admin-http", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """Where a client on this machine reaches the API (wildcard binds map to loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._socket]))
        except BaseException as exc:  # SystemExit too: uvicorn exits on a failed startup
            self._error = exc
            logger.exception("admin HTTP server stopped with an error")

    def _start(self, timeout: float) -> None:
        self._thread.start()
        waited = 0.0
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the admin HTTP server failed to start: {self._error!r}")
            if waited >= timeout:
                self.stop()
                raise RuntimeError(f"the admin HTTP server did not start within {timeout}s")
            self._thread.join(0.01)
            waited += 0.01

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and wait up to `timeout` s for open requests; idempotent."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> AdminServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def check_admin_exposure(host: str, token: str | None) -> None:
    """ValueError when the admin API would be open to other machines without a configured token."""
    if not is_loopback(host) and token is None:
        raise ValueError(
            f"the admin API would listen on {host!r}, reachable from other machines, without a "
            f"token: set --admin-token or {ADMIN_TOKEN_ENV}, or bind --admin-host 127.0.0.1"
        )


def start_admin_server(
    backend: AdminBackend,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    *,
    registry: PeriodicThreadRegistry | None = None,
    startup_timeout: float = 10.0,
    max_connections: int = 64,
) -> AdminServer:
    """Serve the admin API on host:port (0 = a free port) from a background thread.

    With `token` None (no --admin-token) a random one guards the changing routes; read it from
    `AdminServer.token` (the server writes it to its token file). Off loopback a configured token
    is mandatory: reads would otherwise be open to other machines. At most `max_connections`
    connections are held at once (see `http_cap.py`).
    """
    check_admin_exposure(host, token)
    if not 0 <= port <= 65535:
        raise ValueError(f"admin port must be in [0, 65535] (--admin-port), got {port}")
    effective = token if token is not None else secrets.token_urlsafe(32)
    app = create_admin_app(backend, token=effective, open_reads=token is None, registry=registry)
    # uvicorn's backlog is also how many connections one accept round takes before their
    # protocols run (and close those past the cap): kept small, so a burst of connections
    # holds only a few descriptors more than the cap, for a moment
    backlog = min(_ACCEPT_BACKLOG, max_connections)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno,
            f"cannot listen on {host}:{port} for the admin API (--admin-port): "
            f"{exc.strerror or exc}",
        ) from exc
    config = uvicorn.Config(
        app,
        http=capped_protocol(max_connections),
        backlog=backlog,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=2,
    )
    server = AdminServer(uvicorn.Server(config), sock, host, effective)
    server._start(startup_timeout)
    return server

"""The admin HTTP API: health, status, sessions, threads, Prometheus metrics, cache clearing and
the status page, served by uvicorn on a background thread of the server process.

`create_admin_app` assembles the app from its parts: the handlers over the server engine
(`admin_handlers`), the route table and its OpenAPI description (`admin_endpoints`) and the
access rules with the middleware that enforces them (`admin_access`). `start_admin_server` serves
it; off loopback a configured token is mandatory (`check_admin_exposure`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import socket
import threading
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from kvtier.config import ADMIN_TOKEN_ENV
from kvtier.periodic import PeriodicThreadRegistry
from kvtier.server.observe.admin_access import TokenAuth
from kvtier.server.observe.admin_endpoints import endpoint_table, openapi_schema
from kvtier.server.observe.admin_handlers import (
    STATIC_DIR,
    AdminBackend,
    AdminHandlers,
    BadRequestError,
    json_error,
)
from kvtier.server.observe.http_cap import capped_protocol

__all__ = [
    "AdminServer", "check_admin_exposure", "create_admin_app", "is_loopback", "start_admin_server",
]  # fmt: skip

logger = logging.getLogger(__name__)

#: connections waiting to be accepted, and accepted in one round (see start_admin_server)
_ACCEPT_BACKLOG = 32


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
    handlers = AdminHandlers(
        backend, registry if registry is not None else PeriodicThreadRegistry.get_instance(), token
    )
    endpoints = endpoint_table(handlers)
    schema = openapi_schema(endpoints, secured=True)

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
        return json_error(400, str(exc))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={BadRequestError: bad_request, HTTPException: http_error},
    )
    app.add_middleware(TokenAuth, token=token, open_reads=open_reads)
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

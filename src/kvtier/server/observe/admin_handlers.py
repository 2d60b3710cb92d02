"""The admin API's route handlers over the server engine (`AdminBackend`).

Every backend call may wait for the engine lock, so handlers run it on the thread pool rather
than on the event loop. A request body (`/clear`, `/login`) is at most `MAX_BODY_BYTES` (413
beyond, read no further), and JSON nested too deeply is a 400.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from kvtier.periodic import PeriodicThreadRegistry
from kvtier.server.observe.admin_access import COOKIE, cookie_value
from kvtier.server.observe.metrics import Metrics
from kvtier.server.observe.snapshots import Health, ServerStatus, SessionInfo, TierChunks

__all__ = [
    "MAX_BODY_BYTES", "MAX_CHUNKS_LIMIT", "MAX_SESSIONS_LIMIT", "STATIC_DIR", "AdminBackend",
    "AdminHandlers", "BadRequestError", "json_error",
]  # fmt: skip

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"
DEFAULT_SESSIONS_LIMIT = 50
MAX_SESSIONS_LIMIT = 1000
DEFAULT_CHUNKS_LIMIT = 10_000
MAX_CHUNKS_LIMIT = 1_000_000
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


def json_error(status_code: int, message: str) -> JSONResponse:
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


class AdminHandlers:
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
            return json_error(404, f"no session with request_id {request_id!r}")
        return _struct_response(session)

    async def end_session(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        if not await self._call(self.backend.end_session, request_id):
            return json_error(404, f"no session with request_id {request_id!r}")
        return JSONResponse({"ended": request_id})

    async def chunks(self, request: Request) -> Response:
        tier = request.query_params.get("tier", "l1")
        limit = _query_int(request, "limit", DEFAULT_CHUNKS_LIMIT, 0, MAX_CHUNKS_LIMIT)
        held = await self._call(self.backend.chunks, tier, limit)
        if held is None:
            return json_error(
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
            return json_error(401, "wrong token (see --admin-token, or the server's token file)")
        response = JSONResponse({"ok": True})
        response.set_cookie(
            COOKIE, cookie_value(self.token), httponly=True, samesite="strict", path="/",
            max_age=86400,
        )  # fmt: skip
        return response

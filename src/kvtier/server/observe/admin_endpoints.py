"""The admin API's route table (`Endpoint`s over the handlers), and the OpenAPI description
built from that same table, so the served schema cannot drift from the routes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from kvtier._version import __version__
from kvtier.server.observe.admin_handlers import (
    MAX_CHUNKS_LIMIT,
    MAX_SESSIONS_LIMIT,
    AdminHandlers,
)

__all__ = ["Endpoint", "Handler", "endpoint_table", "openapi_schema"]

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Endpoint:
    """One route and its OpenAPI operation, so the served schema cannot drift from the routes."""

    path: str
    method: str
    handler: Handler
    summary: str
    responses: dict[str, str]
    parameters: list[dict[str, Any]] = field(default_factory=list)
    request_body: dict[str, Any] | None = None
    content_type: str = "application/json"


def endpoint_table(h: AdminHandlers) -> list[Endpoint]:
    """Every admin route, each served by one of `h`'s handlers."""
    session_id = [
        {"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    return [
        Endpoint(
            "/health",
            "GET",
            h.health,
            "Health, never behind a token: 200 `ok`; 200 `degraded` with `reasons` while an L2 "
            "tier is failing (L1 still serves); 503 `unavailable` before the arena is ready or "
            "while a critical or high periodic thread is stalled.",
            {"200": "Serving (ok or degraded).", "503": "Not serving; `reasons` says why."},
        ),
        Endpoint(
            "/status",
            "GET",
            h.status,
            "Server snapshot: health, config (credentials redacted), L1, L2 tiers, clients, "
            "sessions, lookups per model, hit-rate history, traffic, latency, recent errors.",
            {"200": "The snapshot."},
        ),
        Endpoint(
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
        Endpoint(
            "/sessions/{request_id}",
            "GET",
            h.get_session,
            "One session.",
            {"200": "The session.", "404": "No such session."},
            parameters=session_id,
        ),
        Endpoint(
            "/sessions/{request_id}",
            "DELETE",
            h.end_session,
            "End a session and release its pins.",
            {"200": "Ended.", "404": "No such session."},
            parameters=session_id,
        ),
        Endpoint(
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
        Endpoint(
            "/threads",
            "GET",
            h.threads,
            "Every periodic background thread, and their health.",
            {"200": "{threads, health}."},
        ),
        Endpoint(
            "/metrics",
            "GET",
            h.metrics,
            "Prometheus metrics.",
            {"200": "Prometheus text exposition format."},
            content_type=CONTENT_TYPE_LATEST,
        ),
        Endpoint(
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
        Endpoint(
            "/",
            "GET",
            h.index,
            "The status page (it asks for the token when reads need one).",
            {"200": "HTML."},
            content_type="text/html",
        ),
        Endpoint(
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


def openapi_schema(endpoints: list[Endpoint], secured: bool) -> dict[str, Any]:
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

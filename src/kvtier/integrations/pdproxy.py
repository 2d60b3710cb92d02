"""`kvtier pd-proxy`: an OpenAI-compatible front for prefill/decode disaggregation through kvtier.

Each completion or chat request goes first to a prefill instance (vLLM with KVTierConnector,
`kv_role` `kv_producer`) with one output token and `kv_transfer_params` naming a new hand-off;
the prefill instance stores the prompt's KV in kvtier and answers with the hand-off's params,
which go with the original request to a decode instance (`kv_role` `kv_consumer`): it loads the
prompt's KV from kvtier and generates, streaming or not, as the client asked. Instances are taken
round-robin. A failure is a clear HTTP error: 502 when an instance cannot be reached or answers
without a hand-off, the instance's own status and message when it refuses the request.

A convenience for tests and small deployments; a router (llm-d, Dynamo) drives the same
connector roles with the same `kv_transfer_params` (docs/vllm.md).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = ["build_app", "serve"]

#: what a prefill request's params ask for (the prefill instance names its hand-off after it)
HANDOFF_KEY = "kvtier_handoff"


def _error(status: int, message: str, kind: str = "pd_proxy_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


class _Pool:
    """Round-robin over one kind of instance."""

    def __init__(self, kind: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"pd-proxy needs at least one {kind} instance")
        self.kind = kind
        self._urls = itertools.cycle([u.rstrip("/") for u in urls])

    def next(self) -> str:
        return next(self._urls)


class _Upstream(Exception):
    def __init__(self, response: JSONResponse) -> None:
        super().__init__()
        self.response = response


def build_app(
    prefill: Sequence[str], decode: Sequence[str], *, timeout: float = 600.0
) -> Starlette:
    """The proxy's ASGI app."""
    prefills, decodes = _Pool("prefill", prefill), _Pool("decode", decode)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0))

    async def send(kind: str, url: str, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST without streaming; unreachable is a 502 naming the instance."""
        try:
            return await client.post(url + path, json=body)
        except httpx.HTTPError as exc:
            raise _Upstream(
                _error(502, f"{kind} instance {url} is unreachable: {type(exc).__name__}: {exc}")
            ) from None

    def refused(kind: str, url: str, reply: httpx.Response) -> JSONResponse:
        try:
            detail = reply.json()
        except ValueError:
            detail = reply.text[:2000]
        message = f"{kind} instance {url} answered {reply.status_code}: {json.dumps(detail)}"
        return _error(reply.status_code if reply.status_code >= 400 else 502, message)

    async def prefill_step(path: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """Run the prompt on a prefill instance; the hand-off's params and the instance."""
        url = prefills.next()
        ask = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        ask.update(max_tokens=1, stream=False, n=1)
        if "max_completion_tokens" in ask:
            ask["max_completion_tokens"] = 1
        ask["kv_transfer_params"] = {HANDOFF_KEY: f"pd-{uuid.uuid4().hex}"}
        reply = await send("prefill", url, path, ask)
        if reply.status_code != 200:
            raise _Upstream(refused("prefill", url, reply))
        params = reply.json().get("kv_transfer_params")
        if not isinstance(params, dict) or HANDOFF_KEY not in params:
            raise _Upstream(
                _error(
                    502,
                    f"prefill instance {url} answered without a kvtier hand-off in its "
                    "kv_transfer_params: start it with KVTierConnector and kv_role kv_producer",
                )
            )
        return params, url

    async def relay(request: Request) -> Response:
        path = request.url.path
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        try:
            params, prefill_url = await prefill_step(path, body)
        except _Upstream as exc:
            return exc.response
        url = decodes.next()
        headers = {"x-kvtier-prefill": prefill_url, "x-kvtier-decode": url}
        decode_body = {**body, "kv_transfer_params": params}
        if not body.get("stream"):
            try:
                reply = await send("decode", url, path, decode_body)
            except _Upstream as exc:
                return exc.response
            if reply.status_code != 200:
                return refused("decode", url, reply)
            return Response(reply.content, 200, headers=headers, media_type="application/json")
        try:
            upstream = await client.send(
                client.build_request("POST", url + path, json=decode_body), stream=True
            )
        except httpx.HTTPError as exc:
            return _error(502, f"decode instance {url} is unreachable: {exc}")
        if upstream.status_code != 200:
            await upstream.aread()
            await upstream.aclose()
            return refused("decode", url, upstream)

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in upstream.aiter_raw():
                yield chunk

        return StreamingResponse(
            chunks(),
            media_type=upstream.headers.get("content-type", "text/event-stream"),
            headers=headers,
            background=BackgroundTask(upstream.aclose),
        )

    async def models(request: Request) -> Response:
        url = decodes.next()
        try:
            reply = await client.get(url + "/v1/models")
        except httpx.HTTPError as exc:
            return _error(502, f"decode instance {url} is unreachable: {exc}")
        return Response(reply.content, reply.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse({"prefill": prefill, "decode": decode})

    return Starlette(
        routes=[
            Route("/v1/completions", relay, methods=["POST"]),
            Route("/v1/chat/completions", relay, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lambda app: _closing(client),
    )


@contextlib.asynccontextmanager
async def _closing(client: httpx.AsyncClient) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await client.aclose()


def serve(prefill: Sequence[str], decode: Sequence[str], *, host: str, port: int) -> None:
    """Run the proxy until interrupted."""
    import uvicorn

    uvicorn.run(build_app(prefill, decode), host=host, port=port, log_level="warning")

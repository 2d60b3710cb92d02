"""Who may call which admin route, and the middleware that enforces it.

Access, per route (`access_of`): `/health`, the page and its assets are always open (probes must
not need a secret; the page holds no data). Reads (status, sessions, metrics...) are open on
loopback when no `--admin-token` was given, and need the token otherwise. Changes (clear, ending
a session) always need the token: without `--admin-token` the server generates one into a 0600
file that `kvtier clear` reads (`kvtier.config.admin_token_file`). The token travels in an
`Authorization: Bearer` header, or, for the page's reads, in an HttpOnly SameSite=Strict cookie
set by `POST /login`; never in a URL.

When reads are open (loopback, no `--admin-token`), a request whose `Host` is not a loopback
name or address gets 403: a web page that rebinds its own DNS name to 127.0.0.1 can make a
browser connect, but not with `Host: localhost`, so it cannot read `/sessions` or `/status`.
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = [
    "COOKIE", "OPEN", "READ", "WRITE", "TokenAuth", "access_of", "cookie_value",
    "is_loopback_name",
]  # fmt: skip

COOKIE = "kvtier_admin"


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


class TokenAuth:
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

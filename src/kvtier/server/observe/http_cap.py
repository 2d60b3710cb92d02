"""The admin API's connections, bounded: at most `--max-admin-connections` at once, and none
kept open without a request.

uvicorn holds a connection that never sends a byte for as long as the peer likes (its
keep-alive timeout starts only after a first response) and has no bound on connections
(`limit_concurrency` answers 503, on a connection already accepted and kept). Every connection
is a descriptor of the server process, which the engines need (see `server/descriptors.py`).
So the protocol uvicorn runs per connection is wrapped: at the cap, a new connection makes the
oldest one that has not sent a request's headers yet give way (or, when every connection is
serving a request, is closed itself as soon as it is accepted), and a connection that has not
sent a whole request's headers within `IDLE_S` seconds of being accepted is closed. Idle
connections, however many a peer opens, cannot keep a client that sends its request at once
from being served.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

__all__ = ["IDLE_S", "capped_protocol"]

#: seconds a new admin connection has to send a request's headers
IDLE_S = 10.0


def capped_protocol(max_connections: int, idle_s: float = IDLE_S) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class, holding at most `max_connections` connections at once
    and closing those idle `idle_s` seconds after they were accepted without a request."""
    base: Any = AutoHTTPProtocol

    open_order: dict[Any, None] = {}  # the connections, oldest first

    class Capped(base):  # type: ignore[misc,valid-type]
        refused = 0  # connections closed at the cap, over the server's life

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                type(self).refused += 1
                idle = next((c for c in open_order if c.cycle is None), None)
                if idle is None:
                    transport.abort()  # the descriptor is given back now
                    return
                del open_order[idle]
                idle.transport.abort()
            open_order[self] = None
            self._idle_timer = self.loop.call_later(idle_s, self._close_if_idle)

        def _close_if_idle(self) -> None:
            if self.cycle is None and self.transport is not None:
                self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            timer = getattr(self, "_idle_timer", None)
            if timer is not None:
                timer.cancel()
            open_order.pop(self, None)
            super().connection_lost(exc)

    return Capped

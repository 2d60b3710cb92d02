"""How the engine answers a request: exactly once, now or later, from any thread.

`Answer` wraps the transport's `respond` callback, times the request for the metrics and turns
any exception into a typed error reply. Which requests are answered later, or from a handler
thread, each request's route says (`routes.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvtier import protocol as p
from kvtier.errors import InternalError, KVTierError
from kvtier.server.observe.metrics import Metrics

__all__ = ["Answer", "Respond"]

logger = logging.getLogger(__name__)

#: how a request is answered: the reply's frames, header first; called exactly once
Respond = Callable[[list[Any]], None]

#: what the engine records about an error reply (recent errors, counters)
RecordError = Callable[[str, KVTierError], None]


class Answer:
    """Answers one request exactly once, now or later, from any thread; times it."""

    __slots__ = ("_metrics", "_record_error", "_respond", "_t0", "operation")

    def __init__(self, metrics: Metrics, record_error: RecordError, respond: Respond) -> None:
        self._metrics = metrics
        self._record_error = record_error
        self._respond = respond
        self._t0 = time.perf_counter()
        self.operation = "unknown"

    def frames(self, frames: list[Any]) -> None:
        self._metrics.observe_request(self.operation, time.perf_counter() - self._t0)
        self._respond(frames)

    def reply(self, reply: p.Reply) -> None:
        self.frames([p.encode(reply)])

    def error(self, exc: BaseException) -> None:
        if not isinstance(exc, KVTierError):  # a bug: still answer, so no client times out
            logger.error("handler for %s failed", self.operation, exc_info=exc)
            exc = InternalError(f"{self.operation} failed inside the server: {exc!r}")
        self._record_error(self.operation, exc)
        self.frames([p.error_reply(exc)])

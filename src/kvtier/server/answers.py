"""How the engine answers a request: exactly once, now or later, from any thread.

`Answer` wraps the transport's `respond` callback, times the request for the metrics and turns
any exception into a typed error reply. `offloaded` is the routing rule: which requests are long
work that a handler thread takes, so the transport thread only decodes, routes and replies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvtier import protocol as p
from kvtier.errors import InternalError, KVTierError
from kvtier.server.observe.metrics import Metrics

__all__ = ["Answer", "Respond", "offloaded"]

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


#: prompts of at least this many chunks are hashed and named on a handler thread (with 256-token
#: chunks, 64k tokens). A shorter one stays on the transport thread: its work (2-3 us a chunk:
#: hashing, naming, the L1) ends within the GIL's 1 ms switch interval, and a handler thread
#: holds the GIL while it hashes, so handing it off would let no other request in sooner; it
#: would only add two thread hand-offs (~0.1 ms each), more than a 16k-token lookup's work.
_OFFLOAD_CHUNKS = 256
#: key-addressed requests with at least this many names (about 1 ms of name hashing) likewise
_OFFLOAD_NAMES = 256


def offloaded(req: p.Request, chunk_size: int) -> bool:
    """Whether a request is long work: a big prompt to hash, or KV bytes to move inline."""
    long_prompt = _OFFLOAD_CHUNKS * chunk_size * 4  # bytes of packed uint32 tokens
    match req:
        case p.StoreInline():
            return True
        case p.Retrieve():
            return req.inline or len(req.tokens) >= long_prompt
        case p.Lookup() | p.Reserve():
            return len(req.tokens) >= long_prompt
        case p.StoreKeysInline():
            return True
        case p.RetrieveKeys():
            return req.inline or len(req.names) >= _OFFLOAD_NAMES
        case p.ExistsKeys() | p.ReserveKeys():
            return len(req.names) >= _OFFLOAD_NAMES
        case _:
            return False

"""`LookupHandle`: a lookup whose L2 loads may still run on the server (`Client.lookup(...,
wait=False)` returns one)."""

from __future__ import annotations

from kvtier import protocol as p
from kvtier.client.connection import Connection, NoReply, reply_as
from kvtier.errors import NotConnectedError

__all__ = ["LookupHandle"]


class LookupHandle:
    """A lookup whose L2 loads may still run on the server: `poll()` asks without waiting,
    `result()` waits on the server for the answer."""

    def __init__(
        self,
        connection: Connection,
        request_id: str,
        hit_tokens: int | None,
        cache_salt: str = "",
    ) -> None:
        self._connection = connection
        self.request_id = request_id
        self._hit_tokens = hit_tokens
        self._cache_salt = cache_salt

    @property
    def known(self) -> bool:
        """Whether the hit is known here already (`poll` then asks the server nothing)."""
        return self._hit_tokens is not None

    def poll(self) -> int | None:
        """The hit tokens once known, else None; one round trip at most, never waits."""
        if self._hit_tokens is None:
            poll = p.LookupPoll(self.request_id, cache_salt=self._cache_salt)
            reply, _ = self._connection.call(poll)
            done = reply_as(reply, p.LookupReply, "LookupPoll")
            if not done.pending:
                self._hit_tokens = done.hit_tokens
        return self._hit_tokens

    def result(self, timeout: float | None = None) -> int:
        """Wait until the hit is known; NotConnectedError when `timeout` seconds pass first.

        One request that the server answers when the loads end (no polling). Without a
        timeout it waits as long as the server answers heartbeats, asking again each
        `Client.timeout` seconds.
        """
        if self._hit_tokens is not None:
            return self._hit_tokens
        connection = self._connection
        poll = p.LookupPoll(self.request_id, wait=True, cache_salt=self._cache_salt)
        while True:
            wait_s = connection.timeout if timeout is None else timeout
            try:
                if wait_s <= 0:  # no time to wait: one look, then the timeout's error
                    hit = self.poll()
                    if hit is not None:
                        return hit
                    raise NoReply("no time to wait")
                reply, _ = connection.call(poll, wait_s=wait_s)
                break
            except NoReply:
                if timeout is not None:
                    raise NotConnectedError(
                        f"lookup of request {self.request_id!r} still loading from L2 after "
                        f"{timeout:g}s (LookupHandle.result(timeout=...))"
                    ) from None
                # no timeout: ask again; a server that stopped answering heartbeats meanwhile
                # makes the next call fail fast with NotConnectedError
        self._hit_tokens = reply_as(reply, p.LookupReply, "LookupPoll").hit_tokens
        return self._hit_tokens

    def __repr__(self) -> str:
        state = "pending" if self._hit_tokens is None else f"hit_tokens={self._hit_tokens}"
        return f"LookupHandle({self.request_id!r}, {state})"

"""Follows a Redis/Valkey server's own removals of a tier's objects: TTL expiry and maxmemory
evictions happen inside the server, which says so only through keyspace notifications.

The watch subscribes to the `expired` and `evicted` key events of the tier's database (one
pub/sub connection on a daemon thread) and reports each removed object of the tier's prefix to
the observer. The server must publish them: `notify-keyspace-events` must hold `E` (key events)
and `x` (expired) and `e` (evicted), e.g. `redis-server --notify-keyspace-events Exe`. The watch
never changes a server's configuration (a shared server belongs to its operator): without those
flags it logs what to set, and removals stay unseen (`watching` False). Pub/sub delivers at most
once: events published while the watch is reconnecting are lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from kvtier.keys import ObjectKey
from kvtier.storage.observers import Removal, StorageObserver

__all__ = ["KeyEventWatch"]

logger = logging.getLogger(__name__)

_NEEDED = "Exe"
_EVENTS = {b"expired": Removal.EXPIRED, b"evicted": Removal.EVICTED}
_POLL_S = 0.5
_RECONNECT_S = 1.0


def publishes_removals(flags: str) -> bool:
    """Whether a `notify-keyspace-events` value publishes expired and evicted key events."""
    flags = flags.replace("A", "g$lshzxetd")  # `A` is the alias of every class
    return "E" in flags and "x" in flags and "e" in flags


class KeyEventWatch:
    """Reports the expiry and eviction of `tier`'s objects on the server of `url` (database
    `db`) to `observer`; `parse` turns a key name into the object it names (None: not ours)."""

    def __init__(
        self,
        url: str,
        db: int,
        tier: str,
        parse: Callable[[bytes], ObjectKey | None],
        observer: StorageObserver,
        *,
        connect_timeout: float,
    ) -> None:
        self._client = redis.Redis.from_url(
            url, socket_connect_timeout=connect_timeout, socket_timeout=None
        )
        self._channels = {f"__keyevent@{db}__:{event.decode()}": r for event, r in _EVENTS.items()}
        self._tier = tier
        self._parse = parse
        self._observer = observer
        self._stop = threading.Event()
        self.watching = False  # subscribed to a server that publishes the events
        self.seen = 0  # removals of this tier's objects reported
        self.checked = threading.Event()  # set once subscribed and the server's flags read
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{tier}-watch", daemon=True)
        self._thread.start()

    def _configured(self) -> bool:
        try:
            flags = self._client.config_get("notify-keyspace-events").get(
                "notify-keyspace-events", ""
            )
        except redis.ResponseError as exc:  # CONFIG disabled (managed services): try anyway
            logger.warning("%s tier: cannot read notify-keyspace-events (%s)", self._tier, exc)
            return True
        if publishes_removals(str(flags)):
            return True
        logger.warning(
            "%s tier: the server's notify-keyspace-events is %r, so its TTL expiries and "
            "evictions are not seen (no KV events for them): set it to include %r, e.g. "
            "CONFIG SET notify-keyspace-events %s",
            self._tier, flags, _NEEDED, _NEEDED,
        )  # fmt: skip
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
            except (redis.RedisError, OSError) as exc:
                self.watching = False
                logger.warning("%s tier: key-event watch lost its connection: %s", self._tier, exc)
            self._stop.wait(_RECONNECT_S)

    def _follow(self) -> None:
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        try:
            pubsub.subscribe(*self._channels)
            self.watching = self._configured()
            self.checked.set()
            while not self._stop.is_set():
                message = pubsub.get_message(timeout=_POLL_S)
                if message is None:
                    continue
                reason = self._channels.get(_text(message["channel"]))
                if reason is None:
                    continue
                key = self._parse(message["data"])
                if key is not None:
                    self.seen += 1
                    self._observer.removed((key.chunk,), self._tier, reason)
        finally:
            pubsub.close()

    def close(self) -> None:
        """Stop the thread and close its connection."""
        self._stop.set()
        self._thread.join(timeout=2 * _POLL_S + 1)
        self._client.close()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

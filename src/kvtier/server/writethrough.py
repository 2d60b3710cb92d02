"""Hands newly committed shards to the L2 write-through queue without ever stalling the server.

A commit's shards are offered to the queue; when it has room (the usual case) the commit is
answered at once. When it is full, the `drop` policy drops them (counted) and answers at once;
the `block` policy parks them with the commit's answer on this module's own thread, which waits
for room (up to the manager's `block_timeout` per shard, then drops) and answers the commit only
then. So with a hung tier only the writers that filled the queue wait: lookups, retrieves and
handshakes of every client go on being served by the transport and handler threads.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvtier.keys import ObjectKey
from kvtier.storage.manager import TierManager

__all__ = ["Shard", "WriteThrough"]

logger = logging.getLogger(__name__)


class Shard(NamedTuple):
    """One shard to write: its name, bytes (held in L1 until `on_done`), layout, and whether
    it is a resume point."""

    key: ObjectKey
    data: memoryview
    layout: str
    on_done: Callable[[], None]
    resumable: bool = True


_STOP = None


class WriteThrough:
    """Offers shards to the tier manager's queue; parks them on a thread when it is full."""

    def __init__(self, tiers: TierManager) -> None:
        self._tiers = tiers
        self._parked: queue.SimpleQueue[tuple[list[Shard], Callable[[], None]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.parked_commits = 0  # commits that had to wait for room (block policy)

    def write(self, shards: Sequence[Shard], then: Callable[[], None]) -> bool:
        """Queue `shards`; True when done now, else `then()` runs once they are queued."""
        rest = list(shards)
        while rest and self._tiers.offer(*rest[0]):
            rest.pop(0)
        if not rest:
            return True
        if self._tiers.policy != "block":
            for shard in rest:
                self._tiers.submit(*shard)  # drops it (counted) and calls on_done
            return True
        self._start()
        self.parked_commits += 1
        self._parked.put((rest, then))
        return False

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvtier-l2-submit", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while (item := self._parked.get()) is not None:
            shards, then = item
            for shard in shards:
                self._tiers.submit(*shard)  # waits for room up to block_timeout, then drops
            try:
                then()
            except Exception:
                logger.exception("write-through: answering a parked commit failed")

    def close(self) -> None:
        """Finish the parked commits (the tier manager, closing later, drops what is left)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            self._parked.put(_STOP)
            thread.join()

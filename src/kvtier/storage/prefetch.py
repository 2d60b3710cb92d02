"""Prefetch: bring the chunk groups that follow an L1 hit up from the L2 tiers into L1, on
worker threads, never under the engine's lock while tier I/O runs.

A group counts only when every rank's shard is in some tier and every shard actually loads
(its digest, key and layout check out on the way in); the first group that fails ends the run,
so a lookup never reports a hit it cannot serve.

A job's L1 bookkeeping (reserve, commit, hold) happens in short sections under the lock it was
given; the tier reads happen between them, outside it. A group's missing shards are reserved in
one section and committed in one, so the group is never evictable half-loaded (a group with a
staging shard is not in the LRU order). The loaded groups stay held until the job's `on_done`
has run, so the caller can pin them before anything may evict them.

At most `max_jobs` jobs are in flight (LMCache bounds its async L2 prefetch the same way);
`submit` refuses more, and the caller then answers from L1 alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

from kvtier.errors import NoSpaceError, UnknownReservationError
from kvtier.keys import ChunkKey
from kvtier.storage.arena import Arena
from kvtier.storage.l1 import L1Store
from kvtier.storage.manager import TierManager

__all__ = ["Prefetcher"]

logger = logging.getLogger(__name__)

_OWNER = "kvtier:l2-prefetch"  # the staging owner of slots being filled from L2

#: called under the lock with the groups loaded and still held, in chain order
OnDone = Callable[[list[ChunkKey]], None]


class Prefetcher:
    """Runs L2-to-L1 load jobs on a small pool of worker threads."""

    def __init__(
        self,
        l1: L1Store,
        arena: Arena,
        tiers: TierManager,
        lock: AbstractContextManager[Any],
        *,
        max_jobs: int,
        lease_s: float,
    ) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self._l1 = l1
        self._arena = arena
        self._tiers = tiers
        self._lock = lock
        self._lease_s = lease_s
        self.max_jobs = max_jobs
        self._pool = ThreadPoolExecutor(max_workers=max_jobs, thread_name_prefix="kvtier-prefetch")
        self._count_lock = threading.Lock()
        self.in_flight = 0
        self.started = 0
        self.refused = 0  # jobs not started because max_jobs were in flight
        self.loaded_groups = 0

    def submit(
        self, keys: Sequence[ChunkKey], *, nbytes: int, layout: str, on_done: OnDone
    ) -> bool:
        """Start loading the leading loadable groups of `keys`; False when too many jobs run.

        `on_done(loaded)` runs exactly once on a worker thread, under the lock, even when the
        job fails (then with what loaded before the failure).
        """
        with self._count_lock:
            if self.in_flight >= self.max_jobs:
                self.refused += 1
                return False
            self.in_flight += 1
            self.started += 1
        try:
            self._pool.submit(self._run, list(keys), nbytes, layout, on_done)
        except RuntimeError:  # the pool is shut down: the server is closing
            with self._count_lock:
                self.in_flight -= 1
            return False
        return True

    def close(self) -> None:
        """Wait for the running jobs and stop the workers."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, keys: list[ChunkKey], nbytes: int, layout: str, on_done: OnDone) -> None:
        held: list[ChunkKey] = []
        try:
            ws = keys[0].world_size if keys else 1
            present = self._tiers.contains_many([k.shard(w) for k in keys for w in range(ws)])
            for i, key in enumerate(keys):
                if not all(present[i * ws : (i + 1) * ws]):
                    break
                if not self._load_group(key, nbytes, layout):
                    break
                held.append(key)
        except Exception:
            logger.exception("prefetch job failed after %d groups", len(held))
        finally:
            with self._lock:
                try:
                    on_done(held)
                except Exception:
                    logger.exception("prefetch on_done failed")
                for key in held:
                    self._l1.release(key)
            with self._count_lock:
                self.in_flight -= 1
                self.loaded_groups += len(held)

    def _load_group(self, key: ChunkKey, nbytes: int, layout: str) -> bool:
        """Load every missing shard of the group; True when it ends complete and held."""
        l1 = self._l1
        slots: list[tuple[int, int]] = []  # (worker_id, offset) reserved by this job
        with self._lock:
            for worker_id in range(key.world_size):
                if l1.get_shard(key, worker_id) is not None:
                    continue
                try:
                    offset = l1.reserve(
                        key, worker_id, nbytes, owner=_OWNER, lease_s=self._lease_s, layout=layout
                    )
                except NoSpaceError:
                    offset = None
                if offset is None:  # no room, or another client is writing this shard now
                    self._abort(key, slots)
                    return False
                slots.append((worker_id, offset))
        ok = True
        for worker_id, offset in slots:  # the I/O: no lock held
            view = self._arena.view(offset, nbytes)
            if self._tiers.get_into(key.shard(worker_id), view, layout) is None:
                ok = False
                break
        with self._lock:
            if not ok:
                self._abort(key, slots)
                return False
            try:
                for worker_id, _ in slots:
                    l1.commit(key, worker_id, owner=_OWNER)
            except UnknownReservationError:  # the staging lease lapsed and was reclaimed
                self._abort(key, slots)
                return False
            if not l1.is_complete(key):
                return False
            l1.acquire(key)  # keep it while later loads make room
        return True

    def _abort(self, key: ChunkKey, slots: list[tuple[int, int]]) -> None:
        for worker_id, _ in slots:
            with contextlib.suppress(UnknownReservationError):  # committed or reclaimed
                self._l1.abort(key, worker_id, owner=_OWNER)

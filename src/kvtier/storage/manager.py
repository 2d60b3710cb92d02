"""TierManager: asynchronous, batched write-through from the L1 to every L2 tier, and the read
path across tiers (first tier first).

The writer is one plain daemon thread, not a `PeriodicThread`: it is a consumer that blocks on
the queue and wakes per item, so a timer would only add latency or polling. It is a daemon so a
forgotten `close()` cannot hang interpreter exit; `close()` is what flushes. Tiers are written one
after another per batch; a tier that raises is logged and counted and does not stop the others
or the writer. A slow tier does delay the others' writes; the Redis tier's short timeouts and
cool-down bound that.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, cast

import msgspec

from kvtier.config import ServerConfig
from kvtier.keys import ObjectKey
from kvtier.storage.loadrate import LoadRates
from kvtier.storage.observers import NO_OBSERVER, ListsChunks, ReportsRemovals, StorageObserver
from kvtier.storage.tiers.base import L2Tier, TierStats
from kvtier.storage.tiers.format import Hit

logger = logging.getLogger(__name__)

Policy = Literal["drop", "block"]
_DEFAULT_POLICY = cast(Policy, ServerConfig.l2_queue_policy)  # defaults live in ServerConfig


class L2Summary(msgspec.Struct, frozen=True, kw_only=True):
    """The write-through queue and every L2 tier's stats, in read order."""

    queue_depth: int = 0
    queue_capacity: int = 0
    policy: str = "drop"
    submitted: int = 0
    written: int = 0
    dropped: int = 0
    write_errors: int = 0
    read_errors: int = 0
    tiers: list[TierStats] = msgspec.field(default_factory=list)
    #: tiers that are unhealthy now or whose errors grew within the server's health window
    failing: list[str] = msgspec.field(default_factory=list)


class _Job(NamedTuple):
    key: ObjectKey
    data: memoryview
    layout: str
    on_done: Callable[[], None] | None
    resumable: bool


class Found(NamedTuple):
    """Where a batch read found an object, and whether it is a resume point."""

    tier: str
    resumable: bool


_STOP = None  # queue sentinel that ends the writer


def _call(on_done: Callable[[], None] | None) -> None:
    if on_done is None:
        return
    try:
        on_done()
    except Exception:
        logger.exception("tier manager: on_done callback failed")


class TierManager:
    """Writes every submitted object to all `tiers` in the background; reads in tier order.

    The queue's size and policy default to ServerConfig's (`l2_queue_size`, `l2_queue_policy`),
    the one place defaults live; `batch_size` and `block_timeout` are this class's own knobs.
    """

    def __init__(
        self,
        tiers: Sequence[L2Tier],
        *,
        queue_size: int = ServerConfig.l2_queue_size,
        batch_size: int = 16,
        policy: Policy = _DEFAULT_POLICY,
        block_timeout: float = 1.0,
        observer: StorageObserver = NO_OBSERVER,
    ) -> None:
        """`observer` hears, from the writer thread, of each group a write made complete in a
        tier, and (through the tiers that see them) of removals; see `start`."""
        if queue_size < 1 or batch_size < 1:
            raise ValueError(
                f"queue_size and batch_size must be >= 1, got {queue_size} and {batch_size}"
            )
        if policy not in ("drop", "block"):
            raise ValueError(f"policy must be 'drop' or 'block', got {policy!r}")
        if block_timeout < 0:
            raise ValueError(f"block_timeout must be >= 0 seconds, got {block_timeout}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique (stats are keyed by them), got {names}")
        self._tiers = tuple(tiers)
        self.queue_size = queue_size
        self.batch_size = batch_size
        self.policy: Policy = policy
        self.block_timeout = block_timeout
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self._cond = threading.Condition()
        self._pending = 0  # submitted and neither written nor dropped yet
        self._n = dict.fromkeys(
            ("submitted", "written", "dropped", "write_errors", "read_errors"), 0
        )
        #: each tier's load latency and throughput, measured by the reads below
        self.rates = LoadRates(names)
        self._observer = observer
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def observer(self) -> StorageObserver:
        """Who follows what the tiers hold (the L1 of the same server reports to it too)."""
        return self._observer

    @property
    def tiers(self) -> tuple[L2Tier, ...]:
        """The tiers, in read order."""
        return self._tiers

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the background writer was started and the manager is not closed."""
        return self._thread is not None and not self._closed

    def start(self) -> None:
        """Start the background writer; raises RuntimeError when started before or closed."""
        if self._thread is not None or self._closed:
            raise RuntimeError("TierManager.start() called twice or after close()")
        self._follow_tiers()
        self._thread = threading.Thread(target=self._run, name="kvtier-l2-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Write everything queued, stop the writer and close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
        self._drop_leftovers()
        for tier in self._tiers:
            try:
                tier.close()
            except Exception:
                logger.exception("tier manager: closing tier %s failed", tier.name)

    def _follow_tiers(self) -> None:
        """Hand the observer to the tiers that see their own removals, and report what the
        tiers that know their contents hold already (what survived a restart)."""
        if not self._observer:
            return
        for tier in self._tiers:
            if isinstance(tier, ReportsRemovals):
                tier.observe(self._observer)
            if isinstance(tier, ListsChunks):
                held = tier.complete_chunks()
                if held:
                    self._observer.stored(held, tier.name)

    def _drop_leftovers(self) -> None:
        """Drop jobs queued after the writer stopped (or when it never started)."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._finish([job], dropped=True)

    # -- writes --------------------------------------------------------------------------------

    def submit(
        self,
        key: ObjectKey,
        data: memoryview,
        layout: str,
        on_done: Callable[[], None] | None = None,
        resumable: bool = True,
    ) -> bool:
        """Queue `data` for every tier; False when dropped (queue full or manager closed).

        The caller keeps `data` valid until `on_done()`, which runs exactly once: after all tiers
        wrote or failed, or right away when the object is dropped. `resumable` False stores it
        marked as no resume point.
        """
        job = _Job(key, data, layout, on_done, resumable)
        with self._cond:
            self._n["submitted"] += 1
            self._pending += 1
        try:
            if self._closed:
                raise queue.Full
            if self.policy == "drop":
                self._queue.put_nowait(job)
            else:
                self._queue.put(job, timeout=self.block_timeout)
        except queue.Full:
            self._finish([job], dropped=True)
            return False
        return True

    def offer(
        self,
        key: ObjectKey,
        data: memoryview,
        layout: str,
        on_done: Callable[[], None] | None = None,
        resumable: bool = True,
    ) -> bool:
        """Queue `data` if there is room now; never waits, never drops (`resumable` as in
        `submit`).

        False when the queue is full: nothing was queued and `on_done` was not called (the
        caller may `submit` it later, from a thread that can afford to wait).
        """
        if self._closed:
            return False
        job = _Job(key, data, layout, on_done, resumable)
        with self._cond:
            self._n["submitted"] += 1
            self._pending += 1
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self._cond:
                self._n["submitted"] -= 1
                self._pending -= 1
                self._cond.notify_all()
            return False
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            batch = [job]
            stop = False
            while len(batch) < self.batch_size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self._write(batch)
            if stop:
                return

    def _write(self, batch: list[_Job]) -> None:
        items = [(j.key, j.data, j.layout) for j in batch]
        unresumable = {j.key for j in batch if not j.resumable}
        chunks_unresumable = {key.chunk for key in unresumable}
        for tier in self._tiers:
            try:
                written = tier.put_many(items, unresumable=unresumable)
            except Exception:
                logger.exception("tier manager: tier %s failed a batch write", tier.name)
                written = 0
            with self._cond:
                self._n["write_errors"] += len(items) - written
            if self._observer and written:
                # a chunk whose piece is no resume point is not reported (as in the L1)
                resumable = [j.key for j in batch if j.key.chunk not in chunks_unresumable]
                if resumable:
                    self._report_stored(tier, resumable, all_written=written == len(items))
        self._finish(batch, dropped=False)

    def _report_stored(self, tier: L2Tier, written: list[ObjectKey], *, all_written: bool) -> None:
        """Report the groups a batch made complete in `tier`. A group of one piece is complete
        once written; for bigger groups, or when some writes failed, the tier is asked which
        groups now hold every piece (one batched `contains_many`)."""
        chunks = list(dict.fromkeys(key.chunk for key in written))
        if not all_written or any(chunk.world_size > 1 for chunk in chunks):
            pieces = [chunk.shard(w) for chunk in chunks for w in range(chunk.world_size)]
            try:
                flags = iter(tier.contains_many(pieces))
            except Exception:
                logger.exception("tier manager: tier %s failed contains_many", tier.name)
                self._count_read_error()
                return
            chunks = [c for c in chunks if all([next(flags) for _ in range(c.world_size)])]
        if chunks:
            self._observer.stored(chunks, tier.name)

    def _finish(self, jobs: list[_Job], *, dropped: bool) -> None:
        for job in jobs:
            _call(job.on_done)
        with self._cond:
            self._n["dropped" if dropped else "written"] += len(jobs)
            self._pending -= len(jobs)
            self._cond.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted object is written or dropped; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    # -- reads ---------------------------------------------------------------------------------

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key is in any tier; a later tier is asked only about keys still missing."""
        return [where >= 0 for where in self.locate_many(keys)]

    def locate_many(self, keys: Sequence[ObjectKey], tenant: str | None = None) -> list[int]:
        """The index of the first tier holding each key (the one a read gets it from), or -1;
        a later tier is asked only about keys still missing. Each tier's check is timed: it is
        that tier's latency sample (see `LoadRates`)."""
        where = [-1] * len(keys)
        missing = list(range(len(keys)))
        for t, tier in enumerate(self._tiers):
            if not missing:
                break
            start = time.perf_counter()
            try:
                flags = tier.contains_many([keys[i] for i in missing])
            except Exception:
                logger.exception("tier manager: tier %s failed contains_many", tier.name)
                self._count_read_error()
                continue
            self.rates.observe_probe(tier.name, time.perf_counter() - start, tenant)
            for i, flag in zip(missing, flags, strict=True):
                if flag:
                    where[i] = t
            missing = [i for i in missing if where[i] < 0]
        return where

    def get_into(self, key: ObjectKey, out: memoryview, layout: str) -> str | None:
        """Read `key` into `out` from the first tier that has it; that tier's name, or None."""
        for tier in self._tiers:
            try:
                if tier.get_into(key, out, layout):
                    return tier.name
            except Exception:
                logger.exception("tier manager: tier %s failed get_into", tier.name)
                self._count_read_error()
        return None

    def get_many_into(
        self, items: Sequence[tuple[ObjectKey, memoryview, str]], tenant: str | None = None
    ) -> list[Found | None]:
        """`get_into` for several objects in one batch read per tier (pipelined, and fanned out
        across masters for a Redis Cluster); where each item was found (and whether it is a
        resume point), or None where no tier had it.

        A later tier is asked only for the items still missing; a tier that raises counts one
        read error and leaves its items to the next tier. Every tier checks each object's
        digest, key and layout on the way in, as `get_into` does.
        """
        got: list[Found | None] = [None] * len(items)
        missing = list(range(len(items)))
        for tier in self._tiers:
            if not missing:
                break
            start = time.perf_counter()
            try:
                flags = tier.get_many_into([items[i] for i in missing])
            except Exception:
                logger.exception("tier manager: tier %s failed get_many_into", tier.name)
                self._count_read_error()
                continue
            seconds = time.perf_counter() - start
            nbytes = 0
            for i, flag in zip(missing, flags, strict=True):
                if flag:
                    got[i] = Found(tier.name, flag != Hit.UNRESUMABLE)
                    nbytes += items[i][1].nbytes
            self.rates.observe_read(tier.name, nbytes, seconds, tenant)
            missing = [i for i in missing if got[i] is None]
        return got

    def _count_read_error(self) -> None:
        with self._cond:
            self._n["read_errors"] += 1

    # -- admin ---------------------------------------------------------------------------------

    def summary(self) -> L2Summary:
        """The L2 part of the server's status: the queue, the writer, then each tier's stats."""
        with self._cond:
            n = dict(self._n)
        return L2Summary(
            queue_depth=self._queue.qsize(),
            queue_capacity=self.queue_size,
            policy=self.policy,
            submitted=n["submitted"],
            written=n["written"],
            dropped=n["dropped"],
            write_errors=n["write_errors"],
            read_errors=n["read_errors"],
            tiers=[tier.stats() for tier in self._tiers],
        )

    def clear(self, *, model: str | None = None, cache_salt: str | None = None) -> int:
        """Clear matching objects in every tier; the total removed (writes still queued stay).

        A tier that lists what it holds reports each group it cleared; of the others the
        observer hears that everything matching the filters left them.
        """
        removed = 0
        for tier in self._tiers:
            removed += tier.clear(model=model, cache_salt=cache_salt)
            if not isinstance(tier, ListsChunks):
                self._observer.cleared(tier.name, model, cache_salt)
        return removed

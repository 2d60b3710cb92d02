"""Prefetch: bring the chunk groups that follow an L1 hit up from the L2 tiers into L1, on
worker threads, never under the engine's lock while tier I/O runs.

A group counts only when every rank's shard is in some tier and every shard actually loads
(its digest, key and layout check out on the way in); the first group that fails ends the run,
so a lookup never reports a hit it cannot serve.

A job's L1 bookkeeping (reserve, commit, hold) happens in short sections under the lock that
`hold()` enters; the tier reads happen between them, outside it. A job reserves the slots it
fills a batch of groups per hold, reads them all outside the lock in one batch
(`TierManager.get_many_into`: pipelined per tier, fanned out across a Redis Cluster's masters),
commits them a batch per hold (holding each committed group), then reports (`on_done`) and
gives back the holds and the rest in one final section: a group is never evictable half-loaded
(a group with a staging shard is not in the LRU order), and the caller pins the loaded groups
before anything else can evict them. Batches keep both the number and the length of holds
small (each hold may also wait for the GIL or the CPU).

The tier reads themselves run on reader threads at the lowest CPU priority (nice 19 on Linux),
which never take the engine lock. A read from the page cache is a memcpy and a digest, CPU
work that competes with the threads and client processes answering requests: lowered, it takes
the CPUs they leave idle, and on an idle machine it runs as fast as before. The workers, which
do take the lock, keep the normal priority, so a section of a job under the lock is never
starved (nicing the workers themselves was measured: holds of the lock grew to 98 ms at nice
10). On 2 CPUs, L1-hit lookups beside back-to-back 16 MiB loads went from 2.4x their quiet p99
to 1.6-1.9x (nice 10 gave 1.6-1.95x), the loads' own p50 from 12 to 13-14 ms (the concurrency
benchmark).

A job loads only the L2 chunks whose load pays: given the prefill speed the lookup states, the
leading run that saves the most time against recomputing (`loadrate.paying_prefix`, from the
tiers' measured latency and throughput); the rest are left to be recomputed. It reports what
became of every chunk it was given (`LoadOutcome`), so the lookup can say why each one missed.

At most `max_jobs` jobs are in flight (LMCache bounds its async L2 prefetch the same way), and
at most `tenant_jobs` of one tenant, so one tenant's lookups never take every slot; `submit`
refuses more, and the caller then answers from L1 alone. A job's staging slots count against its
tenant's staging bounds (`TenantBounds`): a load stops where they would be passed.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import msgspec

from kvtier.errors import NoSpaceError, UnknownReservationError
from kvtier.keys import ChunkKey
from kvtier.storage.arena import Arena
from kvtier.storage.l1 import UNBOUNDED, Held, L1Store, TenantBounds
from kvtier.storage.loadrate import paying_prefix
from kvtier.storage.manager import TierManager

__all__ = ["LoadOutcome", "LoadStatus", "Prefetcher"]

logger = logging.getLogger(__name__)

_BATCH = 4  # groups reserved or committed per hold of the lock
# Threads running jobs (up to max_jobs more wait their turn): one per two CPUs, at most 4. A
# read from the page cache is a memcpy, so loads compete for the CPUs with the threads and
# processes that answer requests: on 2 CPUs one worker loaded faster than two (the concurrency
# benchmark: 11.8 ms against 16.9 ms per 16 MiB prompt) and slowed L1 lookups less.
_WORKERS = max(1, min(4, (os.cpu_count() or 2) // 2))
_READ_NICE = 19  # added to the reader threads' nice value, which stops at 19 (the lowest)
_OWNER = "kvtier:l2-prefetch"  # the staging owner of slots being filled from L2


class LoadStatus(enum.Enum):
    """What became of one chunk a job was given."""

    LOADED = "loaded"  # complete in L1 now (held until on_done returns)
    ABSENT = "absent"  # no shard in any tier
    PARTIAL = "partial"  # some ranks' shards in the tiers, not all
    SLOW = "slow"  # in the tiers, but loading it was predicted slower than recomputing it
    NO_ROOM = "no_room"  # in the tiers, but no slot for it (L1 full, tenant bounds, in use)
    FAILED = "failed"  # in the tiers, but a read failed or found it corrupt
    BEHIND = "behind"  # in the tiers, not tried: a chunk before it ended the run


@dataclass(slots=True)
class LoadOutcome:
    """A job's result: the groups loaded (in chain order), and per chunk given, its status and
    the tier it is in ("" for none; a chunk spread over tiers names the last of them)."""

    loaded: list[ChunkKey]
    statuses: list[LoadStatus]
    tiers: list[str]


#: called under the lock with the job's outcome
OnDone = Callable[[LoadOutcome], None]


def _lower_priority() -> None:
    """Raise the calling thread's nice value by `_READ_NICE` (Linux: nice is per thread;
    raising it needs no privilege). Elsewhere, or where refused, the thread keeps its own."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _READ_NICE)
    except OSError as exc:
        logger.warning("L2 reader thread keeps its CPU priority: %s", exc)


class PrefetchStats(msgspec.Struct, frozen=True, kw_only=True):
    """L2 loads that lookups started (jobs run off the request path, at most N at once)."""

    in_flight: int
    started: int
    refused: int  # lookups answered from L1 alone because N jobs were running
    loaded_groups: int


class Prefetcher:
    """Runs L2-to-L1 load jobs on a small pool of worker threads."""

    def __init__(
        self,
        l1: L1Store,
        arena: Arena,
        tiers: TierManager,
        hold: Callable[[], AbstractContextManager[Any]],
        *,
        max_jobs: int,
        lease_s: float,
        chunk_size: int,
    ) -> None:
        """`chunk_size` is the tokens of one chunk (what a skipped load costs to recompute)."""
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self._l1 = l1
        self._arena = arena
        self._tiers = tiers
        self._hold = hold
        self._lease_s = lease_s
        self._chunk_size = chunk_size
        self.max_jobs = max_jobs
        workers = min(max_jobs, _WORKERS)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtier-prefetch")
        self._readers = ThreadPoolExecutor(
            workers, thread_name_prefix="kvtier-l2-read", initializer=_lower_priority
        )
        self._count_lock = threading.Lock()
        self.in_flight = 0
        self._tenant_jobs: dict[str, int] = {}  # jobs in flight per tenant
        self.started = 0
        self.refused = 0  # jobs not started because max_jobs (or the tenant's share) ran
        self.loaded_groups = 0

    def submit(
        self,
        keys: Sequence[ChunkKey],
        *,
        nbytes: int,
        layout: str,
        on_done: OnDone,
        tenant: str = "",
        tenant_jobs: int | None = None,
        bounds: TenantBounds = UNBOUNDED,
        leading: bool = True,
        prefill_tokens_per_s: float = 0.0,
    ) -> bool:
        """Start loading the leading loadable groups of `keys` for `tenant` (with
        `leading=False`, every loadable one, past those the tiers lack), those whose load pays
        against recomputing at `prefill_tokens_per_s` (0: unknown, load all); False when
        `max_jobs` jobs run, or `tenant_jobs` of this tenant's.

        `on_done(outcome)` runs exactly once on a worker thread, under the lock, even when the
        job fails (then with what loaded before the failure).
        """
        with self._count_lock:
            mine = self._tenant_jobs.get(tenant, 0)
            if self.in_flight >= self.max_jobs or (tenant_jobs is not None and mine >= tenant_jobs):
                self.refused += 1
                return False
            self.in_flight += 1
            self._tenant_jobs[tenant] = mine + 1
            self.started += 1
        try:
            self._pool.submit(
                self._run,
                list(keys),
                nbytes,
                layout,
                on_done,
                tenant,
                bounds,
                leading,
                prefill_tokens_per_s,
            )
        except RuntimeError:  # the pool is shut down: the server is closing
            self._job_ended(tenant, 0)
            return False
        return True

    def _job_ended(self, tenant: str, loaded: int) -> None:
        with self._count_lock:
            self.in_flight -= 1
            left = self._tenant_jobs[tenant] - 1
            if left:
                self._tenant_jobs[tenant] = left
            else:
                del self._tenant_jobs[tenant]
            self.loaded_groups += loaded

    def stats(self) -> PrefetchStats:
        """The jobs in flight now and the counts since start (the server's status shows them)."""
        with self._count_lock:
            return PrefetchStats(
                in_flight=self.in_flight,
                started=self.started,
                refused=self.refused,
                loaded_groups=self.loaded_groups,
            )

    def close(self) -> None:
        """Wait for the running jobs and stop the workers."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._readers.shutdown(wait=True)

    def _run(
        self,
        keys: list[ChunkKey],
        nbytes: int,
        layout: str,
        on_done: OnDone,
        tenant: str,
        bounds: TenantBounds,
        leading: bool,
        prefill_tokens_per_s: float,
    ) -> None:
        loaded: list[ChunkKey] = []
        held: list[Held] = []  # the holds on the loaded groups, given back after on_done
        reserved: list[tuple[ChunkKey, list[tuple[int, int]]]] = []
        outcome = LoadOutcome(loaded, [LoadStatus.BEHIND] * len(keys), [""] * len(keys))
        try:
            if not leading:  # every group the tiers hold whole, past the ones they lack
                keys = self._whole_in_tiers(keys)
                outcome = LoadOutcome(loaded, [LoadStatus.BEHIND] * len(keys), [""] * len(keys))
            loadable = self._plan(keys, nbytes, prefill_tokens_per_s, outcome, tenant)
            for lo in range(0, loadable, _BATCH):  # short holds: a batch of groups each
                with self._hold():
                    batch = self._reserve(
                        keys[lo : min(loadable, lo + _BATCH)], nbytes, layout, tenant, bounds
                    )
                reserved += batch
                if len(batch) < min(_BATCH, loadable - lo):
                    outcome.statuses[len(reserved)] = LoadStatus.NO_ROOM
                    break
            resumable = self._read(reserved, nbytes, layout, tenant)  # the I/O: no lock held
            good = len(resumable)
            if good < len(reserved):
                outcome.statuses[good] = LoadStatus.FAILED
            for lo in range(0, good, _BATCH):
                with self._hold():
                    hi = min(good, lo + _BATCH)
                    done = self._commit(reserved[lo:hi], resumable[lo:hi], held)
                loaded += done
                if len(done) < min(_BATCH, good - lo):
                    good = lo + len(done)
                    outcome.statuses[good] = LoadStatus.NO_ROOM  # its staging lease lapsed
                    break
        except Exception:
            logger.exception("prefetch job failed")
            good = len(loaded)
        finally:
            outcome.statuses[: len(loaded)] = [LoadStatus.LOADED] * len(loaded)
            with self._hold():  # report, then give back the holds and what was not loaded
                for key, slots in reserved[good:]:
                    self._abort(key, slots)
                try:
                    on_done(outcome)
                except Exception:
                    logger.exception("prefetch on_done failed")
                for hold in held:
                    self._l1.release(hold)
            self._job_ended(tenant, len(loaded))

    def _whole_in_tiers(self, keys: list[ChunkKey]) -> list[ChunkKey]:
        """The groups of `keys` whose every shard some tier holds."""
        ws = keys[0].world_size if keys else 1
        present = self._tiers.contains_many([k.shard(w) for k in keys for w in range(ws)])
        return [key for i, key in enumerate(keys) if all(present[i * ws : (i + 1) * ws])]

    def _plan(
        self,
        keys: list[ChunkKey],
        nbytes: int,
        prefill_tokens_per_s: float,
        outcome: LoadOutcome,
        tenant: str,
    ) -> int:
        """Where each chunk's shards are; how many leading chunks to load: those every rank has
        in some tier and whose load pays. Marks the others' statuses in `outcome`."""
        ws = keys[0].world_size if keys else 1
        where = self._tiers.locate_many([k.shard(w) for k in keys for w in range(ws)], tenant)
        names = [tier.name for tier in self._tiers.tiers]
        chunk_tiers: list[list[int]] = []
        loadable = len(keys)
        for i in range(len(keys)):
            shards = where[i * ws : (i + 1) * ws]
            found = [t for t in shards if t >= 0]
            outcome.tiers[i] = names[max(found)] if found else ""
            if len(found) < ws:
                outcome.statuses[i] = LoadStatus.PARTIAL if found else LoadStatus.ABSENT
                loadable = min(loadable, i)
            chunk_tiers.append(found)
        paying = paying_prefix(
            chunk_tiers[:loadable],
            self._tiers.rates.snapshot(tenant),  # its own loads' estimate: no one else's
            shard_bytes=nbytes,
            chunk_tokens=self._chunk_size,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        outcome.statuses[paying:loadable] = [LoadStatus.SLOW] * (loadable - paying)
        return paying

    def _reserve(
        self,
        keys: Sequence[ChunkKey],
        nbytes: int,
        layout: str,
        tenant: str,
        bounds: TenantBounds,
    ) -> list[tuple[ChunkKey, list[tuple[int, int]]]]:
        """Staging slots for the missing shards of the leading groups, until one cannot get
        them (no room, past the tenant's bounds, or another client writes that shard now)."""
        l1 = self._l1
        out: list[tuple[ChunkKey, list[tuple[int, int]]]] = []
        for key in keys:
            slots: list[tuple[int, int]] = []  # (worker_id, offset)
            for worker_id in range(key.world_size):
                if l1.get_shard(key, worker_id) is not None:
                    continue
                try:
                    offset = l1.reserve(
                        key,
                        worker_id,
                        nbytes,
                        owner=_OWNER,
                        lease_s=self._lease_s,
                        layout=layout,
                        tenant=tenant,
                        bounds=bounds,
                        admit=True,  # loaded because a lookup wants it: cache
                    )
                except NoSpaceError:
                    offset = None
                if offset is None:
                    self._abort(key, slots)
                    return out
                slots.append((worker_id, offset))
            out.append((key, slots))
        return out

    def _read(
        self,
        reserved: list[tuple[ChunkKey, list[tuple[int, int]]]],
        nbytes: int,
        layout: str,
        tenant: str,
    ) -> list[list[bool]]:
        """Read every reserved shard from L2 in one batch (each tier pipelines it, a Redis
        Cluster fans it out across its masters); for each leading group read completely, which
        of its shards are resume points."""
        items = [
            (key.shard(worker_id), self._arena.view(offset, nbytes), layout)
            for key, slots in reserved
            for worker_id, offset in slots
        ]
        got = self._readers.submit(self._tiers.get_many_into, items, tenant).result()
        at = 0
        groups: list[list[bool]] = []
        for _, slots in reserved:
            found = got[at : at + len(slots)]
            if None in found:
                break
            groups.append([f.resumable for f in found if f is not None])
            at += len(slots)
        return groups

    def _commit(
        self,
        reserved: list[tuple[ChunkKey, list[tuple[int, int]]]],
        resumable: list[list[bool]],
        held: list[Held],
    ) -> list[ChunkKey]:
        """Commit the read groups in chain order, each shard a resume point as its object
        says; the leading ones now complete in L1 (a hold on each added to `held`)."""
        l1 = self._l1
        loaded: list[ChunkKey] = []
        for n, ((key, slots), flags) in enumerate(zip(reserved, resumable, strict=True)):
            try:
                for (worker_id, _), flag in zip(slots, flags, strict=True):
                    l1.commit(key, worker_id, owner=_OWNER, resumable=flag)
            except UnknownReservationError:  # the staging lease lapsed and was reclaimed
                self._abort(key, slots)
                for later_key, later_slots in reserved[n + 1 :]:
                    self._abort(later_key, later_slots)
                return loaded
            if not l1.is_complete(key):
                for later_key, later_slots in reserved[n + 1 :]:
                    self._abort(later_key, later_slots)
                return loaded
            held.append(l1.acquire(key))  # held until the job's on_done has pinned it
            loaded.append(key)
        return loaded

    def _abort(self, key: ChunkKey, slots: list[tuple[int, int]]) -> None:
        for worker_id, _ in slots:
            with contextlib.suppress(UnknownReservationError):  # committed or reclaimed
                self._l1.abort(key, worker_id, owner=_OWNER)

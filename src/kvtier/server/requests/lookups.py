"""Lookups: pin and report the cached prefix of a prompt; loads from L2 run as prefetch jobs.

A lookup counts the leading groups complete in L1 and pins them for the request. When the
groups after them may be in L2, it starts a prefetch job instead of answering: a blocking lookup
is answered when the job ends, a non-blocking one answers "pending" at once and is polled. At
the job's end the hit is what is complete in L1 then, and exactly that is pinned. A lookup of a
request whose earlier lookup still loads joins that load. ExistsKeys, the lookup of named
chunks, counts and loads the same way but pins nothing. The book is guarded by the engine lock:
every method runs under it, the caller having named the chunks outside it.

Per tenant: its lookups run at most its share of the prefetch jobs (`--tenant-prefetch-share`;
past it a lookup is answered from L1 alone), a job's staging counts against its staging shares,
and its pins hold at most `--tenant-pinned-share` of the L1 (a lookup reports as hit only the
leading groups its pins could hold; past the share, a miss). Another tenant's lookups are not
affected by either.

Every lookup's missed tokens are counted by reason (`misses.py`), from the chunk memory and
what its load found. A lookup that states its engine's prefill speed gets no L2 chunk whose
load would take longer than recomputing it (`storage/loadrate.py`); L1 hits are always reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier import protocol as p
from kvtier.config import ServerConfig
from kvtier.errors import InvalidArgumentError
from kvtier.keys import ChunkKey
from kvtier.layouts import Layout
from kvtier.server.answers import Answer
from kvtier.server.limits import tenant_bounds, tenant_prefetch_jobs
from kvtier.server.observe.chunkmemory import ChunkMemory
from kvtier.server.observe.funnel import hit_funnel
from kvtier.server.observe.metrics import Metrics
from kvtier.server.observe.misses import explain_misses
from kvtier.storage.l1 import L1Store
from kvtier.storage.manager import TierManager
from kvtier.storage.prefetch import LoadOutcome, Prefetcher

__all__ = ["LookupBook"]


@dataclass(slots=True)
class _LookupJob:
    """A lookup waiting on L2 loads: answered to `waiters` when done, kept for one poll."""

    request_id: str
    keys: list[ChunkKey]
    num_tokens: int
    model: str
    cache_salt: str
    world_size: int
    readers: int  # ranks that retrieve under its pin
    tenant: str
    owner: str  # the client that looked up: its pin lives while it does
    start: int  # the chunks it loads are keys[start:] (the L1 hit when it began)
    done: bool = False
    hit_tokens: int = 0
    waiters: list[Answer] = field(default_factory=list)


def _same_chunks(a: list[ChunkKey], b: list[ChunkKey]) -> bool:
    """Whether two lookups name the same chunks: names are chained, so the last one settles it."""
    return len(a) == len(b) and (not a or a[-1] == b[-1])


class LookupBook:
    """The lookups of the server: pins, pending prefetch jobs and their results."""

    def __init__(
        self,
        config: ServerConfig,
        l1: L1Store,
        tiers: TierManager,
        prefetcher: Prefetcher,
        metrics: Metrics,
        memory: ChunkMemory,
    ) -> None:
        self._config = config
        self._chunk_size = config.chunk_size
        self._l1 = l1
        self._tiers = tiers
        self._prefetcher = prefetcher
        self._metrics = metrics
        self._memory = memory
        self._jobs: dict[str, _LookupJob] = {}
        self._bounds = tenant_bounds(config, l1.capacity_bytes)
        self._tenant_jobs = tenant_prefetch_jobs(config)
        self.requested_tokens = 0
        self.hit_tokens = 0

    def lookup(
        self,
        req: p.Lookup,
        keys: list[ChunkKey],
        num_tokens: int,
        layout: Layout | None,
        answer: Answer,
        *,
        tenant: str = "",
        owner: str = "",
    ) -> p.LookupReply | None:
        """Under the engine lock: the reply, or None when `answer` waits for a prefetch job.
        `owner`: the client asking; the pins live while it does (`L1Store.reclaim_pins`)."""
        readers = req.readers or req.world_size
        self._l1.observe_lookup(keys, req.request_id)
        running = self._jobs.get(req.request_id)
        busy = running is not None and not running.done
        if busy and running is not None and _same_chunks(running.keys, keys):
            return self._wait_or_pending(running, req.wait, answer)
        hit = self._l1.count_prefix(keys)
        # A job of another prompt under this request id (one id used for two prompts at once)
        # keeps its place: this lookup is answered from L1 alone, about its own chunks.
        if not busy and hit < len(keys) and layout is not None and self._tiers.tiers:
            if hit:  # hold what is hit while the rest loads
                self._pin(req.request_id, keys[:hit], readers, tenant, owner)
            job = _LookupJob(
                req.request_id,
                keys,
                num_tokens,
                req.model,
                req.cache_salt,
                req.world_size,
                readers,
                tenant,
                owner,
                hit,
            )
            started = self._submit(
                keys[hit:],
                layout,
                tenant,
                lambda outcome: self._loaded(job, outcome),
                prefill_tokens_per_s=req.prefill_tokens_per_s,
            )
            if started:
                self._jobs[req.request_id] = job
                return self._wait_or_pending(job, req.wait, answer)
        if not busy:
            self._jobs.pop(req.request_id, None)  # a done job nobody polled
        hit_tokens = self._finish(
            req.request_id, keys, hit, num_tokens, req.model, readers, tenant, owner
        )
        return p.LookupReply(hit_tokens)

    def _submit(
        self,
        keys: list[ChunkKey],
        layout: Layout,
        tenant: str,
        on_done: Callable[[LoadOutcome], None],
        *,
        leading: bool = True,
        prefill_tokens_per_s: float = 0.0,
    ) -> bool:
        return self._prefetcher.submit(
            keys,
            nbytes=layout.nbytes,
            layout=layout.text,
            on_done=on_done,
            tenant=tenant,
            tenant_jobs=self._tenant_jobs,
            bounds=self._bounds,
            leading=leading,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )

    def exists(
        self,
        keys: list[ChunkKey],
        layout: Layout | None,
        answer: Answer,
        *,
        tenant: str = "",
        each: bool = False,
        prefill_tokens_per_s: float = 0.0,
    ) -> p.ExistsReply | None:
        """Under the engine lock: the leading named chunks every rank has, up to the last
        resume point among them (with `each`, also which of all of them are complete); the ones
        only L2 holds are loaded into L1 first (a prefetch job; the answer comes when it ends,
        or at once from L1 when none can start). The chunks after them count as misses, as a
        lookup's do.

        Unlike a lookup nothing is pinned: named chunks have no session to release a pin, and a
        chunk evicted before the caller's get is a miss there, never wrong bytes.
        """

        def count(outcome: LoadOutcome | None = None, start: int = 0) -> p.ExistsReply:
            complete = self._l1.count_prefix(keys)  # under the lock
            hit = self._l1.resume_prefix(keys, complete)
            present = self._l1.complete_each(keys) if each else []
            if each:
                self._l1.touch([key for key, ok in zip(keys, present, strict=True) if ok])
            else:
                self._l1.touch(keys[:hit])
            tally = explain_misses(
                keys,
                hit=hit,
                resumable=hit,
                l1_hit=complete,
                num_tokens=len(keys) * self._chunk_size,
                chunk_size=self._chunk_size,
                l1=self._l1,
                memory=self._memory,
                outcome=outcome,
                job_start=start,
            )
            if tally:
                self._metrics.observe_misses(tally)
            return p.ExistsReply(hit, present)

        self._l1.observe_lookup(keys)
        start = self._l1.count_prefix(keys)
        if each:
            flags = self._l1.complete_each(keys)
            missing = [key for key, ok in zip(keys, flags, strict=True) if not ok]
        else:
            missing = keys[start:]
        if (
            missing
            and layout is not None
            and self._tiers.tiers
            and self._submit(
                missing,
                layout,
                tenant,
                # with `each` the job's outcome covers `missing` only, not keys[start:]
                lambda outcome: answer.reply(count(None if each else outcome, start)),
                leading=not each,
                prefill_tokens_per_s=prefill_tokens_per_s,
            )
        ):
            return None
        return count()

    def poll(self, req: p.LookupPoll, answer: Answer) -> p.LookupReply | None:
        """Under the engine lock: a pending lookup's result (answered once), or pending."""
        job = self._jobs.get(req.request_id)
        if job is None:
            raise InvalidArgumentError(
                f"no lookup of request {req.request_id!r} to poll: send a Lookup first "
                "(a finished lookup answers one poll, then is forgotten)"
            )
        if not job.done:
            return self._wait_or_pending(job, req.wait, answer)
        del self._jobs[req.request_id]
        return p.LookupReply(job.hit_tokens)

    def forget(self, request_id: str) -> None:
        """Under the engine lock: the request's session ended; its pending lookup answers a
        miss, and its job's loads pin nothing for it."""
        job = self._jobs.pop(request_id, None)
        if job is not None and not job.done:
            job.done = True
            self._answer(job)

    @staticmethod
    def _wait_or_pending(job: _LookupJob, wait: bool, answer: Answer) -> p.LookupReply | None:
        if wait:
            job.waiters.append(answer)
            return None
        return p.LookupReply(0, pending=True)

    def _loaded(self, job: _LookupJob, outcome: LoadOutcome) -> None:
        """The job's loads ended (on its worker, under the lock, the loaded groups held)."""
        if self._jobs.get(job.request_id) is not job:
            return  # the session ended meanwhile: nothing is pinned for it
        hit = self._l1.count_prefix(job.keys)
        job.hit_tokens = self._finish(
            job.request_id,
            job.keys,
            hit,
            job.num_tokens,
            job.model,
            job.readers,
            job.tenant,
            job.owner,
            outcome,
            job.start,
        )
        job.done = True
        if job.waiters:
            self._answer(job)

    @staticmethod
    def _answer(job: _LookupJob) -> None:
        for waiter in job.waiters:
            waiter.reply(p.LookupReply(job.hit_tokens))
        job.waiters.clear()

    def _finish(
        self,
        request_id: str,
        keys: list[ChunkKey],
        hit: int,
        num_tokens: int,
        model: str,
        readers: int,
        tenant: str,
        owner: str,
        outcome: LoadOutcome | None = None,
        job_start: int = 0,
    ) -> int:
        """Pin the `hit` leading complete groups, up to the last resume point among them, for
        the request's `readers` and count the lookup and its misses; its hit tokens: those its
        pins hold (at most the tenant's pinned share)."""
        l1_hit = hit
        hit = resumable = self._l1.resume_prefix(keys, hit)
        if hit:
            hit = self._pin(request_id, keys[:hit], readers, tenant, owner)
        if not hit:
            self._l1.unpin(request_id)
        # No LRU touch for the hit: pinned groups are out of the LRU order, and their release
        # puts them back with the chain head most recent (`L1Store.pin`).
        hit_tokens = hit * self._chunk_size
        self.requested_tokens += num_tokens
        self.hit_tokens += hit_tokens
        self._metrics.observe_lookup(model, num_tokens, hit_tokens)
        tally = explain_misses(
            keys,
            hit=hit,
            resumable=resumable,
            l1_hit=l1_hit,
            num_tokens=num_tokens,
            chunk_size=self._chunk_size,
            l1=self._l1,
            memory=self._memory,
            outcome=outcome,
            job_start=job_start,
        )
        if tally:
            self._metrics.observe_misses(tally)
        self._metrics.observe_funnel(
            hit_funnel(
                hit=hit,
                l1_held=job_start if outcome is not None else l1_hit,
                chunk_size=self._chunk_size,
                outcome=outcome,
                job_start=job_start,
            )
        )
        return hit_tokens

    def _pin(
        self, request_id: str, keys: list[ChunkKey], readers: int, tenant: str, owner: str
    ) -> int:
        """Pin what the tenant's pinned share allows of `keys` for `owner` until `readers`
        ranks retrieved them; how many leading ones."""
        return self._l1.pin(
            request_id,
            keys,
            ranks=range(readers),
            lease_s=self._config.pin_lease,
            tenant=tenant,
            max_bytes=self._bounds.pinned_bytes,
            owner=owner,
        )

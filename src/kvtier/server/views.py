"""The admin views of a running server: status, health, sessions and clear, read from the engine
and returned as typed snapshots (`kvtier.server.observe.snapshots`). They sit above the
engine, beside the app that builds them.

The admin API, the metrics collector and `kvtier status` read these; the engine only serves
requests. `TierWatch` turns growing L2 error counters into what an operator sees: `/health`
degraded with the reason, an entry in the recent errors, and one log line per tier at most every
`log_every_s` seconds (a dead Redis fails every call: one line per call would flood the log).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec

from kvtier._version import __version__
from kvtier.keys import compose, decompose, shown
from kvtier.periodic import PeriodicThreadRegistry, ThreadRunSummary
from kvtier.server.engine import Engine
from kvtier.server.observe.chunk_listing import complete_l1_groups
from kvtier.server.observe.snapshots import (
    ClientInfo,
    ErrorRecord,
    Health,
    HeldChunk,
    L2Summary,
    LookupTotals,
    ServerStatus,
    SessionCounts,
    SessionInfo,
    TierChunks,
)
from kvtier.session import Session
from kvtier.storage.observers import L1_TIER, ListsChunks

__all__ = ["AdminViews", "TierWatch"]

logger = logging.getLogger(__name__)


@dataclass
class _TierState:
    errors: int = 0
    corrupt: int = 0
    healthy: bool = True
    failing_since: float | None = None
    last_growth: float = float("-inf")
    last_log: float = float("-inf")


class TierWatch:
    """Notices L2 tiers whose error or corruption counters grow; a tier is failing while its
    errors grew within the last `window_s` seconds."""

    def __init__(
        self,
        *,
        window_s: float = 30.0,
        log_every_s: float = 30.0,
    ) -> None:
        self.window_s = window_s
        self.log_every_s = log_every_s
        self._tiers: dict[str, _TierState] = {}

    def observe(self, summary: L2Summary, now: float, wall: float) -> list[ErrorRecord]:
        """Compare `summary` with the last look; the errors to record: one per tier whose errors
        or corruption grew, or that turned unhealthy by its own account."""
        records = []
        for row in summary.tiers:
            state = self._tiers.get(row.name)
            if state is None:  # the first look sets the baseline: counts from before are history
                state = self._tiers[row.name] = _TierState(errors=row.errors, corrupt=row.corrupt)
            new_errors, new_corrupt = row.errors - state.errors, row.corrupt - state.corrupt
            state.errors, state.corrupt = row.errors, row.corrupt
            if new_corrupt > 0:
                message = (
                    f"L2 tier {row.name}: {new_corrupt} corrupt object(s) found on read "
                    "(deleted, never served)"
                )
                records.append(ErrorRecord(time=wall, operation=f"l2 {row.name}",
                                           code="L2_CORRUPT", message=message))  # fmt: skip
                logger.warning("%s", message)
            turned_unhealthy = not row.healthy and state.healthy
            state.healthy = row.healthy
            if new_errors <= 0 and row.healthy:
                if state.failing_since is not None and now - state.last_growth > self.window_s:
                    logger.warning("L2 tier %s recovered: no new errors for %.0f s", row.name,
                                   self.window_s)  # fmt: skip
                    state.failing_since = None
                continue
            state.last_growth = now
            if state.failing_since is None:
                state.failing_since = now
            if new_errors <= 0 and not turned_unhealthy:
                continue  # still down, nothing new to say
            last = f": {row.last_error}" if row.last_error else ""
            message = (
                f"L2 tier {row.name} failing: {row.errors} errors in total, {max(new_errors, 0)} "
                f"new{last}; chunks it holds are not served until it recovers"
            )
            records.append(ErrorRecord(time=wall, operation=f"l2 {row.name}", code="L2_ERROR",
                                       message=message))  # fmt: skip
            if now - state.last_log >= self.log_every_s:
                state.last_log = now
                logger.warning("%s (this line repeats at most every %.0f s)", message,
                               self.log_every_s)  # fmt: skip
        return records

    def annotate(self, summary: L2Summary, now: float) -> L2Summary:
        """`summary` with `failing` filled in: tiers unhealthy by their own account, or whose
        errors grew within the window."""
        failing = []
        for row in summary.tiers:
            state = self._tiers.get(row.name)
            grew = state is not None and now - state.last_growth <= self.window_s
            if grew or not row.healthy:
                failing.append(row.name)
        return msgspec.structs.replace(summary, failing=failing)


class AdminViews:
    """Status, health, sessions and clear over one engine (what the admin API calls)."""

    def __init__(
        self,
        engine: Engine,
        *,
        registry: PeriodicThreadRegistry | None = None,
        watch: TierWatch | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = engine.metrics
        self.registry = registry or PeriodicThreadRegistry.get_instance()
        self.watch = watch or TierWatch()
        self.metrics.bind_state(self.status)

    # -- health and status -----------------------------------------------------------------

    def is_ready(self) -> bool:
        return self.engine.is_ready()

    def _l2(self) -> L2Summary:
        """The L2 summary with its failing tiers: each tier's stats, read once."""
        return self.watch.annotate(self.engine.tiers.summary(), time.monotonic())

    def check_tiers(self) -> ThreadRunSummary:
        """One look at the tiers' counters (run every few seconds by a periodic thread)."""
        summary = self.engine.tiers.summary()
        now = time.monotonic()
        for record in self.watch.observe(summary, now, time.time()):
            self.engine.recent_errors.append(record)
        failing = self.watch.annotate(summary, now).failing
        return ThreadRunSummary(
            success=True,
            message=f"failing tiers: {', '.join(failing)}" if failing else "all tiers healthy",
            extra_info={"failing": failing},
        )

    def health(self) -> Health:
        """Unavailable when the server cannot serve; degraded when an L2 tier is failing."""
        return self._health(None)

    def _health(self, l2: L2Summary | None) -> Health:
        """`health()`, judged from `l2` when the caller has read the tiers already (None: read
        them here, and only when the server can serve)."""
        reasons: list[str] = []
        if not self.engine.is_ready():
            reasons.append(
                "the server is not ready: its L1 arena is not up (starting or shutting down)"
            )
        for item in self.registry.health()["unhealthy"]:
            reasons.append(f"{item['level']} thread {item['name']!r} stalled: {item['reason']}")
        if reasons:
            return Health("unavailable", reasons)
        if l2 is None:
            l2 = self._l2()
        for row in l2.tiers:
            if row.name in l2.failing:
                last = f", last: {row.last_error}" if row.last_error else ""
                reasons.append(
                    f"L2 tier {row.name} is failing ({row.errors} errors so far{last}); L1 still "
                    "serves, chunks only that tier holds are recomputed"
                )
        return Health("degraded" if reasons else "ok", reasons)

    def status(self) -> ServerStatus:
        """The picture of the server that the admin API, the page and the metrics read."""
        e = self.engine
        now = e.clock()
        with e.lock.hold("status"):
            l1 = e.l1.stats()
            clients = [
                ClientInfo(
                    # a prefix: enough to tell clients apart, never the whole id (a credential
                    # of the connection that made it: issue 10, finding 5)
                    client_id=c.client_id[:8],
                    connected_s=now - c.connected_at,
                    last_seen_s=now - c.last_seen,
                    registrations=list(c.registrations.values()),
                )
                for c in e.leases.peers.values()
            ]
            recent = list(e.recent_errors)
            requested, hit = e.lookup_totals()
        l2 = self._l2()
        health = self._health(l2)
        fencing, bounds = e.fencing_stats(), e.session_bounds()
        return ServerStatus(
            version=__version__,
            uptime_s=time.time() - e.started_at,
            ready=e.is_ready(),
            health=health.state,
            health_reasons=health.reasons,
            threads_healthy=self.registry.is_healthy(),
            config=e.config.to_dict(),
            l1=l1,
            l2=l2,
            clients=clients,
            sessions=SessionCounts(
                active=e.sessions.active_count(),
                created=e.sessions.created_count,
                # expired: left without end_session (SessionManager calls these orphans);
                # orphaned: those of them that still held pinned chunks when they expired
                expired=e.sessions.orphaned_count,
                orphaned=e.orphaned_sessions,
                tokens=bounds.tokens,
                shed=bounds.shed,
            ),
            fencing=fencing,
            lookup=LookupTotals(requested_tokens=requested, hit_tokens=hit),
            misses=self.metrics.misses(),
            funnel=self.metrics.funnel(),
            load_rates=e.tiers.rates.snapshot(),
            models=self.metrics.models(),
            hit_rate_history=self.metrics.history.points(),
            traffic=self.metrics.traffic(),
            latency=self.metrics.latency(),
            prefetch=e.prefetcher.stats(),
            lock_hold=e.lock_stats(),
            recent_errors=recent,
        )

    # -- sessions --------------------------------------------------------------------------

    def _session_info(self, session: Session) -> SessionInfo:
        tenant, salt, request_id = session_parts(session.request_id)
        return SessionInfo(
            session_id=session.request_id,
            tenant=tenant,
            cache_salt=salt,
            request_id=request_id,
            num_tokens=session.num_tokens,
            num_chunks_hashed=session.num_chunks_processed,
            created_at=session.created_at,
            last_access=session.last_access,
            pinned_chunks=len(self.engine.l1.pinned_keys(session.request_id)),
        )

    def list_sessions(self, offset: int, limit: int) -> tuple[int, list[SessionInfo]]:
        """(total, one page of sessions, newest first)."""
        e = self.engine
        sessions = sorted(e.sessions.sessions(), key=lambda s: s.created_at, reverse=True)
        with e.lock.hold("sessions"):
            page = [self._session_info(s) for s in sessions[offset : offset + limit]]
        return len(sessions), page

    def get_session(self, session_id: str) -> SessionInfo | None:
        """The session named `session_id` (see `session_key`), or None."""
        session = self.engine.sessions.peek(session_key(session_id))
        if session is None:
            return None
        with self.engine.lock.hold("sessions"):
            return self._session_info(session)

    def end_session(self, session_id: str) -> bool:
        """End the session named `session_id` (see `session_key`) and drop its pins; False if
        there was none."""
        return self.engine.end_session(session_key(session_id))

    # -- what each tier holds ----------------------------------------------------------------

    def chunks(self, tier: str, limit: int) -> TierChunks | None:
        """The complete groups `tier` holds (the L1, or an L2 tier that lists what it holds,
        as the disk tier does); None for a tier that does not exist or cannot list them."""
        e = self.engine
        if tier == L1_TIER:  # a slice at a time under the lock, never a scan of all of it
            total, held = complete_l1_groups(e.l1, e.lock, limit)
        else:
            found = [t for t in e.tiers.tiers if t.name == tier]
            if not found or not isinstance(found[0], ListsChunks):
                return None
            held = found[0].complete_chunks()
            total = len(held)
        return TierChunks(
            tier=tier,
            total=total,
            chunks=[
                HeldChunk(
                    model=shown(k.model),
                    cache_salt=shown(k.cache_salt),
                    world_size=k.world_size,
                    chunk_hash=k.chunk_hash.hex(),
                )
                for k in held[:limit]
            ],
        )

    # -- clear -----------------------------------------------------------------------------

    def clear(
        self, *, model: str | None = None, cache_salt: str | None = None, tenant: str = ""
    ) -> int:
        """Drop cached chunks matching the filters (None = any) from L1 and L2; how many.
        `model` and `cache_salt` name the tenant's (the anonymous tenant's by default)."""
        e = self.engine
        if model is not None:
            model = compose(tenant, model)
        if cache_salt is not None:
            cache_salt = compose(tenant, cache_salt)
        with e.lock.hold("clear"):
            cleared = e.l1.clear(model=model, cache_salt=cache_salt)
        return cleared + e.tiers.clear(model=model, cache_salt=cache_salt)


def session_parts(session_id: str) -> tuple[str, str, str]:
    """(tenant, cache salt, request id) of a session id the engine built."""
    parts = decompose(session_id)
    if len(parts) != 3:
        raise ValueError(f"not a session id: {session_id[:64]!r}")
    return parts[0], parts[1], parts[2]


def session_key(session_id: str) -> str:
    """An admin's name for a session: the `session_id` that `/sessions` lists, or a bare
    request id, which names the anonymous tenant's session of that id without a salt."""
    try:
        session_parts(session_id)
    except ValueError:
        return compose("", "", session_id)
    return session_id

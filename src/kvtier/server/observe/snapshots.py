"""Typed snapshots of a running server: what the admin JSON, the status page, `kvtier status` and
the Prometheus metrics read.

Each is a frozen msgspec Struct, encoded as-is by the admin API, so a field renamed here is
renamed everywhere (and mypy sees every reader); no consumer reads a dict by string key.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvtier.server.fencing import FencingStats
from kvtier.server.leases import Registration
from kvtier.server.locking import HoldStats
from kvtier.storage.l1 import L1Stats, TenantUsage
from kvtier.storage.loadrate import LoadRate
from kvtier.storage.manager import L2Summary
from kvtier.storage.prefetch import PrefetchStats

__all__ = [
    "ClientInfo",
    "ErrorRecord",
    "FunnelCount",
    "Health",
    "HeldChunk",
    "HitRatePoint",
    "L1Stats",
    "L2Summary",
    "LatencySummary",
    "LookupTotals",
    "MissCount",
    "ModelLookup",
    "PrefetchStats",
    "Registration",
    "ServerStatus",
    "SessionCounts",
    "SessionInfo",
    "TenantUsage",
    "TierChunks",
    "Traffic",
]


class ClientInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A connected engine process."""

    client_id: str  # the id's first 8 characters: the whole id is never shown
    connected_s: float
    last_seen_s: float
    registrations: list[Registration]


class SessionCounts(msgspec.Struct, frozen=True, kw_only=True):
    """Sessions now and since start.

    `expired` counts sessions that expired without `end_session`; `orphaned` counts those of
    them that still held pinned chunks when they expired (requests abandoned mid-flight).
    """

    active: int
    created: int
    expired: int
    orphaned: int
    tokens: int = 0  # tokens held by all sessions together (--max-session-tokens)
    shed: int = 0  # sessions ended early, longest-idle first, to stay within the bounds


class SessionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One session, as `GET /sessions` lists it.

    `session_id` names it in `/sessions/{session_id}`: the tenant, cache salt and request id,
    composed (`keys.compose`); the three are also shown apart.
    """

    session_id: str
    tenant: str
    cache_salt: str
    request_id: str
    num_tokens: int
    num_chunks_hashed: int
    created_at: float  # wall clock
    last_access: float
    pinned_chunks: int


class LookupTotals(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens lookups asked about and found cached, since start."""

    requested_tokens: int
    hit_tokens: int


class FunnelCount(msgspec.Struct, frozen=True, kw_only=True):
    """Lookup tokens at one stage of one tier's hit funnel since start (present,
    worth_loading, loaded: see `server.observe.funnel`)."""

    tier: str
    stage: str
    tokens: int


class MissCount(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens lookups missed for one reason (and the tier it is about, "" for none), since
    start; the reasons are `server.misses.MissReason`'s."""

    reason: str
    tier: str
    tokens: int


class ModelLookup(msgspec.Struct, frozen=True, kw_only=True):
    """Lookup totals of one model (models past the label bound are summed as "other")."""

    model: str
    requested_tokens: int
    hit_tokens: int
    lookups: int


class HitRatePoint(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Lookups in one interval of the server's hit-rate history (wall-clock start time)."""

    time: float
    requested_tokens: int
    hit_tokens: int


class Traffic(msgspec.Struct, frozen=True, kw_only=True):
    """KV bytes clients moved through the server since start."""

    stored_bytes: int
    retrieved_bytes: int


class LatencySummary(msgspec.Struct, frozen=True, kw_only=True):
    """Request latency of one user-facing operation, from the request-duration histogram.

    p50/p99 are the upper bounds of the buckets that hold those quantiles.
    """

    operation: str
    count: int
    mean_s: float
    p50_s: float
    p99_s: float


class ErrorRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A failed request or a tier failure, as the recent-errors list shows it."""

    time: float  # wall clock
    operation: str
    code: str
    message: str


class HeldChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One complete chunk group a tier holds: its model and salt as people read them
    (`keys.shown`), its rank count and its name (hex: the block hash its KV events carry)."""

    model: str
    cache_salt: str
    world_size: int
    chunk_hash: str


class TierChunks(msgspec.Struct, frozen=True, kw_only=True):
    """What `GET /chunks` returns: the first `limit` complete groups of one tier, of `total`."""

    tier: str
    total: int
    chunks: list[HeldChunk]


class ServerStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Everything `GET /status` returns."""

    version: str
    uptime_s: float
    ready: bool
    health: str  # "ok", "degraded" (a tier is failing: L1 still serves) or "unavailable"
    health_reasons: list[str]
    threads_healthy: bool
    config: dict[str, Any]  # ServerConfig's fields, credentials redacted
    l1: L1Stats
    l2: L2Summary
    clients: list[ClientInfo]
    sessions: SessionCounts
    fencing: FencingStats
    lookup: LookupTotals
    models: list[ModelLookup]
    hit_rate_history: list[HitRatePoint]
    traffic: Traffic
    latency: list[LatencySummary]
    prefetch: PrefetchStats
    lock_hold: dict[str, HoldStats]  # per operation: how long it held the engine lock
    recent_errors: list[ErrorRecord]
    #: missed tokens by reason, most first
    misses: list[MissCount] = msgspec.field(default_factory=list)
    #: the hit funnel: tokens by tier and stage
    funnel: list[FunnelCount] = msgspec.field(default_factory=list)
    #: each L2 tier's measured load speed, in read order
    load_rates: list[LoadRate] = msgspec.field(default_factory=list)


class Health(msgspec.Struct, frozen=True):
    """What `/health` answers: "ok", "degraded" (still serving) or "unavailable"."""

    state: str
    reasons: list[str]

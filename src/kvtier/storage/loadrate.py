"""What a load from each L2 tier costs, measured as the server serves, and which loads pay.

Each tier keeps a moving estimate of two figures: its latency (one round trip, from the
existence check that precedes every load: it moves no payload) and its read throughput (bytes a
batch read moved over the time it took beyond that latency). A load of n chunk groups from a
tier is predicted to take `latency + n * group_bytes / throughput`; the engine that asks states
how fast it recomputes (`prefill_tokens_per_s`), and a chunk of C tokens costs `C / prefill` to
recompute. `paying_prefix` picks the leading run of L2 chunks whose load saves the most time
against recomputing them: a chunk only pays when the chunks before it do, since a hit is a
prefix.

Each tenant has estimates of its own (what its own loads measured), and the hit gate of a
tenant's lookup reads only those: a tenant whose loads are all tiny (a read's fixed cost over
few bytes) drags down the throughput it sees itself, never the one another tenant's lookups are
gated by. The tier-wide estimate, over every tenant's loads, is what /status shows.

The estimates are exponentially weighted (`_WEIGHT` per sample): one slow read moves them a
fifth of the way, a tier that turned slow is seen within a few loads. A tier not measured yet
is trusted (predicted free): the first loads measure it, and refusing every load of an unmeasured
tier would mean it never is.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import msgspec

__all__ = ["LoadRate", "LoadRates", "paying_prefix"]

_WEIGHT = 0.2  # how far one sample moves the estimate
#: the part of a read's time counted as transfer at least: a read no slower than the probe's
#: round trip still moved its bytes in some time
_MIN_TRANSFER_SHARE = 0.25


class LoadRate(msgspec.Struct, frozen=True, kw_only=True):
    """One tier's load estimate now (what /status and /metrics show)."""

    tier: str
    bytes_per_s: float  # 0 = not measured yet
    latency_s: float
    reads: int  # batch reads measured
    bytes_read: int

    def seconds(self, nbytes: int) -> float:
        """The predicted time of one batch read of `nbytes` (0 while unmeasured)."""
        if self.bytes_per_s <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bytes_per_s


class _Estimate:
    __slots__ = ("bytes_per_s", "bytes_read", "latency_s", "probes", "reads")

    def __init__(self) -> None:
        self.bytes_per_s = 0.0
        self.latency_s = 0.0
        self.probes = 0
        self.reads = 0
        self.bytes_read = 0


def _moved(old: float, sample: float, first: bool) -> float:
    return sample if first else old + _WEIGHT * (sample - old)


class LoadRates:
    """The per-tier estimates; fed by the tier manager's reads, read by prefetch jobs.

    Thread-safe (the readers and the admin views share it); each call holds a small lock for a
    few arithmetic operations.
    """

    def __init__(self, tiers: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self._est = {name: _Estimate() for name in tiers}
        self._tenants: dict[tuple[str, str], _Estimate] = {}  # (tier, tenant)

    def _both(self, tier: str, tenant: str | None) -> tuple[_Estimate, ...]:
        """The tier-wide estimate and, for a tenant, its own; under `_lock`."""
        if tenant is None:
            return (self._est[tier],)
        own = self._tenants.get((tier, tenant))
        if own is None:
            own = self._tenants[tier, tenant] = _Estimate()
        return self._est[tier], own

    def observe_probe(self, tier: str, seconds: float, tenant: str | None = None) -> None:
        """An existence check of `tier` for `tenant` took `seconds`: one round trip."""
        with self._lock:
            for est in self._both(tier, tenant):
                est.latency_s = _moved(est.latency_s, max(0.0, seconds), est.probes == 0)
                est.probes += 1

    def observe_read(
        self, tier: str, nbytes: int, seconds: float, tenant: str | None = None
    ) -> None:
        """A batch read of `tier` for `tenant` moved `nbytes` in `seconds` (reads that moved
        nothing teach nothing about throughput and are not passed)."""
        if nbytes <= 0:
            return
        with self._lock:
            for est in self._both(tier, tenant):
                transfer = max(seconds - est.latency_s, _MIN_TRANSFER_SHARE * seconds, 1e-9)
                est.bytes_per_s = _moved(est.bytes_per_s, nbytes / transfer, est.reads == 0)
                est.reads += 1
                est.bytes_read += nbytes

    def get(self, tier: str, tenant: str | None = None) -> LoadRate:
        """`tier`'s estimate: tier-wide, or `tenant`'s own (unmeasured until its first load)."""
        with self._lock:
            est = self._est[tier] if tenant is None else self._tenants.get((tier, tenant))
            if est is None:
                est = _Estimate()
            return LoadRate(
                tier=tier,
                bytes_per_s=est.bytes_per_s,
                latency_s=est.latency_s,
                reads=est.reads,
                bytes_read=est.bytes_read,
            )

    def snapshot(self, tenant: str | None = None) -> list[LoadRate]:
        """Every tier's estimate (tier-wide, or `tenant`'s own), in read order."""
        return [self.get(name, tenant) for name in list(self._est)]


def paying_prefix(
    chunk_tiers: Sequence[Sequence[int]],
    rates: Sequence[LoadRate],
    *,
    shard_bytes: int,
    chunk_tokens: int,
    prefill_tokens_per_s: float,
) -> int:
    """How many leading chunks are worth loading: the prefix that saves the most time.

    `chunk_tiers[i]` holds, for each shard of chunk i, the index (into `rates`) of the tier that
    serves it. Each tier a load reads from costs its latency once (its shards are one pipelined
    batch) and its shards' bytes at its throughput. With `prefill_tokens_per_s` 0 (unknown)
    every chunk is worth loading.
    """
    if prefill_tokens_per_s <= 0:
        return len(chunk_tiers)
    recompute_s = chunk_tokens / prefill_tokens_per_s
    used = [False] * len(rates)
    saved = best = 0.0
    best_n = 0
    for n, tiers in enumerate(chunk_tiers, 1):
        load_s = 0.0
        for t in tiers:
            rate = rates[t]
            if rate.bytes_per_s > 0:
                load_s += shard_bytes / rate.bytes_per_s
                if not used[t]:
                    used[t] = True
                    load_s += rate.latency_s
        saved += recompute_s - load_s
        if saved >= best:  # ties go to the longer prefix: equal time, less compute
            best, best_n = saved, n
    return best_n

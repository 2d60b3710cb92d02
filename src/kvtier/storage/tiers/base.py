"""The L2 tier interface and its typed stats (`TierStats`); tiers are opened by URL in `registry`.

An L2 tier stores one rank's shard of one chunk (an `ObjectKey`) with its layout string, in the
shared object format of `kvtier.storage.tiers.format`, so a reader can tell a sound object from a
corrupted or misnamed one and never serves the latter.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

import msgspec
from typing_extensions import Buffer

from kvtier.keys import ObjectKey
from kvtier.storage.tiers.format import Hit

#: upper bounds (seconds) of the latency histogram buckets; one more bucket counts the rest
LATENCY_BOUNDS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip


class Latency(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Latencies of one kind of tier call, summable across tiers, processes and scrapes.

    `buckets[i]` counts calls that took at most `LATENCY_BOUNDS_S[i]` seconds and more than the
    bound before it (not cumulative); the last bucket counts calls above the largest bound. A
    Prometheus histogram is the running sum of `buckets`, with `total_s` and `count`.
    """

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    buckets: tuple[int, ...] = (0,) * (len(LATENCY_BOUNDS_S) + 1)

    def merged(self, other: Latency) -> Latency:
        """The latencies of both (for a node-wide or fleet-wide view)."""
        return Latency(
            count=self.count + other.count,
            total_s=self.total_s + other.total_s,
            max_s=max(self.max_s, other.max_s),
            buckets=tuple(a + b for a, b in zip(self.buckets, other.buckets, strict=True)),
        )


class CodecStats(msgspec.Struct, frozen=True, kw_only=True):
    """What a tier's codec did since the tier was opened (see `kvtier.storage.tiers.codecs`).

    `raw_bytes` are the payload bytes the tier was given to write and `stored_bytes` what they
    took once encoded (the same for `none`, and for objects a codec stores plain: `stored_raw`
    counts those); `ratio` is raw over stored. `decoded_bytes` are payload bytes reads decoded
    from coded objects (any codec: a tier reads what it stored under an earlier codec too).
    """

    name: str = "none"
    raw_bytes: int = 0
    stored_bytes: int = 0
    encoded: int = 0  # objects stored coded
    stored_raw: int = 0  # objects the codec could not take (their dtype), or did not shrink
    encode_s: float = 0.0
    decoded: int = 0  # coded objects read back
    decoded_bytes: int = 0
    decode_s: float = 0.0

    @property
    def ratio(self) -> float:
        """Payload bytes written per byte stored (1.0 before any write)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


class TierStats(msgspec.Struct, frozen=True, kw_only=True):
    """One tier's counters and gauges, as /health, /metrics and the status page read them.

    Counters count since the tier was opened in this process. `objects`, `used_bytes` and
    `capacity_bytes` (0 = unbounded or unknown) describe the whole store: for Redis they are the
    server's (or all cluster masters') figures, shared with other processes and prefixes.
    `healthy` is False while the tier skips its backend after a failure, or had an error in the
    last few seconds; `last_error` is the latest error's text ("" when none), with no secrets.
    `extra` holds counters only one kind of tier has (disk evictions, Redis skips...).
    """

    name: str
    kind: str  # "disk", "redis", "redis+cluster", "mooncake"
    url: str  # the tier's URL with any password replaced by "***"
    healthy: bool
    last_error: str
    objects: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    corrupt: int  # reads that found a damaged or misnamed object (deleted)
    errors: int  # backend failures (I/O errors, connection failures, error replies)
    layout_mismatches: int
    size_mismatches: int
    puts: int
    bytes_written: int
    bytes_read: int
    read_latency: Latency
    write_latency: Latency
    extra: dict[str, int] = msgspec.field(default_factory=dict)
    codec: CodecStats = msgspec.field(default_factory=CodecStats)


@runtime_checkable
class L2Tier(Protocol):
    """A second-level store behind the shared-memory L1 (local disk, Redis/Valkey...).

    Reads never raise for a miss, a layout or size mismatch, a corrupted object (deleted and
    counted as `corrupt`) or an unreachable backend (counted as `errors`): they return False.
    On False the contents of `out` are unspecified.
    """

    name: str
    #: whether other servers read this tier (Redis, Valkey, Mooncake) or only this one (disk)
    shared: bool

    def put(self, key: ObjectKey, data: Buffer, layout: str, *, resumable: bool = True) -> None:
        """Store `data` under `key` with `layout`, replacing any older object; `resumable`
        False marks it no resume point (`format.UNRESUMABLE`)."""
        ...

    def put_many(
        self,
        items: Sequence[tuple[ObjectKey, Buffer, str]],
        *,
        unresumable: Collection[ObjectKey] = (),
    ) -> int:
        """Store several objects (those in `unresumable` marked as in `put`); returns how many
        were written."""
        ...

    def get_into(self, key: ObjectKey, out: memoryview, layout: str) -> Hit:
        """Copy the payload into `out` (whose length must equal it); a false Hit on any kind
        of miss, else whether the object is a resume point."""
        ...

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[Hit]:
        """`get_into` for several objects, one Hit per item."""
        ...

    def contains(self, key: ObjectKey) -> bool:
        """Whether an object is stored under `key` (its content is not checked)."""
        ...

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """`contains` for several keys."""
        ...

    def delete(self, key: ObjectKey) -> bool:
        """Remove the object under `key`; True when there was one."""
        ...

    def clear(self, *, model: str | None = None, cache_salt: str | None = None) -> int:
        """Remove every object of this tier matching the filters; returns how many."""
        ...

    def stats(self) -> TierStats:
        """This tier's counters and gauges (see `TierStats`)."""
        ...

    def close(self) -> None:
        """Release files, connections and threads; the tier is unusable afterwards."""
        ...


@runtime_checkable
class RegistersMemory(Protocol):
    """A tier whose transfers need memory registered with it (Mooncake's transfer engine):
    the server hands it the arena once, and its batch reads and writes then move bytes between
    L1 slots and the backend in place."""

    def register_memory(self, buffer: memoryview) -> None: ...

"""Prefetcher: groups that every rank has in L2 come up into L1 on a worker thread, the first
failure ends the run, and at most max_jobs run at once."""

from __future__ import annotations

import os
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvtier.keys import ChunkKey, ObjectKey
from kvtier.storage import prefetch as prefetch_mod
from kvtier.storage.arena import Arena
from kvtier.storage.l1 import L1Store
from kvtier.storage.manager import Found, TierManager
from kvtier.storage.prefetch import LoadOutcome, Prefetcher
from kvtier.storage.tiers.disk import DiskTier

NBYTES = 4096
LAYOUT = "uint8[4096]"


@pytest.fixture
def arena() -> Iterator[Arena]:
    with Arena.create(f"kvtier-prefetch-{os.getpid()}-{uuid.uuid4().hex[:6]}", 1 << 20) as a:
        yield a


def keys(n: int, ws: int = 2) -> list[ChunkKey]:
    return [ChunkKey("m", "", ws, bytes([i]) * 32) for i in range(n)]


def run_job(l1: L1Store, arena: Arena, tiers: TierManager, chain: list[ChunkKey]) -> list[ChunkKey]:
    """One prefetch job to its end; what on_done saw, checked to be held while it ran."""
    lock = threading.RLock()
    done = threading.Event()
    seen: list[ChunkKey] = []

    def on_done(outcome: LoadOutcome) -> None:
        loaded = outcome.loaded
        seen.extend(loaded)
        assert l1.count_prefix(loaded) == len(loaded)  # complete while the caller pins them
        done.set()

    prefetcher = Prefetcher(l1, arena, tiers, lambda: lock, max_jobs=2, lease_s=5, chunk_size=16)
    assert prefetcher.submit(chain, nbytes=NBYTES, layout=LAYOUT, on_done=on_done)
    assert done.wait(10)
    prefetcher.close()
    assert prefetcher.in_flight == 0
    return seen


def test_loads_leading_groups_complete_in_l2(arena: Arena, tmp_path: Path) -> None:
    tiers = TierManager([DiskTier(tmp_path, 1 << 30)])
    chain = keys(4)
    for i, key in enumerate(chain):
        for rank in range(2):
            if (i, rank) != (2, 1):  # chunk 2 lacks rank 1's shard: the run ends before it
                tiers.tiers[0].put(key.shard(rank), bytes([i * 2 + rank]) * NBYTES, LAYOUT)
    l1 = L1Store(arena.size)
    assert run_job(l1, arena, tiers, chain) == chain[:2]
    assert l1.stats().pinned_groups == 0
    assert l1.count_prefix(chain) == 2
    offset, size, _ = l1.get_shard(chain[1], 1) or (0, 0, "")
    assert bytes(arena.view(offset, size)) == bytes([3]) * NBYTES
    tiers.close()


def test_a_corrupted_shard_ends_the_run_and_leaves_no_staging(arena: Arena, tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 30)
    tiers = TierManager([disk])
    chain = keys(3, ws=1)
    for i, key in enumerate(chain):
        disk.put(key.shard(0), bytes([i]) * NBYTES, LAYOUT)
    victim = next(p for p in tmp_path.rglob("*") if p.name == chain[1].shard(0).to_str())
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    l1 = L1Store(arena.size)
    assert run_job(l1, arena, tiers, chain) == chain[:1]
    assert l1.stats().staging_shards == 0
    assert disk.stats().corrupt == 1
    tiers.close()


def test_at_most_max_jobs_run_at_once(arena: Arena, tmp_path: Path) -> None:
    tiers = TierManager([DiskTier(tmp_path, 1 << 30)])
    lock = threading.RLock()
    l1 = L1Store(arena.size)
    prefetcher = Prefetcher(l1, arena, tiers, lambda: lock, max_jobs=2, lease_s=5, chunk_size=16)
    finished = threading.Semaphore(0)
    with lock:  # the jobs cannot end while the test holds the lock
        assert prefetcher.submit(
            keys(1), nbytes=NBYTES, layout=LAYOUT, on_done=lambda _: finished.release()
        )
        assert prefetcher.submit(
            keys(1), nbytes=NBYTES, layout=LAYOUT, on_done=lambda _: finished.release()
        )
        assert not prefetcher.submit(keys(1), nbytes=NBYTES, layout=LAYOUT, on_done=lambda _: None)
        assert prefetcher.refused == 1
    assert finished.acquire(timeout=10) and finished.acquire(timeout=10)
    prefetcher.close()
    assert prefetcher.in_flight == 0 and prefetcher.started == 2
    tiers.close()


@pytest.mark.skipif(sys.platform != "linux", reason="nice is per thread only on Linux")
def test_tier_reads_run_at_a_lower_cpu_priority_and_the_lock_work_does_not(
    arena: Arena, tmp_path: Path
) -> None:
    """The reads run on a thread niced by _READ_NICE (up to 19); on_done, under the lock, runs
    on a worker at the process's own priority, so a hold of the lock is never starved."""

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen: dict[str, int] = {}

    class Recording(TierManager):
        def get_many_into(
            self, items: Sequence[tuple[ObjectKey, memoryview, str]], tenant: str | None = None
        ) -> list[Found | None]:
            seen["read"] = nice()
            return super().get_many_into(items, tenant)

    tiers = Recording([DiskTier(tmp_path, 1 << 30)])
    chain = keys(2, ws=1)
    for key in chain:
        tiers.tiers[0].put(key.shard(0), bytes(NBYTES), LAYOUT)
    done = threading.Event()

    def on_done(outcome: LoadOutcome) -> None:
        seen["on_done"] = nice()
        done.set()

    lock = threading.RLock()
    prefetcher = Prefetcher(
        L1Store(arena.size), arena, tiers, lambda: lock, max_jobs=1, lease_s=5, chunk_size=16
    )
    assert prefetcher.submit(chain, nbytes=NBYTES, layout=LAYOUT, on_done=on_done)
    assert done.wait(10)
    prefetcher.close()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert seen == {"read": min(19, base + prefetch_mod._READ_NICE), "on_done": base}
    tiers.close()


def outcome_of(
    tiers: TierManager, arena: Arena, chain: list[ChunkKey], prefill_tokens_per_s: float = 0.0
) -> LoadOutcome:
    lock = threading.RLock()
    done = threading.Event()
    seen: list[LoadOutcome] = []

    def on_done(outcome: LoadOutcome) -> None:
        seen.append(outcome)
        done.set()

    prefetcher = Prefetcher(
        L1Store(arena.size), arena, tiers, lambda: lock, max_jobs=1, lease_s=5, chunk_size=16
    )
    assert prefetcher.submit(
        chain,
        nbytes=NBYTES,
        layout=LAYOUT,
        on_done=on_done,
        prefill_tokens_per_s=prefill_tokens_per_s,
    )
    assert done.wait(10)
    prefetcher.close()
    return seen[0]


def test_the_outcome_says_what_became_of_each_chunk(arena: Arena, tmp_path: Path) -> None:
    tiers = TierManager([DiskTier(tmp_path, 1 << 30)])
    chain = keys(5)
    for i, key in enumerate(chain):
        for rank in range(2):
            if i != 3 and (i, rank) != (2, 1):  # 2: rank 0 only; 3: nothing
                tiers.tiers[0].put(key.shard(rank), bytes(NBYTES), LAYOUT)
    S = prefetch_mod.LoadStatus
    got = outcome_of(tiers, arena, chain)
    assert got.loaded == chain[:2]
    assert got.statuses == [S.LOADED, S.LOADED, S.PARTIAL, S.ABSENT, S.BEHIND]
    assert got.tiers == ["disk", "disk", "disk", "", "disk"]
    tiers.close()


def test_a_load_slower_than_the_stated_prefill_is_left_out(arena: Arena, tmp_path: Path) -> None:
    tiers = TierManager([DiskTier(tmp_path, 1 << 30)])
    chain = keys(3, ws=1)
    for key in chain:
        tiers.tiers[0].put(key.shard(0), bytes(NBYTES), LAYOUT)
    tiers.rates.observe_read("disk", NBYTES, 1.0, "")  # measured: 4 KiB a second
    S = prefetch_mod.LoadStatus
    got = outcome_of(tiers, arena, chain, prefill_tokens_per_s=1000.0)  # 16 ms a chunk
    assert got.loaded == [] and got.statuses == [S.SLOW] * 3
    # another tenant's slow (or tiny) loads teach this tenant's gate nothing
    tiers.rates.observe_read("disk", NBYTES, 1000.0, "mallory")
    assert tiers.rates.get("disk", "").bytes_per_s == NBYTES / 1.0
    got = outcome_of(tiers, arena, chain, prefill_tokens_per_s=1.0)  # 16 s a chunk
    assert got.loaded == chain and got.statuses == [S.LOADED] * 3
    tiers.close()

"""Tests for kvtier.storage.l1: shard states, completeness, LRU eviction, pins and leases."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.clock import FakeClock

from kvtier.errors import NoSpaceError, UnknownReservationError
from kvtier.keys import ChunkKey
from kvtier.server.observe.snapshots import L1Stats, TenantUsage
from kvtier.storage.admission import AdmissionStats
from kvtier.storage.arena import PAGE_SIZE
from kvtier.storage.l1 import L1Store

PAGE = PAGE_SIZE


def key(i: int, *, world_size: int = 1, model: str = "m", salt: str = "") -> ChunkKey:
    return ChunkKey(model, salt, world_size, i.to_bytes(8, "big"))


def store(l1: L1Store, k: ChunkKey, size: int = PAGE, *, owner: str = "w") -> None:
    """Write every rank's shard of `k` and commit it."""
    for rank in range(k.world_size):
        assert l1.reserve(k, rank, size, owner=owner, lease_s=30) is not None
        l1.commit(k, rank, owner=owner)


def make(pages: int) -> tuple[L1Store, FakeClock, list[tuple[ChunkKey, int]]]:
    clock = FakeClock()
    evicted: list[tuple[ChunkKey, int]] = []
    l1 = L1Store(pages * PAGE, clock=clock, on_evict=lambda k, n: evicted.append((k, n)))
    return l1, clock, evicted


def test_staging_shard_is_invisible_until_commit() -> None:
    l1, _, _ = make(4)
    k = key(1)
    offset = l1.reserve(k, 0, 100, owner="w", lease_s=30, layout="L")
    assert offset is not None and offset % PAGE == 0
    assert l1.get_shard(k, 0) is None
    assert not l1.is_complete(k)
    assert l1.count_prefix([k]) == 0
    assert l1.num_groups == 1 and l1.num_ready_groups == 0
    assert l1.reserve(k, 0, 100, owner="other", lease_s=30) is None, "staging shard exists"
    assert l1.commit(k, 0, owner="w") is True
    assert l1.get_shard(k, 0) == (offset, 100, "L")
    assert l1.is_complete(k)
    assert l1.reserve(k, 0, 100, owner="w", lease_s=30) is None, "ready shard exists"
    assert l1.used_bytes == PAGE


def test_group_is_complete_only_with_every_rank() -> None:
    l1, _, _ = make(8)
    k = key(1, world_size=3)
    for rank in range(3):
        assert l1.reserve(k, rank, PAGE, owner=f"w{rank}", lease_s=30) is not None
    assert l1.commit(k, 2, owner="w2") is False
    assert l1.commit(k, 0, owner="w0") is False
    assert l1.get_shard(k, 0) is not None
    assert not l1.is_complete(k)
    assert l1.count_prefix([k]) == 0
    assert list(l1.iter_groups()) == [(k, 2, False)]
    assert l1.commit(k, 1, owner="w1") is True
    assert l1.is_complete(k)
    assert l1.num_ready_groups == 1
    offsets = {l1.get_shard(k, r)[0] for r in range(3)}  # type: ignore[index]
    assert len(offsets) == 3


def test_count_prefix_stops_at_the_first_gap() -> None:
    l1, _, _ = make(8)
    chain = [key(i) for i in range(5)]
    for k in (chain[0], chain[1], chain[3], chain[4]):
        store(l1, k)
    assert l1.count_prefix(chain) == 2
    assert l1.count_prefix(chain[3:]) == 2
    assert l1.count_prefix([]) == 0
    assert l1.count_prefix([key(99)]) == 0


def test_keys_differing_in_salt_or_model_do_not_alias() -> None:
    l1, _, _ = make(4)
    store(l1, key(1, salt="a"))
    assert l1.is_complete(key(1, salt="a"))
    assert not l1.is_complete(key(1, salt="b"))
    assert not l1.is_complete(key(1, model="other", salt="a"))


def test_commit_and_abort_check_the_owner() -> None:
    l1, _, _ = make(4)
    k = key(1)
    l1.reserve(k, 0, PAGE, owner="w", lease_s=30)
    with pytest.raises(UnknownReservationError, match="belongs to 'w'"):
        l1.commit(k, 0, owner="intruder")
    with pytest.raises(UnknownReservationError, match="belongs to 'w'"):
        l1.abort(k, 0, owner="intruder")
    with pytest.raises(UnknownReservationError, match="no staging reservation"):
        l1.commit(key(2), 0, owner="w")
    l1.abort(k, 0, owner="w")
    assert l1.num_groups == 0 and l1.used_bytes == 0
    with pytest.raises(UnknownReservationError):
        l1.commit(k, 0, owner="w")


def test_commit_twice_raises() -> None:
    l1, _, _ = make(4)
    store(l1, key(1))
    with pytest.raises(UnknownReservationError):
        l1.commit(key(1), 0, owner="w")


def test_bad_arguments_raise_value_error() -> None:
    l1, _, _ = make(4)
    with pytest.raises(ValueError, match="positive"):
        l1.reserve(key(1), 0, 0, owner="w", lease_s=30)
    with pytest.raises(ValueError, match=r"range\(2\)"):
        l1.reserve(key(1, world_size=2), 2, PAGE, owner="w", lease_s=30)
    with pytest.raises(ValueError, match="worker_id -1"):
        l1.reserve(key(1), -1, PAGE, owner="w", lease_s=30)
    with pytest.raises(ValueError, match="lease_s"):
        l1.reserve(key(1), 0, PAGE, owner="w", lease_s=0)
    with pytest.raises(ValueError, match="--l1-size"):
        L1Store(0)
    assert l1.num_groups == 0


def test_lru_evicts_least_recently_used_first() -> None:
    l1, _, evicted = make(3)
    a, b, c, d = (key(i) for i in range(4))
    for k in (a, b, c):
        store(l1, k)
    l1.touch([a])
    store(l1, d)
    assert evicted == [(b, PAGE)]
    assert not l1.is_complete(b)
    assert all(l1.is_complete(k) for k in (a, c, d))
    store(l1, key(5))
    assert evicted[-1] == (c, PAGE)
    assert l1.stats().evictions == 2
    assert l1.stats().evicted_bytes == 2 * PAGE


def test_commit_makes_a_group_most_recent() -> None:
    l1, _, evicted = make(3)
    a, b = key(1), key(2)
    store(l1, a)
    l1.reserve(b, 0, PAGE, owner="w", lease_s=30)  # reserved before c, committed after it
    store(l1, key(3))
    l1.commit(b, 0, owner="w")
    store(l1, key(4))
    store(l1, key(5))
    assert [k for k, _ in evicted] == [a, key(3)]


def test_touching_a_chain_evicts_its_tail_first() -> None:
    l1, _, evicted = make(3)
    chain = [key(i) for i in range(3)]
    for k in chain:
        store(l1, k)
    l1.touch(chain)
    store(l1, key(10))
    assert evicted == [(chain[2], PAGE)]
    assert l1.count_prefix(chain) == 2
    l1.touch([key(10), key(404)])  # unknown keys are ignored
    store(l1, key(11))
    assert evicted[-1] == (chain[1], PAGE)


def test_eviction_removes_every_rank_of_a_group() -> None:
    l1, _, evicted = make(4)
    a = key(1, world_size=2)
    store(l1, a)
    store(l1, key(2, world_size=2))
    store(l1, key(3), 2 * PAGE)
    assert evicted == [(a, 2 * PAGE)]
    assert l1.get_shard(a, 0) is None and l1.get_shard(a, 1) is None
    assert l1.used_bytes == 4 * PAGE


def test_incomplete_groups_are_evictable() -> None:
    l1, _, evicted = make(2)
    half = key(1, world_size=2)
    l1.reserve(half, 0, PAGE, owner="w0", lease_s=30)
    l1.commit(half, 0, owner="w0")  # rank 1 never stores: it died
    store(l1, key(2))
    store(l1, key(3))
    assert evicted == [(half, PAGE)]


def test_aborted_rank_leaves_its_group_first_in_line() -> None:
    l1, _, evicted = make(3)
    half = key(1, world_size=2)
    l1.reserve(half, 0, PAGE, owner="w0", lease_s=30)
    l1.reserve(half, 1, PAGE, owner="w1", lease_s=30)
    store(l1, key(2))
    l1.commit(half, 0, owner="w0")
    l1.abort(half, 1, owner="w1")
    assert list(l1.iter_groups()) == [(half, 1, False), (key(2), 1, False)]
    store(l1, key(3))
    store(l1, key(4))
    assert evicted[0] == (half, PAGE)


def test_eviction_continues_past_fragmentation() -> None:
    l1, _, evicted = make(4)
    a, b, c, d = (key(i) for i in range(4))
    for k in (a, b, c, d):
        store(l1, k)
    l1.pin("h", [c], ranks=[0], lease_s=30)
    store(l1, key(9), 2 * PAGE)  # a's page alone is too small: b must go too
    assert [k for k, _ in evicted] == [a, b]
    assert l1.get_shard(key(9), 0) == (0, 2 * PAGE, "")
    assert l1.is_complete(c) and l1.is_complete(d)


def test_fragmented_pins_raise_no_space_after_evicting() -> None:
    l1, _, _ = make(4)
    a, b, c, d = (key(i) for i in range(4))
    for k in (a, b, c, d):
        store(l1, k)
    l1.pin("h", [b, d], ranks=[0], lease_s=30)
    with pytest.raises(NoSpaceError, match="largest contiguous"):
        store(l1, key(9), 2 * PAGE)
    assert l1.used_bytes == 2 * PAGE
    assert l1.num_groups == 2


def test_pinned_groups_survive_eviction_pressure() -> None:
    l1, _, evicted = make(3)
    a, b, c = key(1), key(2), key(3)
    for k in (a, b, c):
        store(l1, k)
    l1.pin("req", [a, b], ranks=[0], lease_s=30)
    assert l1.stats().pinned_groups == 2
    for i in range(10, 15):
        store(l1, key(i))
    assert l1.is_complete(a) and l1.is_complete(b)
    assert evicted[0] == (c, PAGE)
    assert not l1.drop(a)


def test_no_space_when_everything_is_pinned_or_staging() -> None:
    l1, _, evicted = make(3)
    store(l1, key(1))
    l1.pin("req", [key(1)], ranks=[0], lease_s=30)
    l1.reserve(key(2), 0, PAGE, owner="w", lease_s=30)
    l1.acquire(key(1))
    store(l1, key(3))
    l1.acquire(key(3))
    with pytest.raises(NoSpaceError) as info:
        l1.reserve(key(4), 0, PAGE, owner="w", lease_s=30)
    message = str(info.value)
    assert "--l1-size" in message
    assert f"{2 * PAGE} pinned" in message and f"{PAGE} staging" in message
    assert evicted == []
    assert l1.num_groups == 3


def test_a_shard_larger_than_capacity_does_not_flush_the_cache() -> None:
    l1, _, evicted = make(2)
    store(l1, key(1))
    with pytest.raises(NoSpaceError, match=f"{3 * PAGE}-byte"):
        l1.reserve(key(2), 0, 3 * PAGE, owner="w", lease_s=30)
    assert evicted == []
    assert l1.is_complete(key(1))


def test_room_for_a_new_rank_never_evicts_its_own_group() -> None:
    l1, _, evicted = make(2)
    k = key(1, world_size=2)
    l1.reserve(k, 0, PAGE, owner="w0", lease_s=30)
    l1.commit(k, 0, owner="w0")
    store(l1, key(2))
    assert l1.reserve(k, 1, PAGE, owner="w1", lease_s=30) is not None
    assert evicted == [(key(2), PAGE)]
    assert l1.commit(k, 1, owner="w1") is True
    with pytest.raises(NoSpaceError):
        l1.reserve(key(3, world_size=2), 0, 3 * PAGE, owner="w0", lease_s=30)
    assert l1.is_complete(k)


def test_staging_leases_expire() -> None:
    l1, clock, _ = make(4)
    k = key(1)
    l1.reserve(k, 0, PAGE, owner="w", lease_s=10)
    clock.now += 5
    assert l1.reclaim_staging() == 0
    assert l1.stats().staging_shards == 1
    clock.now += 6
    assert l1.reclaim_staging() == 1
    assert l1.used_bytes == 0 and l1.num_groups == 0
    assert l1.stats().staging_shards == 0
    with pytest.raises(UnknownReservationError):
        l1.commit(k, 0, owner="w")


def test_reclaim_staging_by_owner() -> None:
    l1, _, _ = make(8)
    k = key(1, world_size=2)
    l1.reserve(k, 0, PAGE, owner="w0", lease_s=100)
    l1.reserve(k, 1, PAGE, owner="w1", lease_s=100)
    l1.reserve(key(2), 0, PAGE, owner="w0", lease_s=100)
    l1.commit(k, 0, owner="w0")
    assert l1.reclaim_staging("w0") == 1  # the ready shard is not w0's to drop any more
    assert l1.reclaim_staging("w1") == 1
    assert list(l1.iter_groups()) == [(k, 1, False)]
    assert l1.used_bytes == PAGE


def test_mark_retrieved_releases_after_every_rank() -> None:
    l1, _, _ = make(4)
    k = key(1, world_size=2)
    store(l1, k)
    l1.pin("req", [k, key(404)], ranks=[0, 1], lease_s=30)
    assert l1.pinned_keys("req") == [k]
    assert list(l1.iter_groups()) == [(k, 2, True)]
    assert l1.mark_retrieved("req", 0) is False
    assert l1.mark_retrieved("req", 0) is False
    assert not l1.drop(k)
    assert l1.mark_retrieved("req", 1) is True
    assert l1.pinned_keys("req") == []
    assert l1.mark_retrieved("req", 1) is False
    assert l1.mark_retrieved("nobody", 0) is False
    assert l1.stats().pinned_groups == 0
    assert l1.drop(k)


def test_pin_replaces_the_previous_pin() -> None:
    l1, _, _ = make(4)
    a, b = key(1), key(2)
    store(l1, a)
    store(l1, b)
    l1.pin("req", [a], ranks=[0], lease_s=30)
    l1.pin("req", [a, b], ranks=[0], lease_s=30)
    assert l1.pinned_keys("req") == [a, b]
    assert l1.stats().pinned_groups == 2
    l1.pin("req", [b], ranks=[0], lease_s=30)
    assert l1.stats().pinned_groups == 1
    assert l1.drop(a) and not l1.drop(b)
    assert l1.unpin("req") is True
    assert l1.unpin("req") is False
    assert l1.drop(b)


def test_released_pins_keep_the_chain_head_most_recent() -> None:
    l1, _, evicted = make(3)
    chain = [key(i) for i in range(3)]
    for k in chain:
        store(l1, k)
    l1.pin("req", chain, ranks=[0], lease_s=30)
    l1.unpin("req")
    store(l1, key(10))
    assert evicted == [(chain[2], PAGE)]


def test_pin_leases_expire_and_renew() -> None:
    l1, clock, _ = make(4)
    store(l1, key(1))
    store(l1, key(2))
    l1.pin("a", [key(1)], ranks=[0], lease_s=10)
    l1.pin("b", [key(2)], ranks=[0], lease_s=10)
    clock.now += 8
    l1.renew("a", 10)
    clock.now += 5
    assert len(l1.reclaim_pins()) == 1
    assert l1.pinned_keys("b") == [] and l1.pinned_keys("a") == [key(1)]
    with pytest.raises(UnknownReservationError, match="'b'"):
        l1.renew("b", 10)
    clock.now += 6
    assert len(l1.reclaim_pins()) == 1
    assert l1.stats().pinned_groups == 0


def test_acquire_and_release_are_counted() -> None:
    l1, _, _ = make(4)
    k = key(1)
    store(l1, k)
    first = l1.acquire(k)
    second = l1.acquire(k)
    l1.pin("req", [k], ranks=[0], lease_s=30)
    l1.unpin("req")
    l1.release(first)
    assert not l1.drop(k)
    l1.release(second)
    with pytest.raises(ValueError, match="without a matching acquire"):
        l1.release(second)
    with pytest.raises(KeyError):
        l1.acquire(key(2))
    assert l1.drop(k)
    assert not l1.drop(k)


def test_aborting_the_last_shard_of_a_held_group_removes_it_on_release() -> None:
    l1, _, _ = make(4)
    k = key(1)
    l1.reserve(k, 0, PAGE, owner="w", lease_s=30)
    held = l1.acquire(k)
    l1.abort(k, 0, owner="w")
    assert l1.num_groups == 1 and l1.used_bytes == 0
    l1.release(held)
    assert l1.num_groups == 0


def test_drop_refuses_staging_groups() -> None:
    l1, _, _ = make(4)
    k = key(1, world_size=2)
    store(l1, key(2))
    l1.reserve(k, 0, PAGE, owner="w", lease_s=30)
    assert not l1.drop(k)
    assert not l1.drop(key(3))
    assert l1.drop(key(2))
    assert l1.num_groups == 1


def test_clear_by_model_and_salt() -> None:
    l1, _, _ = make(16)
    groups = [
        key(i, model=m, salt=s)
        for i, (m, s) in enumerate(
            [("m1", "a"), ("m1", "b"), ("m2", "a"), ("m2", "b"), ("m1", "a")]
        )
    ]
    for k in groups:
        store(l1, k)
    l1.pin("req", [groups[4]], ranks=[0], lease_s=30)
    l1.reserve(key(50, model="m1", salt="a"), 0, PAGE, owner="w", lease_s=30)
    # Idle, pinned and staging groups alike leave view at once (issue 10, finding 7).
    assert l1.clear(model="m1", cache_salt="a") == 3
    assert not l1.is_complete(groups[0]) and not l1.is_complete(groups[4])
    assert l1.count_prefix([groups[4]]) == 0 and l1.get_shard(groups[4], 0) is None
    assert l1.clear(cache_salt="b") == 2
    assert l1.clear(model="m3") == 0
    assert l1.clear() == 1
    assert [k for k, _, _ in l1.iter_groups()] == []
    # A cleared busy group keeps its slot until its hold ends; the late commit of its staging
    # shard does not make it visible. Its key can be stored again at once, into fresh slots.
    l1.commit(key(50, model="m1", salt="a"), 0, owner="w")
    assert not l1.is_complete(key(50, model="m1", salt="a"))
    assert l1.used_bytes == PAGE
    l1.unpin("req")
    assert l1.used_bytes == 0 and l1.num_groups == 0 and l1.num_ready_groups == 0


def test_stats_track_everything() -> None:
    l1, _, _ = make(10)
    store(l1, key(1, world_size=2), PAGE + 1)
    store(l1, key(2))
    l1.reserve(key(3), 0, 10, owner="w", lease_s=30)
    l1.pin("req", [key(2)], ranks=[0], lease_s=30)
    assert l1.stats() == L1Stats(
        capacity_bytes=10 * PAGE,
        used_bytes=6 * PAGE,
        groups=3,
        ready_groups=2,
        staging_shards=1,
        pinned_groups=1,
        evictions=0,
        evicted_bytes=0,
        tenants=[TenantUsage(tenant="", staging_bytes=PAGE, fenced_bytes=0, pinned_bytes=PAGE)],
        admission=AdmissionStats(
            policy="lru", admitted=3, declined=0, ghost_names=0, stores_everything=True
        ),
    )
    assert l1.capacity_bytes == 10 * PAGE and l1.used_bytes == 6 * PAGE
    assert l1.num_groups == 3 and l1.num_ready_groups == 2


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "reserve", "commit", "abort", "pin", "unpin", "touch"]),
            st.integers(0, 11),
            st.integers(1, 3 * PAGE),
        ),
        max_size=60,
    )
)
def test_random_operations_keep_the_index_consistent(ops: list[tuple[str, int, int]]) -> None:
    l1 = L1Store(8 * PAGE, clock=FakeClock())
    staging: dict[ChunkKey, int] = {}  # key -> staging bytes
    for op, i, size in ops:
        k = key(i)
        try:
            if op == "store":
                if l1.reserve(k, 0, size, owner="w", lease_s=30) is not None:
                    l1.commit(k, 0, owner="w")
            elif op == "reserve":
                if l1.reserve(k, 0, size, owner="w", lease_s=30) is not None:
                    staging[k] = -(-size // PAGE) * PAGE
            elif op in ("commit", "abort") and k in staging:
                del staging[k]
                (l1.commit if op == "commit" else l1.abort)(k, 0, owner="w")
            elif op == "pin":
                l1.pin(f"h{size % 3}", [key(j) for j in range(i, i + 3)], ranks=[0], lease_s=9)
            elif op == "unpin":
                l1.unpin(f"h{size % 3}")
            elif op == "touch":
                l1.touch([key(j) for j in range(i)])
        except NoSpaceError:
            pass
        ranges = []
        for gk, ready, pinned in l1.iter_groups():
            shard = l1.get_shard(gk, 0)
            assert (shard is not None) == (ready == 1) == l1.is_complete(gk)
            # A group without shards stays only while pinned (its shard was aborted meanwhile).
            assert gk in staging or ready == 1 or pinned
            assert gk not in staging or ready == 0
            if shard is not None:
                ranges.append((shard[0], -(-shard[1] // PAGE) * PAGE))
        ranges.sort()
        for (start, length), (next_start, _) in itertools.pairwise(ranges):
            assert start + length <= next_start
        ready_bytes = sum(length for _, length in ranges)
        assert ready_bytes + sum(staging.values()) == l1.used_bytes <= l1.capacity_bytes
        assert l1.stats().staging_shards == len(staging)


# ---------------------------------------------------------------- per-tenant accounting


def usage(l1: L1Store, tenant: str) -> tuple[int, int, int]:
    u = l1.tenant_usage(tenant)
    return u.staging_bytes, u.fenced_bytes, u.pinned_bytes


def test_staging_and_quarantine_are_counted_per_tenant() -> None:
    l1, _, _ = make(8)
    l1.reserve(key(1), 0, PAGE, owner="a1", lease_s=30, tenant="a")
    l1.reserve(key(2), 0, PAGE + 1, owner="a2", lease_s=30, tenant="a")
    l1.reserve(key(3), 0, PAGE, owner="b1", lease_s=30, tenant="b")
    assert usage(l1, "a") == (3 * PAGE, 0, 0) and usage(l1, "b") == (PAGE, 0, 0)
    slot = l1.fence(key(2), 0, owner="a2")  # quarantined: staging -> fenced, same tenant
    assert usage(l1, "a") == (PAGE, 2 * PAGE, 0)
    l1.commit(key(1), 0, owner="a1")
    l1.abort(key(3), 0, owner="b1")
    assert usage(l1, "a") == (0, 2 * PAGE, 0) and usage(l1, "b") == (0, 0, 0)
    l1.unfence(*slot, tenant="a")
    assert usage(l1, "a") == (0, 0, 0)
    assert [u.tenant for u in l1.stats().tenants] == []  # nothing held: nobody listed


def test_reclaim_staging_by_owner_touches_only_that_owner() -> None:
    l1, _, _ = make(8)
    for i in range(4):
        l1.reserve(key(i), 0, PAGE, owner=f"w{i % 2}", lease_s=30, tenant="t")
    assert l1.reclaim_staging("w0") == 2
    assert l1.reclaim_staging("w0") == 0
    assert l1.is_busy(key(1), 0) and l1.is_busy(key(3), 0)
    assert usage(l1, "t") == (2 * PAGE, 0, 0)


def test_a_group_counts_once_against_the_tenant_that_pins_it() -> None:
    l1, _, _ = make(8)
    for i in range(3):
        store(l1, key(i))
    assert l1.pin("r1", [key(0), key(1)], ranks=[0], lease_s=30, tenant="a") == 2
    assert l1.pin("r2", [key(0), key(1), key(2)], ranks=[0], lease_s=30, tenant="a") == 3
    assert usage(l1, "a") == (0, 0, 3 * PAGE)
    l1.unpin("r2")
    assert usage(l1, "a") == (0, 0, 2 * PAGE)  # key(2) is no longer pinned by anyone
    l1.unpin("r1")
    assert usage(l1, "a") == (0, 0, 0)


def test_a_pin_stops_at_the_tenants_pinned_bound() -> None:
    l1, _, _ = make(8)
    for i in range(5):
        store(l1, key(i))
    chain = [key(i) for i in range(5)]
    assert l1.pin("r1", chain[:2], ranks=[0], lease_s=30, tenant="a", max_bytes=3 * PAGE) == 2
    # r2 may add one more group: the two r1 pins already are charged
    assert l1.pin("r2", chain, ranks=[0], lease_s=30, tenant="a", max_bytes=3 * PAGE) == 3
    assert l1.pinned_keys("r2") == chain[:3]
    assert usage(l1, "a") == (0, 0, 3 * PAGE)
    # another tenant's bound is its own
    store(l1, key(9, model="other"))
    other = [key(9, model="other")]
    assert l1.pin("b", other, ranks=[0], lease_s=30, tenant="b", max_bytes=PAGE) == 1
    # the groups past the bound stay evictable
    for i in range(20, 24):
        store(l1, key(i))
    assert l1.is_complete(key(2)) and not l1.is_complete(key(3)) and not l1.is_complete(key(4))


def test_reclaim_pins_releases_only_the_expired_and_follows_renewals() -> None:
    l1, clock, _ = make(8)
    store(l1, key(1))
    store(l1, key(2))
    l1.pin("a", [key(1)], ranks=[0], lease_s=10)
    l1.pin("b", [key(2)], ranks=[0], lease_s=10)
    clock.advance(5)
    l1.renew("a", 10)  # now due at +15
    l1.pin("b", [key(2)], ranks=[0], lease_s=2)  # shortened: due at +7
    clock.advance(3)
    assert len(l1.reclaim_pins()) == 1 and l1.pinned_keys("b") == []
    clock.advance(5)  # +13: a's first entry came due, but it was renewed
    assert l1.reclaim_pins() == [] and l1.pinned_keys("a") == [key(1)]
    clock.advance(3)
    assert len(l1.reclaim_pins()) == 1 and l1.pinned_keys("a") == []
    assert l1.reclaim_pins() == []


def test_released_pins_leave_the_expiry_heap_bounded() -> None:
    l1, _, _ = make(8)
    store(l1, key(1))
    for i in range(10_000):
        l1.pin(f"r{i}", [key(1)], ranks=[0], lease_s=30)
        l1.unpin(f"r{i}")
    assert len(l1._pin_heap) <= 1024 + 1


def test_no_space_message_counts_quarantined_bytes() -> None:
    l1, _, _ = make(2)
    l1.reserve(key(1), 0, PAGE, owner="a", lease_s=30, tenant="a")
    l1.fence(key(1), 0, owner="a")
    store(l1, key(2))
    l1.acquire(key(2))
    expected = f"{PAGE} pinned or in use, 0 staging, {PAGE} quarantined"
    with pytest.raises(NoSpaceError, match=expected):
        l1.reserve(key(3), 0, PAGE, owner="w", lease_s=30)


def test_a_pin_lives_while_its_owner_is_seen_and_lapses_a_lease_after() -> None:
    l1, clock, _ = make(4)
    store(l1, key(1))
    store(l1, key(2))
    l1.pin("a", [key(1)], ranks=[0], lease_s=10, owner="alive")
    l1.pin("b", [key(2)], ranks=[0], lease_s=10, owner="dead")
    seen = {"alive": clock.now}  # "dead" was last seen when it pinned, then left the book
    asked: list[tuple[str, str]] = []

    def owner_seen(holder: str, owner: str) -> float | None:
        asked.append((holder, owner))
        return seen.get(owner)

    lapsed: list[str] = []
    for _ in range(5):  # 25 s, two and a half leases; the live owner heartbeats
        clock.advance(5)
        seen["alive"] = clock.now
        lapsed += l1.reclaim_pins(owner_seen)
    assert lapsed == ["b"]  # a lease after its owner's last sign of life
    assert l1.pinned_keys("a") == [key(1)] and l1.pinned_keys("b") == []
    assert ("a", "alive") in asked and ("b", "dead") in asked
    clock.advance(9)  # the live owner stops: still within a lease of its last sign of life
    assert l1.reclaim_pins(owner_seen) == []
    clock.advance(2)
    assert l1.reclaim_pins(owner_seen) == ["a"]
    assert l1.stats().pinned_groups == 0


def test_a_resume_point_replaces_a_shard_that_is_none_and_an_abort_puts_it_back() -> None:
    l1, _, _ = make(8)
    k = key(1)
    first = l1.reserve(k, 0, PAGE, owner="w", lease_s=30, resumable=False)
    assert first is not None
    l1.commit(k, 0, owner="w")
    assert l1.count_prefix([k]) == 1 and l1.resume_prefix([k]) == 0
    assert l1.reserve(k, 0, PAGE, owner="w", lease_s=30, resumable=False) is None  # no better
    # a resume point for it: the old shard steps aside (the group is no hit meanwhile) ...
    second = l1.reserve(k, 0, PAGE, owner="w", lease_s=30)
    assert second is not None and second != first
    assert l1.count_prefix([k]) == 0 and l1.num_ready_groups == 0
    l1.abort(k, 0, owner="w")  # ... and comes back when the new one never commits
    assert l1.get_shard(k, 0) == (first, PAGE, "") and l1.resume_prefix([k]) == 0
    assert l1.num_ready_groups == 1 and l1.used_bytes == PAGE
    third = l1.reserve(k, 0, PAGE, owner="w", lease_s=30)
    assert third is not None
    assert l1.commit(k, 0, owner="w") is True  # the old shard's range is freed
    assert l1.get_shard(k, 0) == (third, PAGE, "") and l1.resume_prefix([k]) == 1
    assert l1.num_ready_groups == 1 and l1.used_bytes == PAGE
    # nothing replaces a shard whose group something holds
    l2, _, _ = make(8)
    l2.reserve(k, 0, PAGE, owner="w", lease_s=30, resumable=False)
    l2.commit(k, 0, owner="w")
    l2.pin("r", [k], ranks=[0], lease_s=10)
    assert l2.reserve(k, 0, PAGE, owner="w", lease_s=30) is None


def test_a_cleared_pinned_group_can_be_stored_again_into_fresh_slots() -> None:
    """After a clear, a new store of a name a live pin holds succeeds: the cleared group keeps
    its slot (and its bytes) for its reader until the pin ends, the new one gets its own."""
    l1, _, _ = make(8)
    k = key(1, world_size=2)
    store(l1, k)
    old = [l1.get_shard(k, rank) for rank in range(2)]
    assert l1.pin("reader", [k], ranks=[0, 1], lease_s=30, tenant="t") == 1
    assert l1.tenant_usage("t").pinned_bytes == 2 * PAGE
    assert l1.clear() == 1
    assert not l1.is_complete(k) and not l1.is_busy(k, 0, "w2") and l1.num_groups == 1
    offsets = [l1.reserve(k, rank, PAGE, owner="w2", lease_s=30) for rank in range(2)]
    assert None not in offsets
    assert not {o[0] for o in old if o is not None} & set(offsets), "fresh slots"
    assert l1.commit(k, 0, owner="w2") is False and l1.commit(k, 1, owner="w2") is True
    assert l1.is_complete(k) and l1.num_ready_groups == 1 and l1.num_groups == 2
    assert l1.used_bytes == 4 * PAGE
    assert l1.pinned_keys("reader") == [k]  # the reader still holds the cleared group
    # A second reader pins the new group; the first one's release frees only the old slots.
    assert l1.pin("reader2", [k], ranks=[0], lease_s=30, tenant="u") == 1
    assert l1.mark_retrieved("reader", 0) is False and l1.mark_retrieved("reader", 1) is True
    assert l1.used_bytes == 2 * PAGE and l1.num_groups == 1
    assert l1.tenant_usage("t").pinned_bytes == 0 and l1.tenant_usage("u").pinned_bytes == 2 * PAGE
    assert l1.get_shard(k, 0) == (offsets[0], PAGE, "")
    assert l1.unpin("reader2")
    assert l1.drop(k) and l1.used_bytes == 0 and l1.num_groups == 0


def test_holds_and_stores_of_a_cleared_group_end_on_that_group() -> None:
    """An anonymous hold, a staging shard and a fence taken before a clear end on the cleared
    group, never on the new group of the same key; the writer of a cleared shard cannot store
    that rank again until its own reservation ends."""
    l1, _, _ = make(8)
    k = key(1, world_size=2)
    store(l1, k)
    held = l1.acquire(k)  # e.g. an L2 write in flight
    late = key(2)
    assert l1.reserve(late, 0, PAGE, owner="slow", lease_s=30) is not None
    fenced = key(3)
    assert l1.reserve(fenced, 0, PAGE, owner="gone", lease_s=30, tenant="g") is not None
    assert l1.clear() == 3 and l1.num_groups == 3 and l1.stats().staging_shards == 2
    # The new groups of the same keys, from other writers.
    store(l1, k, owner="w2")
    new_held = l1.acquire(k)
    assert (
        l1.is_busy(late, 0, "slow") and l1.reserve(late, 0, PAGE, owner="slow", lease_s=30) is None
    )
    assert not l1.is_busy(late, 0, "w2")
    assert l1.reserve(late, 0, PAGE, owner="w2", lease_s=30) is not None
    assert l1.reserve(fenced, 0, PAGE, owner="w3", lease_s=30) is not None
    # The old ones end on the old groups.
    l1.release(held)
    assert l1.commit(late, 0, owner="slow") is False and not l1.is_complete(late)
    offset, nbytes = l1.fence(fenced, 0, owner="gone")
    assert l1.tenant_usage("g").fenced_bytes == PAGE
    with pytest.raises(UnknownReservationError):
        l1.commit(late, 0, owner="slow")
    assert l1.commit(late, 0, owner="w2") is True and l1.is_complete(late)
    assert l1.commit(fenced, 0, owner="w3") is True and l1.is_complete(fenced)
    with pytest.raises(ValueError, match="without a matching acquire"):
        l1.release(held)
    l1.release(new_held)
    l1.unfence(offset, nbytes, tenant="g")
    assert l1.num_groups == 3 and l1.used_bytes == 4 * PAGE and l1.stats().staging_shards == 0
    assert l1.tenant_usage("g").fenced_bytes == 0
    assert l1.clear() == 3 and l1.used_bytes == 0 and l1.num_groups == 0


def test_observers_hear_of_a_group_once_it_is_a_resume_point() -> None:
    """A complete group that is no resume point (a Mamba state missing at its end) is not
    reported as stored (KV events must not announce a prefix a lookup will not serve); the
    resume point that replaces it is."""

    seen: list[ChunkKey] = []

    class Observer:
        def stored(self, keys: list[ChunkKey], tier: str) -> None:
            seen.extend(keys)

        def removed(self, keys: list[ChunkKey], tier: str, reason: object) -> None:
            return None

        def cleared(self, tier: str, model: str | None, cache_salt: str | None) -> None:
            return None

    l1 = L1Store(8 * PAGE, clock=FakeClock(), observer=Observer())  # type: ignore[arg-type]
    k, j = key(1, world_size=2), key(2)
    l1.reserve(k, 0, PAGE, owner="w", lease_s=30)
    l1.reserve(k, 1, PAGE, owner="w", lease_s=30, resumable=False)
    assert l1.commit(k, 0, owner="w") is False and l1.commit(k, 1, owner="w") is True
    store(l1, j)
    assert l1.is_complete(k) and seen == [j]  # complete, but no point to resume from
    l1.reserve(k, 1, PAGE, owner="w", lease_s=30)  # a resume point replaces rank 1's shard
    assert l1.commit(k, 1, owner="w") is True
    assert seen == [j, k] and l1.resume_prefix([k]) == 1

"""ChunkMemory: what each tier holds and lost, by chunk name, within a bound."""

from __future__ import annotations

from kvtier.keys import ChunkKey
from kvtier.server.observe.chunkmemory import ChunkMemory
from kvtier.storage.observers import L1_TIER, Removal


def key(i: int, model: str = "m", salt: str = "", ws: int = 1) -> ChunkKey:
    return ChunkKey(model, salt, ws, bytes([i]) * 32)


def test_a_group_that_left_every_tier_names_the_last_one() -> None:
    memory = ChunkMemory(16)
    memory.stored([key(1)], L1_TIER)
    memory.stored([key(1)], "disk")
    memory.removed([key(1)], L1_TIER, Removal.EVICTED)
    (seen,) = memory.whereabouts([key(1)])
    assert (seen.held_by, seen.left) == ("disk", "")  # still on disk
    memory.removed([key(1)], "disk", Removal.EXPIRED)
    (seen,) = memory.whereabouts([key(1)])
    assert (seen.held_by, seen.left, seen.cleared) == ("", "disk", False)
    memory.stored([key(1)], L1_TIER)
    memory.cleared(L1_TIER, "m", None)
    (seen,) = memory.whereabouts([key(1)])
    assert (seen.left, seen.cleared) == (L1_TIER, True)


def test_the_same_hash_under_another_name_is_seen_while_stored() -> None:
    memory = ChunkMemory(16)
    memory.stored([key(2, model="m2")], L1_TIER)
    assert [w.other_name for w in memory.whereabouts([key(2), key(3)])] == [True, False]
    memory.removed([key(2, model="m2")], L1_TIER, Removal.EVICTED)
    assert not memory.whereabouts([key(2)])[0].other_name


def test_another_salts_name_under_the_same_hash_is_never_told() -> None:
    """A lookup learns nothing of another salt's (or tenant's) chunks from its miss reasons."""
    memory = ChunkMemory(16)
    memory.stored([key(2, salt="a")], L1_TIER)
    assert not memory.whereabouts([key(2)])[0].other_name


def test_a_lapsed_store_is_remembered_until_the_chunk_is_stored() -> None:
    memory = ChunkMemory(16)
    memory.lapsed([key(4)])
    assert memory.whereabouts([key(4)])[0].lapsed
    memory.stored([key(4)], L1_TIER)
    assert not memory.whereabouts([key(4)])[0].lapsed


def test_the_memory_is_bounded_and_forgets_the_least_recently_reported() -> None:
    memory = ChunkMemory(2)
    memory.stored([key(1, salt="x")], L1_TIER)
    memory.stored([key(2)], L1_TIER)
    memory.stored([key(3)], L1_TIER)  # key 1 goes, with its place in the hash index
    assert len(memory) == 2 and memory.forgotten == 1
    (seen,) = memory.whereabouts([key(1)])
    assert (seen.held_by, seen.left, seen.lapsed, seen.other_name) == ("", "", False, False)

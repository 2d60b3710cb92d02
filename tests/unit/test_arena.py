"""Tests for kvtier.storage.arena: real /dev/shm segments shared with real child processes."""

from __future__ import annotations

import itertools
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.storage.allocator import Allocator
from kvtier.storage.arena import PAGE_SIZE, SHM_DIR, Arena, ArenaInUseError, default_arena_name

SRC = str(Path(__file__).resolve().parents[2] / "src")
_counter = itertools.count()


@pytest.fixture
def name() -> Iterator[str]:
    """A segment name unique to this test; whatever is left under it is removed afterwards."""
    segment = f"kvtier-test-{os.getpid()}-{next(_counter)}"
    yield segment
    path = os.path.join(SHM_DIR, segment)
    if os.path.exists(path):
        os.unlink(path)
        pytest.fail(f"test left segment {path} behind")


def _python(code: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_child_process_writes_what_the_parent_reads(name: str) -> None:
    with Arena.create(name, 4 * PAGE_SIZE) as arena:
        arena.view(0, 5)[:] = b"hello"
        child = _python(
            f"""
            from kvtier.storage.arena import Arena
            with Arena.attach({name!r}, {arena.size}) as a:
                print(bytes(a.view(0, 5)).decode(), flush=True)
                a.ndarray({2 * PAGE_SIZE}, 6)[:] = list(b"kvtier")
            """
        )
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0
        assert out.strip() == "hello"
        assert bytes(arena.view(2 * PAGE_SIZE, 6)) == b"kvtier"
        # The attaching child exited: the segment must survive it.
        assert os.path.exists(arena.path)


def test_segment_is_owner_only(name: str) -> None:
    with Arena.create(name, PAGE_SIZE, prefault=False) as arena:
        mode = os.stat(arena.path).st_mode
        assert stat.S_IMODE(mode) == 0o600
        assert arena.path == os.path.join(SHM_DIR, name)


def test_size_is_rounded_up_to_pages(name: str) -> None:
    with Arena.create(name, PAGE_SIZE + 1) as arena:
        assert arena.size == 2 * PAGE_SIZE
        assert os.stat(arena.path).st_size == 2 * PAGE_SIZE
        assert len(arena.buffer) == 2 * PAGE_SIZE


def test_mapping_is_page_aligned_and_arrays_share_memory(name: str) -> None:
    with Arena.create(name, 4 * PAGE_SIZE) as arena:
        array = arena.ndarray(PAGE_SIZE, 16)
        assert array.dtype == np.uint8
        assert array.ctypes.data % PAGE_SIZE == 0
        array[:] = 7
        assert bytes(arena.view(PAGE_SIZE, 16)) == b"\x07" * 16
        assert arena.buffer[PAGE_SIZE] == 7


def test_out_of_bounds_ranges_raise(name: str) -> None:
    with Arena.create(name, PAGE_SIZE, prefault=False) as arena:
        for offset, size in [(-1, 1), (0, PAGE_SIZE + 1), (PAGE_SIZE, 1), (0, -1)]:
            with pytest.raises(ValueError, match="outside arena"):
                arena.view(offset, size)
            with pytest.raises(ValueError, match="outside arena"):
                arena.ndarray(offset, size)
        assert len(arena.view(PAGE_SIZE, 0)) == 0


def test_close_unlinks_and_is_idempotent(name: str) -> None:
    arena = Arena.create(name, PAGE_SIZE, prefault=False)
    client = Arena.attach(name, PAGE_SIZE)
    client.close()
    assert os.path.exists(arena.path), "a client's close must not unlink"
    arena.close()
    arena.close()
    assert arena.closed
    assert not os.path.exists(arena.path)
    with pytest.raises(ValueError, match="closed"):
        arena.view(0, 1)


def test_views_outlive_close_safely(name: str) -> None:
    arena = Arena.create(name, PAGE_SIZE, prefault=False)
    view = arena.view(0, 4)
    array = arena.ndarray(8, 4)
    view[:] = b"abcd"
    arena.close()
    assert not os.path.exists(arena.path)
    assert bytes(view) == b"abcd"
    array[:] = 1
    assert array.sum() == 4


def test_attach_missing_segment_raises_file_not_found(name: str) -> None:
    with pytest.raises(FileNotFoundError, match="kvtier serve"):
        Arena.attach(name, PAGE_SIZE)


def test_attach_larger_than_segment_raises(name: str) -> None:
    with (
        Arena.create(name, PAGE_SIZE, prefault=False),
        pytest.raises(ValueError, match="disagree on the arena size"),
    ):
        Arena.attach(name, 2 * PAGE_SIZE)


def test_live_owner_blocks_a_second_create(name: str) -> None:
    with Arena.create(name, PAGE_SIZE, prefault=False) as arena:
        with pytest.raises(ArenaInUseError, match=name):
            Arena.create(name, PAGE_SIZE, prefault=False)
        assert os.path.exists(arena.path)
        leftovers = [f for f in os.listdir(SHM_DIR) if f.startswith(name + ".")]
        assert leftovers == []


def test_stale_segment_of_a_killed_owner_is_replaced(name: str) -> None:
    owner = _python(
        f"""
        import sys
        from kvtier.storage.arena import Arena
        arena = Arena.create({name!r}, {2 * PAGE_SIZE}, prefault=False)
        arena.view(0, 5)[:] = b"stale"
        print("ready", flush=True)
        sys.stdin.read()
        """
    )
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline().strip() == "ready"
        with pytest.raises(ArenaInUseError):
            Arena.create(name, PAGE_SIZE, prefault=False)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=60)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert os.path.exists(os.path.join(SHM_DIR, name)), "SIGKILL must leave the segment behind"
    with Arena.create(name, PAGE_SIZE, prefault=False) as arena:
        assert arena.size == PAGE_SIZE
        assert bytes(arena.view(0, 5)) == b"\0" * 5


def test_invalid_names_and_sizes_raise() -> None:
    for bad in ["", "a/b", ".hidden"]:
        with pytest.raises(ValueError, match="arena name"):
            Arena.create(bad, PAGE_SIZE)
    with pytest.raises(ValueError, match="positive"):
        Arena.create("kvtier-test-zero", 0)


def test_default_arena_name_is_per_user_and_address() -> None:
    a = default_arena_name("tcp://127.0.0.1:5555")
    assert a == default_arena_name("tcp://127.0.0.1:5555")
    assert a != default_arena_name("tcp://127.0.0.1:5556")
    assert a.startswith(f"kvtier-{os.getuid()}-")
    assert "/" not in a


# ------------------------------------------------------------------------- Allocator


def test_allocations_are_aligned_and_rounded() -> None:
    alloc = Allocator(8 * PAGE_SIZE)
    assert alloc.alloc(1) == 0
    assert alloc.alloc(PAGE_SIZE + 1) == PAGE_SIZE
    assert alloc.alloc(PAGE_SIZE) == 3 * PAGE_SIZE
    assert alloc.used_bytes == 4 * PAGE_SIZE
    assert alloc.free_bytes == 4 * PAGE_SIZE
    assert alloc.rounded(1) == PAGE_SIZE
    assert alloc.rounded(PAGE_SIZE) == PAGE_SIZE
    assert Allocator(10, alignment=4).capacity == 8


def test_free_coalesces_neighbours() -> None:
    alloc = Allocator(3 * PAGE_SIZE)
    a, b, c = (alloc.alloc(PAGE_SIZE) for _ in range(3))
    assert (a, b, c) == (0, PAGE_SIZE, 2 * PAGE_SIZE)
    assert a is not None and b is not None and c is not None  # (mypy: implied above)
    assert alloc.alloc(1) is None
    assert alloc.free(a, PAGE_SIZE) == PAGE_SIZE
    assert alloc.free(c, PAGE_SIZE) == PAGE_SIZE
    assert alloc.free_ranges == [(0, PAGE_SIZE), (2 * PAGE_SIZE, PAGE_SIZE)]
    assert alloc.largest_free == PAGE_SIZE
    assert alloc.free(b, PAGE_SIZE) == 3 * PAGE_SIZE
    assert alloc.free_ranges == [(0, 3 * PAGE_SIZE)]
    assert alloc.largest_free == alloc.free_bytes == 3 * PAGE_SIZE


def test_first_fit_reuses_the_lowest_hole() -> None:
    alloc = Allocator(10 * PAGE_SIZE)
    offsets = [alloc.alloc(2 * PAGE_SIZE) for _ in range(5)]
    assert offsets == [0, 2 * PAGE_SIZE, 4 * PAGE_SIZE, 6 * PAGE_SIZE, 8 * PAGE_SIZE]
    alloc.free(6 * PAGE_SIZE, 2 * PAGE_SIZE)
    alloc.free(2 * PAGE_SIZE, 2 * PAGE_SIZE)
    assert alloc.alloc(PAGE_SIZE) == 2 * PAGE_SIZE
    assert alloc.alloc(2 * PAGE_SIZE) == 6 * PAGE_SIZE
    assert alloc.alloc(PAGE_SIZE) == 3 * PAGE_SIZE
    assert alloc.alloc(1) is None


def test_fragmented_space_does_not_serve_a_large_request() -> None:
    alloc = Allocator(4 * PAGE_SIZE)
    first, _, third, _ = (alloc.alloc(PAGE_SIZE) for _ in range(4))
    assert first is not None and third is not None  # four pages fit (and mypy knows it)
    alloc.free(first, PAGE_SIZE)
    alloc.free(third, PAGE_SIZE)
    assert alloc.free_bytes == 2 * PAGE_SIZE
    assert alloc.alloc(2 * PAGE_SIZE) is None


def test_bad_frees_raise() -> None:
    alloc = Allocator(4 * PAGE_SIZE)
    offset = alloc.alloc(2 * PAGE_SIZE)
    assert offset == 0
    with pytest.raises(ValueError, match="aligned"):
        alloc.free(1, PAGE_SIZE)
    with pytest.raises(ValueError, match="aligned"):
        alloc.free(4 * PAGE_SIZE, PAGE_SIZE)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(2 * PAGE_SIZE, PAGE_SIZE)
    alloc.free(0, 2 * PAGE_SIZE)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(PAGE_SIZE, PAGE_SIZE)
    with pytest.raises(ValueError, match="positive"):
        alloc.alloc(0)
    with pytest.raises(ValueError, match="power of two"):
        Allocator(PAGE_SIZE, alignment=3)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * 64), st.integers(0, 1000))))
def test_random_alloc_free_never_overlaps(ops: list[tuple[bool, int, int]]) -> None:
    alignment = 64
    alloc = Allocator(64 * alignment, alignment=alignment)
    live: dict[int, int] = {}  # offset -> rounded size
    for do_alloc, size, pick in ops:
        if do_alloc or not live:
            offset = alloc.alloc(size)
            rounded = alloc.rounded(size)
            if offset is None:
                assert alloc.largest_free < rounded
                continue
            assert offset % alignment == 0
            assert offset >= 0 and offset + rounded <= alloc.capacity
            for other, other_size in live.items():
                assert offset + rounded <= other or other + other_size <= offset
            live[offset] = rounded
        else:
            offset = sorted(live)[pick % len(live)]
            alloc.free(offset, live.pop(offset))
        assert alloc.used_bytes == sum(live.values())
        assert alloc.free_bytes == alloc.capacity - alloc.used_bytes
        assert sum(size for _, size in alloc.free_ranges) == alloc.free_bytes
        spans = sorted([*live.items(), *alloc.free_ranges])
        position = 0
        for start, size in spans:  # live and free ranges tile [0, capacity) exactly
            assert start == position
            position += size
        assert position == alloc.capacity
        free = alloc.free_ranges
        for (start, size), (next_start, _) in itertools.pairwise(free):
            assert start + size < next_start, "touching free ranges were not coalesced"
    for offset, size in list(live.items()):
        alloc.free(offset, size)
    assert alloc.free_ranges == [(0, alloc.capacity)]

"""Tests for kvtier.session: incremental chunk hashing, thread safety, expiry on a fake clock."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.clock import FakeClock

from kvtier.errors import MisalignedRangeError
from kvtier.hashing import TokenHasher, TokenIds
from kvtier.periodic import PeriodicThreadRegistry
from kvtier.session import Session, SessionManager

CS = 4  # a small chunk size keeps the property tests' sequences short
SRC = Path(__file__).resolve().parents[2] / "src"
WAIT = 5.0  # bound on waits that normally end in milliseconds


class CountingHasher(TokenHasher):
    """A real TokenHasher that counts the chunks it hashes, to prove none is hashed twice."""

    def __init__(self, chunk_size: int = CS) -> None:
        super().__init__(chunk_size)
        self.chunks_hashed = 0
        self._count_lock = threading.Lock()

    def compute_chunk_hashes(
        self,
        token_ids: TokenIds,
        full_chunk_only: bool = True,
        prefix_hash: bytes | None = None,
    ) -> list[bytes]:
        hashes = super().compute_chunk_hashes(token_ids, full_chunk_only, prefix_hash)
        with self._count_lock:
            self.chunks_hashed += len(hashes)
        return hashes

    def extend_chain(self, hashes: list[bytes], packed: memoryview) -> None:
        before = len(hashes)
        super().extend_chain(hashes, packed)
        with self._count_lock:
            self.chunks_hashed += len(hashes) - before


def reference(tokens: list[int], chunk_size: int = CS) -> list[bytes]:
    """Every full chunk's hash, computed from scratch by a fresh hasher."""
    return TokenHasher(chunk_size).compute_chunk_hashes(tokens)


@pytest.fixture(autouse=True)
def registry() -> Iterator[PeriodicThreadRegistry]:
    """The shared registry, emptied (threads stopped) before and after each test."""
    shared = PeriodicThreadRegistry.get_instance()
    shared.reset()
    yield shared
    shared.reset()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def hasher() -> CountingHasher:
    return CountingHasher()


# -- Session -----------------------------------------------------------------------------------


def test_new_session_fields(clock: FakeClock, hasher: CountingHasher) -> None:
    s = Session("r1", hasher, clock=clock)
    assert s.request_id == "r1"
    assert s.token_ids == []
    assert s.chunk_hashes == []
    assert s.last_prefix_hash is None
    assert s.num_chunks_processed == 0
    assert s.created_at == s.last_access == clock.now
    assert s.extras == {}
    assert s.get_hashes(0) == []


def test_set_tokens_replaces_and_accepts_every_token_form(hasher: CountingHasher) -> None:
    s = Session("r", hasher)
    s.set_tokens([9, 9, 9])
    tokens = list(range(10))
    s.set_tokens(tokens)
    assert s.token_ids == tokens  # replaced, not appended
    assert s.num_tokens == 10
    for form in (np.array(tokens, dtype=np.int64), np.array(tokens, "<u4").tobytes()):
        s.set_tokens(form)
        assert s.token_ids == tokens
    buf = bytearray(np.array(tokens, "<u4").tobytes())
    s.set_tokens(buf)
    buf[0] = 77  # the session keeps its own copy of a mutable buffer
    assert s.token_ids == tokens


def test_get_hashes_matches_hasher_and_slices(hasher: CountingHasher) -> None:
    tokens = list(range(100, 123))  # 5 full chunks and 3 tail tokens
    s = Session("r", hasher)
    s.set_tokens(tokens)
    full = reference(tokens)
    assert len(full) == 5
    assert s.get_hashes(0) == full  # end=None: the last full-chunk boundary
    assert s.get_hashes(0, 20) == full
    assert s.get_hashes(8, 16) == full[2:4]
    assert s.get_hashes(12) == full[3:]
    assert s.get_hashes(20) == []
    assert s.last_prefix_hash == full[-1]
    assert s.num_chunks_processed == 5
    assert hasher.chunks_hashed == 5


def test_get_hashes_computes_only_chunks_not_yet_hashed(hasher: CountingHasher) -> None:
    tokens = list(range(40))
    s = Session("r", hasher)
    s.set_tokens(tokens[:8])
    s.get_hashes(0)
    assert hasher.chunks_hashed == 2
    s.set_tokens(tokens)
    assert s.get_hashes(0, 12) == reference(tokens)[:3]
    assert hasher.chunks_hashed == 3  # only chunk 2 was new
    assert s.get_hashes(0) == reference(tokens)
    assert hasher.chunks_hashed == 10
    assert s.get_hashes(0, 8) == reference(tokens)[:2]
    assert hasher.chunks_hashed == 10


def test_set_tokens_is_idempotent(hasher: CountingHasher) -> None:
    tokens = list(range(16))
    s = Session("r", hasher)
    s.set_tokens(tokens)
    first = s.get_hashes(0)
    for form in (tokens, np.array(tokens), np.array(tokens, "<u4").tobytes()):
        s.set_tokens(form)
        assert s.num_chunks_processed == 4
        assert s.get_hashes(0) == first
    assert hasher.chunks_hashed == 4


def test_append_tokens_equals_set_tokens_of_the_whole(hasher: CountingHasher) -> None:
    tokens = list(range(30))
    s = Session("r", hasher)
    s.append_tokens(tokens[:5])
    s.get_hashes(0)
    s.append_tokens(np.array(tokens[5:17]))
    s.get_hashes(0)
    s.append_tokens(tokens[17:])
    assert s.token_ids == tokens
    assert s.get_hashes(0) == reference(tokens)
    assert hasher.chunks_hashed == 7


def test_set_tokens_after_append_detects_divergence(hasher: CountingHasher) -> None:
    s = Session("r", hasher)
    s.append_tokens(list(range(10)))
    s.append_tokens(list(range(10, 16)))
    s.get_hashes(0)
    assert isinstance(s.token_bytes, bytes)
    s.append_tokens([16, 17, 18, 19])
    changed = [*range(6), 600, *range(7, 20)]
    s.set_tokens(changed)
    assert s.num_chunks_processed == 1
    assert s.get_hashes(0) == reference(changed)
    s.set_tokens(list(range(20)))
    s.append_tokens(np.array([20, 21, 22, 23], dtype=np.uint32))
    assert s.token_ids == list(range(24))
    assert s.get_hashes(0) == reference(list(range(24)))


def test_appends_race_readers_without_buffer_errors() -> None:
    s = Session("r", CountingHasher())
    tokens = list(range(3000))
    stop = threading.Event()
    failures: list[str] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                n = len(s.token_bytes) // 4
                assert s.token_ids[:n] == tokens[:n]
                got = s.get_hashes(0)
                assert got == reference(tokens[: len(got) * CS])[: len(got)]
        except Exception as exc:
            failures.append(repr(exc))

    readers = [threading.Thread(target=reader) for _ in range(7)]
    for t in readers:
        t.start()
    try:
        for i in range(0, len(tokens), 3):
            s.append_tokens(tokens[i : i + 3])
    finally:
        stop.set()
        for t in readers:
            t.join(30)
    assert failures == []
    assert s.get_hashes(0) == reference(tokens)


@pytest.mark.parametrize("change_at", [0, 3, 4, 9, 15])
def test_diverging_tokens_drop_hashes_from_the_first_differing_chunk(
    hasher: CountingHasher, change_at: int
) -> None:
    tokens = list(range(16))
    s = Session("r", hasher)
    s.set_tokens(tokens)
    s.get_hashes(0)
    changed = list(tokens)
    changed[change_at] = 999
    s.set_tokens(changed)
    assert s.num_chunks_processed == change_at // CS
    assert s.get_hashes(0) == reference(changed)
    assert hasher.chunks_hashed == 4 + 4 - change_at // CS


def test_truncation_drops_hashes_past_the_new_end(hasher: CountingHasher) -> None:
    tokens = list(range(16))
    s = Session("r", hasher)
    s.set_tokens(tokens)
    s.get_hashes(0)
    s.set_tokens(tokens[:9])
    assert s.num_chunks_processed == 2
    assert s.get_hashes(0) == reference(tokens)[:2]
    s.set_tokens([*tokens[:9], 500, 501, 502])
    assert s.get_hashes(0) == reference([*tokens[:9], 500, 501, 502])


def test_change_past_the_hashed_chunks_keeps_hashes(hasher: CountingHasher) -> None:
    s = Session("r", hasher)
    s.set_tokens(list(range(16)))
    s.get_hashes(0, 8)
    s.set_tokens([*range(8), 70, 71, 72, 73])
    assert s.num_chunks_processed == 2
    assert s.get_hashes(0) == reference([*range(8), 70, 71, 72, 73])
    assert hasher.chunks_hashed == 3


@pytest.mark.parametrize(
    ("start", "end", "numbers"),
    [
        (1, None, ["start=1", "end=8", "4"]),
        (0, 6, ["end=6", "4"]),
        (8, 4, ["start=8", "end=4"]),
        (-4, 8, ["start=-4"]),
        (0, 12, ["end=12", "10 tokens"]),
        (12, None, ["start=12", "end=8"]),
    ],
)
def test_bad_ranges_raise_value_error_naming_the_numbers(
    hasher: CountingHasher, start: int, end: int | None, numbers: list[str]
) -> None:
    s = Session("r", hasher)
    s.set_tokens(list(range(10)))
    with pytest.raises(ValueError) as info:
        s.get_hashes(start, end)
    assert isinstance(info.value, MisalignedRangeError)
    for text in numbers:
        assert text in str(info.value)
    assert s.num_chunks_processed == 0


def test_non_integer_range_is_a_type_error(hasher: CountingHasher) -> None:
    s = Session("r", hasher)
    s.set_tokens(list(range(8)))
    with pytest.raises(TypeError):
        s.get_hashes(4.0)  # type: ignore[arg-type]


def test_range_errors_hold_under_python_O() -> None:
    code = (
        "from kvtier.hashing import TokenHasher\n"
        "from kvtier.session import Session\n"
        "s = Session('r', TokenHasher(4))\n"
        "s.set_tokens(list(range(10)))\n"
        "for args in ((1, 8), (0, 6), (8, 4), (0, 12)):\n"
        "    try:\n"
        "        s.get_hashes(*args)\n"
        "    except ValueError as exc:\n"
        "        print('raised', exc)\n"
        "    else:\n"
        "        print('accepted', args)\n"
        "try:\n"
        "    assert False\n"
        "except AssertionError:\n"
        "    print('asserts enabled')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run(
        [sys.executable, "-O", "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "asserts enabled" not in lines  # really ran optimized
    assert len(lines) == 4
    assert all(line.startswith("raised ") for line in lines), lines
    assert "end=12" in lines[3]


def test_use_moves_last_access_not_created_at(clock: FakeClock, hasher: CountingHasher) -> None:
    s = Session("r", hasher, clock=clock)
    created = clock.now
    for action in (
        lambda: s.set_tokens([1, 2, 3, 4]),
        lambda: s.get_hashes(0),
        lambda: s.append_tokens([5]),
        s.touch,
    ):
        clock.advance(7)
        action()
        assert s.last_access == clock.now
        assert s.created_at == created


def test_what_a_session_shows_and_its_repr(hasher: CountingHasher) -> None:
    """The fields the admin API lists a session by (tests/unit/test_views.py reads them there)."""
    s = Session("r", hasher)
    s.set_tokens(list(range(9)))
    s.get_hashes(0)
    assert (s.request_id, s.num_tokens, s.num_chunks_processed) == ("r", 9, 2)
    assert "tokens=9" in repr(s)


token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=60)


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, cuts=st.lists(st.integers(0, 60), max_size=12))
def test_incremental_growth_over_any_split_equals_hashing_from_scratch(
    tokens: list[int], cuts: list[int]
) -> None:
    hasher = CountingHasher()
    s = Session("r", hasher)
    for cut in [*sorted(c for c in cuts if c <= len(tokens)), len(tokens)]:
        s.set_tokens(tokens[:cut])
        assert s.get_hashes(0) == reference(tokens[:cut])
    assert hasher.chunks_hashed == len(tokens) // CS  # each chunk hashed exactly once


EDIT_CS = 64  # chunk size of the prefix-edit tests: big enough that sampling a chunk would miss


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.integers(1, 6),
    grow=st.integers(0, 2 * EDIT_CS),
    data=st.data(),
    in_place=st.booleans(),
)
def test_a_list_edited_anywhere_in_its_prefix_drops_hashes_on_the_next_call(
    chunks: int, grow: int, data: st.DataObject, in_place: bool
) -> None:
    """A growing list edited at any token of its old prefix, grown or not in the same call:
    the very next set_tokens keeps no hash from the edited chunk on (no sampling, no delay)."""
    n = chunks * EDIT_CS + data.draw(st.integers(0, EDIT_CS - 1))
    tokens = list(range(1000, 1000 + n))
    s = Session("r", CountingHasher(EDIT_CS))
    s.set_tokens(tokens)
    s.get_hashes(0)
    at = data.draw(st.integers(0, n - 1))
    edited = tokens if in_place else list(tokens)  # the caller's own list, or a fresh one
    edited[at] = 7
    edited += range(5000, 5000 + grow)
    s.set_tokens(edited)
    expected = reference(edited, EDIT_CS)
    assert s.num_chunks_processed <= at // EDIT_CS
    assert s.chunk_hashes == expected[: s.num_chunks_processed]
    assert s.get_hashes(0) == expected
    assert s.token_ids == edited


def test_a_growing_list_edited_in_an_early_chunk_is_caught_at_once() -> None:
    """The pattern sampling missed: a list grown step by step, one token of its first chunk
    changed (at an offset a sample of 16 per chunk skips), then grown again."""
    cs = 256
    s = Session("r", CountingHasher(cs))
    tokens: list[int] = []
    for step in range(8):
        tokens = tokens + list(range(step * cs, (step + 1) * cs))
        s.set_tokens(tokens)
        s.get_hashes(0)
    for at in (1, 17, 200, 3 * cs + 5, len(tokens) - 1):
        tokens = list(tokens)
        tokens[at] += 100_000
        tokens += range(len(tokens), len(tokens) + cs)
        s.set_tokens(tokens)
        assert s.num_chunks_processed <= at // cs
        assert s.get_hashes(0) == reference(tokens, cs)


def test_a_bad_token_in_a_grown_tail_leaves_the_session_as_it_was() -> None:
    s = Session("r", CountingHasher())
    s.set_tokens(list(range(8)))
    s.get_hashes(0)
    with pytest.raises(ValueError, match="4294967296"):
        s.set_tokens([*range(8), 2**32])
    s.set_tokens(list(range(12)))
    assert s.get_hashes(0) == reference(list(range(12)))
    assert s.token_ids == list(range(12))


@settings(max_examples=60, deadline=None)
@given(sequences=st.lists(token_lists, min_size=1, max_size=6), data=st.data())
def test_diverging_sequences_never_leave_a_stale_hash(
    sequences: list[list[int]], data: st.DataObject
) -> None:
    s = Session("r", CountingHasher())
    base = sequences[0]
    for seq in sequences:
        # Often share a prefix with the previous sequence, so divergence lands inside chunks.
        keep = data.draw(st.integers(0, len(base)))
        tokens = base[:keep] + seq
        s.set_tokens(tokens)
        end = data.draw(st.integers(0, len(tokens) // CS)) * CS
        assert s.get_hashes(0, end) == reference(tokens)[: end // CS]
        assert s.chunk_hashes == reference(tokens)[: s.num_chunks_processed]
        base = tokens
    assert s.get_hashes(0) == reference(base)


def test_eight_threads_share_a_session_without_rehashing_or_torn_lists() -> None:
    hasher = CountingHasher()
    s = Session("r", hasher)
    tokens = list(range(7, 7 + 4 * 200 + 3))
    expected = reference(tokens)
    steps = [*range(0, len(tokens) + 1, 5), len(tokens)]
    barrier = threading.Barrier(8)
    failures: list[str] = []

    def worker(rank: int) -> None:
        try:
            for cut in steps:
                barrier.wait(WAIT)  # every TP worker sees the same step, as in an engine
                s.set_tokens(tokens[:cut])
                got = s.get_hashes(0)
                if got != expected[: cut // CS]:
                    failures.append(f"rank {rank} at {cut}: {len(got)} hashes, wrong values")
                start = (cut // CS // 2) * CS
                if s.get_hashes(start, cut - cut % CS) != expected[start // CS : cut // CS]:
                    failures.append(f"rank {rank} at {cut}: bad slice from {start}")
        except Exception as exc:
            failures.append(f"rank {rank}: {exc!r}")
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    assert hasher.chunks_hashed == len(expected)  # no chunk hashed twice
    assert s.chunk_hashes == expected


@settings(max_examples=60, deadline=None)
@given(sequences=st.lists(token_lists, min_size=1, max_size=6), data=st.data())
def test_hashes_for_equals_hashing_its_own_tokens_from_scratch(
    sequences: list[list[int]], data: st.DataObject
) -> None:
    """`hashes_for` after any earlier tokens (packed or a list, grown or diverging) gives the
    hashes of exactly the tokens it was given, to `end`."""
    s = Session("r", CountingHasher())
    base = sequences[0]
    for seq in sequences:
        keep = data.draw(st.integers(0, len(base)))
        tokens = base[:keep] + seq
        end = data.draw(st.integers(0, len(tokens) // CS)) * CS
        given_as = data.draw(st.sampled_from(["list", "bytes"]))
        arg: TokenIds = tokens if given_as == "list" else np.asarray(tokens, "<u4").tobytes()
        assert s.hashes_for(arg, end) == reference(tokens)[: end // CS]
        assert s.token_ids == tokens
        base = tokens
    assert s.hashes_for(base) == reference(base)


def test_hashes_for_past_its_own_tokens_is_refused(hasher: CountingHasher) -> None:
    s = Session("r", hasher)
    with pytest.raises(MisalignedRangeError, match="end=8 is past the session's 6 tokens"):
        s.hashes_for(list(range(6)), 8)


def test_threads_with_different_prompts_on_one_session_each_get_their_own_hashes() -> None:
    """Requests of one id with different prompts at the same time: `set_tokens` then
    `get_hashes` may return another thread's hashes; `hashes_for` never does."""
    s = Session("r", TokenHasher(CS))
    prompts = [list(range(r * 10_000, r * 10_000 + 4 * 300 + r)) for r in range(6)]
    expected = [reference(tokens) for tokens in prompts]
    barrier = threading.Barrier(len(prompts))
    failures: list[str] = []

    def worker(rank: int) -> None:
        try:
            barrier.wait(WAIT)
            for step in range(200):
                packed = np.asarray(prompts[rank], "<u4").tobytes()
                if s.hashes_for(packed if step % 2 else prompts[rank]) != expected[rank]:
                    failures.append(f"rank {rank} step {step}: another prompt's hashes")
        except Exception as exc:
            failures.append(f"rank {rank}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert failures == []


# -- SessionManager ----------------------------------------------------------------------------


def manager(clock: FakeClock, ttl: float = 100.0, **kwargs: Any) -> SessionManager:
    kwargs.setdefault("cleanup_interval", None)
    return SessionManager(TokenHasher(CS), ttl, clock=clock, **kwargs)


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), "600", None])
def test_bad_ttl_is_refused(ttl: Any) -> None:
    with pytest.raises(ValueError, match="ttl"):
        SessionManager(TokenHasher(), ttl, cleanup_interval=None)


@pytest.mark.parametrize("interval", [-1, float("nan"), float("inf"), "60"])
def test_bad_cleanup_interval_is_refused(interval: Any) -> None:
    with pytest.raises(ValueError, match="cleanup_interval"):
        SessionManager(TokenHasher(), 600, cleanup_interval=interval)


def test_get_or_create_get_remove(clock: FakeClock) -> None:
    m = manager(clock)
    assert m.get("a") is None
    assert m.active_count() == 0  # get never creates
    a = m.get_or_create("a")
    assert m.get_or_create("a") is a
    assert m.get("a") is a
    assert m.peek("a") is a
    assert "a" in m
    b = m.get_or_create("b")
    assert m.active_count() == len(m) == 2
    assert m.created_count == 2
    assert m.remove("a") is a
    assert m.remove("a") is None
    assert m.get("a") is None
    assert m.active_count() == 1
    assert m.removed_count == 1
    assert m.orphaned_count == 0
    assert list(m) == [b]
    assert m.get_or_create("a") is not a  # a new request with the same id gets a new session


def test_lookup_ipc_key_defaults_to_none_is_settable_and_stays_on_the_removed_session(
    clock: FakeClock,
) -> None:
    m = manager(clock)
    s = m.get_or_create("a")
    assert s.lookup_ipc_key is None
    key = ("model", 1, (7, 8, 9), 0, 512)  # any object: kvtier never reads it
    s.lookup_ipc_key = key
    assert m.get("a") is s and s.lookup_ipc_key is key
    s.set_tokens(list(range(CS)))  # hashing leaves it alone
    assert s.get_hashes(0, CS) and s.lookup_ipc_key is key
    removed = m.remove("a")
    assert removed is s and removed.lookup_ipc_key is key
    assert m.get_or_create("a").lookup_ipc_key is None  # a new session starts without one
    assert Session("b", m.hasher, lookup_ipc_key=key).lookup_ipc_key is key


def test_session_expires_only_after_more_than_ttl_unused(clock: FakeClock) -> None:
    m = manager(clock, ttl=100)
    s = m.get_or_create("r")
    clock.advance(100)
    assert m.cleanup_expired() == 0  # exactly ttl unused is not longer than the ttl
    clock.advance(0.5)
    assert m.cleanup_expired() == 1
    assert m.get("r") is None
    assert m.orphaned_count == 1
    assert m.removed_count == 0
    assert s.request_id == "r"


@pytest.mark.parametrize("use", ["get", "get_or_create", "set_tokens", "get_hashes", "touch"])
def test_expiry_counts_from_the_last_use(clock: FakeClock, use: str) -> None:
    m = manager(clock, ttl=100)
    s = m.get_or_create("r")
    s.set_tokens(list(range(8)))
    uses = {
        "get": lambda: m.get("r"),
        "get_or_create": lambda: m.get_or_create("r"),
        "set_tokens": lambda: s.set_tokens(list(range(12))),
        "get_hashes": lambda: s.get_hashes(0),
        "touch": s.touch,
    }
    clock.advance(60)
    uses[use]()  # last use at t0 + 60
    clock.advance(60)
    assert m.cleanup_expired() == 0  # 120 s after creation, 60 after the last use
    clock.advance(39)
    assert m.cleanup_expired() == 0  # 99 s after the last use: an earlier sweep made it no later
    clock.advance(2)
    assert m.cleanup_expired() == 1  # 101 s after the last use
    assert "r" not in m


def test_long_lived_session_used_repeatedly_survives_many_sweeps(clock: FakeClock) -> None:
    m = manager(clock, ttl=10)
    s = m.get_or_create("r")
    for _ in range(50):
        clock.advance(7)
        s.touch()
        assert m.cleanup_expired() == 0
    clock.advance(10.5)
    assert m.cleanup_expired() == 1


def test_cleanup_expires_every_due_session_across_batches(clock: FakeClock) -> None:
    m = manager(clock, ttl=10)
    n = 3 * SessionManager._BATCH + 17
    sessions = [m.get_or_create(f"r{i}") for i in range(n)]
    clock.advance(5)
    for s in sessions[::3]:
        s.touch()  # used directly, interleaved with idle ones: they must not stop the sweep
    clock.advance(6)
    kept = len(sessions[::3])
    assert m.cleanup_expired() == n - kept
    assert m.active_count() == kept
    assert m.orphaned_count == n - kept
    clock.advance(5)
    assert m.cleanup_expired() == kept
    assert m.active_count() == 0


def test_removed_or_recreated_session_is_not_expired_twice(clock: FakeClock) -> None:
    m = manager(clock, ttl=10)
    old = m.get_or_create("r")
    clock.advance(8)
    old.touch()
    clock.advance(3)
    assert m.cleanup_expired() == 0  # survived its first ttl: now waits on its last use
    assert m.remove("r") is old
    new = m.get_or_create("r")
    clock.advance(9)
    assert m.cleanup_expired() == 0  # old's pending expiry must not take the new session
    assert m.get_or_create("r") is new
    clock.advance(10.5)
    assert m.cleanup_expired() == 1
    assert m.orphaned_count == 1
    assert m.removed_count == 1


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["create", "get", "touch", "remove", "advance", "cleanup"]),
            st.integers(0, 5),
            st.floats(0, 30),
        ),
        max_size=60,
    )
)
def test_expiry_matches_a_model_of_last_use(
    ops: list[tuple[str, int, float]],
) -> None:
    clock = FakeClock()
    ttl = 20.0
    m = SessionManager(TokenHasher(CS), ttl, cleanup_interval=None, clock=clock)
    destroyed: list[str] = []
    m.destroy_listeners.append(lambda s: destroyed.append(s.request_id))
    last_use: dict[str, float] = {}
    for op, key, seconds in ops:
        rid = f"r{key}"
        if op == "create":
            m.get_or_create(rid)
            last_use[rid] = clock.now
        elif op == "get":
            if m.get(rid) is not None:
                last_use[rid] = clock.now
        elif op == "touch":
            session = m.peek(rid)
            if session is not None:
                session.touch()
                last_use[rid] = clock.now
        elif op == "remove":
            assert (m.remove(rid) is not None) == (rid in last_use)
            last_use.pop(rid, None)
        elif op == "advance":
            clock.advance(seconds)
        else:
            due = {r for r, t in last_use.items() if clock.now - t > ttl}
            destroyed.clear()
            assert m.cleanup_expired() == len(due)
            assert set(destroyed) == due
            for r in due:
                del last_use[r]
        assert {s.request_id for s in m.sessions()} == set(last_use)


def test_destroy_listeners_run_on_remove_and_on_expiry(clock: FakeClock) -> None:
    m = manager(clock, ttl=10)
    seen: list[tuple[str, str]] = []
    m.destroy_listeners.append(lambda s: seen.append(("first", s.request_id)))
    m.destroy_listeners.append(lambda s: seen.append(("second", s.request_id)))
    m.get_or_create("a")
    m.get_or_create("b")
    m.remove("a")
    m.remove("missing")
    clock.advance(11)
    m.cleanup_expired()
    assert seen == [("first", "a"), ("second", "a"), ("first", "b"), ("second", "b")]


def test_failing_listener_is_logged_and_the_rest_still_run(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    m = manager(clock, ttl=10)
    seen: list[str] = []

    def broken(session: Session) -> None:
        raise RuntimeError("listener broke")

    m.destroy_listeners += [broken, lambda s: seen.append(s.request_id)]
    m.get_or_create("a")
    m.get_or_create("b")
    with caplog.at_level(logging.ERROR, logger="kvtier.session"):
        assert m.remove("a") is not None
        clock.advance(11)
        assert m.cleanup_expired() == 1
    assert seen == ["a", "b"]
    failures = [r for r in caplog.records if "destroy listener" in r.getMessage()]
    assert len(failures) == 2
    assert all(r.exc_info and "listener broke" in str(r.exc_info[1]) for r in failures)


def test_listener_calling_back_into_the_manager_does_not_deadlock(clock: FakeClock) -> None:
    m = manager(clock, ttl=10)
    calls: list[str] = []

    def reentrant(session: Session) -> None:
        calls.append(session.request_id)
        m.get_or_create(f"follow-{session.request_id}")
        m.remove(f"follow-{session.request_id}")
        m.active_count()
        m.cleanup_expired()

    m.destroy_listeners.append(reentrant)
    m.get_or_create("a")
    m.get_or_create("b")

    def drive() -> None:
        m.remove("a")
        clock.advance(11)
        m.cleanup_expired()

    t = threading.Thread(target=drive, daemon=True)
    t.start()
    t.join(WAIT)
    assert not t.is_alive(), "a listener calling into the manager deadlocked it"
    assert calls[:2] == ["a", "follow-a"]
    assert "b" in calls
    assert m.active_count() == 0


def test_cleanup_thread_registers_runs_and_close_unregisters(
    clock: FakeClock, registry: PeriodicThreadRegistry
) -> None:
    m = SessionManager(TokenHasher(CS), 10, cleanup_interval=0.01, clock=clock)
    threads = [t for t in registry.get_all() if t.name.startswith("session-cleanup")]
    assert len(threads) == 1
    thread = threads[0]
    assert thread.is_running()
    m.get_or_create("r")
    clock.advance(11)
    runs = thread.run_count
    assert thread.wait_for_runs(runs + 2, timeout=WAIT)
    assert m.active_count() == 0
    assert m.orphaned_count == 1
    m.close()
    assert thread.name not in registry
    assert not thread.is_running()
    m.close()  # idempotent
    assert m.get_or_create("x") is m.get("x")  # sessions stay usable after close


def test_context_manager_closes_and_private_registry_is_used(clock: FakeClock) -> None:
    private = PeriodicThreadRegistry()
    with SessionManager(
        TokenHasher(CS), 10, cleanup_interval=30, clock=clock, registry=private
    ) as m:
        assert len(private) == 1
        assert len(PeriodicThreadRegistry.get_instance()) == 0
        thread = private.get_all()[0]
        m.get_or_create("r")
    assert len(private) == 0
    assert not thread.is_running()


@pytest.mark.parametrize("interval", [None, 0])
def test_no_cleanup_thread_when_interval_is_none_or_zero(
    clock: FakeClock, registry: PeriodicThreadRegistry, interval: float | None
) -> None:
    m = SessionManager(TokenHasher(CS), 10, cleanup_interval=interval, clock=clock)
    assert len(registry) == 0
    m.close()


def test_two_managers_get_distinct_threads(registry: PeriodicThreadRegistry) -> None:
    with (
        SessionManager(TokenHasher(CS), cleanup_interval=30) as a,
        SessionManager(TokenHasher(CS), cleanup_interval=30),
    ):
        assert len(registry) == 2
        a.close()
        assert len(registry) == 1
    assert len(registry) == 0


def test_concurrent_get_or_create_yields_one_session_per_id(clock: FakeClock) -> None:
    m = manager(clock)
    barrier = threading.Barrier(8)
    results: list[list[Session]] = [[] for _ in range(8)]

    def worker(rank: int) -> None:
        barrier.wait(WAIT)
        results[rank] = [m.get_or_create(f"r{i}") for i in range(300)]

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert m.created_count == m.active_count() == 300
    for got in results[1:]:
        assert all(a is b for a, b in zip(got, results[0], strict=True))

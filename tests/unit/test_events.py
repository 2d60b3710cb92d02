"""Tests for kvtier.server.observe.events: batches, chains, clears, gaps and replay, real sockets.

Decoded here with kvtier's own wire classes; tests/integration/test_kv_events.py decodes a real
server's stream with vLLM's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq

from kvtier.keys import ChunkKey, compose
from kvtier.server.observe.chunk_notes import ChunkNotes
from kvtier.server.observe.event_wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    published_hash,
    token_array,
)
from kvtier.server.observe.events import EventPublisher, Place
from kvtier.storage.observers import Removal

CS = 4
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def key(i: int, *, model: str = "m", salt: str = "") -> ChunkKey:
    return ChunkKey(compose("", model), compose("", salt), 1, hashlib.sha256(bytes([i])).digest())


def low8(k: ChunkKey) -> int:
    return int.from_bytes(k.chunk_hash[-8:], "big")


class Replayer:
    """A DEALER socket asking a publisher's replay socket for batches."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def replay(self, start: int) -> list[tuple[str, int, KVEventBatch]]:
        self.sock.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[str, int, KVEventBatch]] = []
        while True:
            assert self.sock.poll(10_000), "no replay answer"
            _, topic, seq, payload = self.sock.recv_multipart()
            if seq == END_SEQ:
                assert topic == payload == b""
                return out
            out.append((topic.decode(), int.from_bytes(seq, "big"), DECODER.decode(payload)))

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def endpoints() -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:8]
    paths = [f"/tmp/kvtier-unit-ev-{tag}.pub", f"/tmp/kvtier-unit-ev-{tag}.rep"]
    yield f"ipc://{paths[0]}", f"ipc://{paths[1]}"
    for path in paths:  # the socket files, should a socket not have removed its own
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def publisher(endpoints: tuple[str, str], **kw: object) -> EventPublisher:
    return EventPublisher(
        endpoints[0],
        replay_endpoint=endpoints[1],
        topic="kv/",
        buffer_batches=100,
        chunk_size=CS,
        places={"disk": Place("STORAGE", "LOCAL")},
        notes=ChunkNotes(100),
        **kw,  # type: ignore[arg-type]
    )


def test_a_stored_chain_is_one_event_with_tokens_parent_and_salt(
    endpoints: tuple[str, str],
) -> None:
    pub = publisher(endpoints)
    replay = Replayer(endpoints[1])
    try:
        chain = [key(i, salt="s") for i in range(3)]
        tokens = np.arange(3 * CS, dtype="<u4").tobytes()
        pub.notes.note(chain, None, tokens, CS)
        pub.start()
        for k in chain:  # the L1 reports a commit chunk by chunk
            pub.stored((k,), "l1")
        pub.removed(chain[:1], "disk", Removal.EVICTED)
        assert pub.flush()
        ((topic, seq, batch),) = replay.replay(0)
        assert (topic, seq) == ("kv/m", 0)
        first, stored, removed = batch.events
        assert isinstance(first, AllBlocksCleared)  # a topic's first batch of a run
        assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
        # a salted chunk's published hash is its name mixed with the salt
        assert stored.block_hashes == [
            published_hash(k.chunk_hash, "s", as_int=True) for k in chain
        ]
        assert all(h != low8(k) for h, k in zip(stored.block_hashes, chain, strict=True))
        assert stored.parent_block_hash is None and stored.block_size == CS
        assert stored.token_ids == list(range(3 * CS))
        assert stored.extra_keys == [("s",), None, None]
        assert (stored.medium, stored.locality) == ("CPU", "LOCAL")
        assert removed.block_hashes == stored.block_hashes[:1]
        assert (removed.medium, removed.locality) == ("STORAGE", "LOCAL")
    finally:
        replay.close()
        pub.close()


def test_a_model_with_kv_cache_groups_is_announced_once_per_group_labelled(
    endpoints: tuple[str, str],
) -> None:
    """Once a model's engine registered its groups, every store and removal of its chunks is
    one event per group with vLLM's labels; another model's events stay unlabelled."""
    from kvtier.protocol import KVGroup

    pub = publisher(endpoints)
    replay = Replayer(endpoints[1])
    try:
        groups = (KVGroup(0, "sliding_window", 1024), KVGroup(1, "full_attention"))
        pub.learn_groups(compose("", "m"), groups)
        chain = [key(i) for i in range(2)]
        pub.notes.note(chain, None, np.arange(2 * CS, dtype="<u4").tobytes(), CS)
        pub.stored(chain, "l1")
        pub.removed(chain[:1], "l1", Removal.EVICTED)
        pub.stored([key(9, model="other")], "l1")
        pub.start()
        assert pub.flush()
        events = [e for _, _, batch in replay.replay(0) for e in batch.events]
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        hashes = [low8(k) for k in chain]
        labelled = [
            (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in stored
            if e.block_hashes == hashes
        ]
        assert labelled == [(0, "sliding_window", 1024), (1, "full_attention", None)]
        assert all(e.token_ids == list(range(2 * CS)) for e in stored[:2])
        assert [(e.group_idx, e.block_hashes) for e in removed] == [
            (0, hashes[:1]),
            (1, hashes[:1]),
        ]
        (other,) = [e for e in stored if e.block_hashes == [low8(key(9, model="other"))]]
        assert other.group_idx is None and other.kv_cache_spec_kind is None
    finally:
        replay.close()
        pub.close()


def test_a_chain_noted_by_two_stores_is_one_event_and_another_chain_starts_a_new_one(
    endpoints: tuple[str, str],
) -> None:
    pub = publisher(endpoints)
    replay = Replayer(endpoints[1])
    try:
        chain = [key(i) for i in range(5)]
        tokens = np.arange(5 * CS, dtype="<u4").tobytes()
        pub.notes.note(chain[:3], None, tokens[: 3 * 4 * CS], CS)
        pub.notes.note(chain[3:], chain[2].chunk_hash, tokens[3 * 4 * CS :], CS)
        other = [key(10), key(11)]
        pub.notes.note(other, key(9).chunk_hash, np.arange(2 * CS, dtype="<u4").tobytes(), CS)
        pub.start()
        pub.stored([*chain, *other], "l1")
        assert pub.flush()
        ((_, _, batch),) = replay.replay(0)
        first, second = batch.events[1:]
        assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
        assert first.block_hashes == [low8(k) for k in chain]
        assert first.parent_block_hash is None and first.token_ids == list(range(5 * CS))
        assert second.block_hashes == [low8(k) for k in other]
        assert second.parent_block_hash == low8(key(9))
        assert second.token_ids == list(range(2 * CS))
    finally:
        replay.close()
        pub.close()


def test_notes_keep_the_latest_stores_and_the_last_chunks_of_a_long_one() -> None:
    notes = ChunkNotes(3)
    tokens = np.arange(5 * CS, dtype="<u4").tobytes()
    chain = [key(i) for i in range(5)]
    notes.note(chain, None, tokens, CS)  # longer than all it keeps: the last three
    kept = notes.get_many(chain)
    assert kept[:2] == [None, None]
    store, i = kept[2]  # type: ignore[misc]
    assert (store.parent, i) == (chain[1].chunk_hash, 0)
    assert store.tokens == tokens[2 * 4 * CS :]
    notes.note([key(7)], None, tokens[: 4 * CS], CS)  # the oldest store goes whole
    assert notes.get_many([*chain, key(7)])[2:] == [None, None, None, notes.get_many([key(7)])[0]]
    notes.note(chain[:2], None, tokens[: 8 * CS], CS)  # a chunk named again is kept
    assert all(n is not None for n in notes.get_many([*chain[:2], key(7)]))
    assert not ChunkNotes(0) and ChunkNotes(1)


def test_a_run_of_removals_from_one_tier_is_one_event_in_order(
    endpoints: tuple[str, str],
) -> None:
    pub = publisher(endpoints)
    replay = Replayer(endpoints[1])
    try:
        for i in range(3):  # the L1 reports an eviction chunk by chunk
            pub.removed((key(i),), "l1", Removal.EVICTED)
        pub.removed((key(3),), "disk", Removal.EVICTED)  # another tier: another event
        pub.stored([key(4)], "l1")
        pub.removed((key(4),), "l1", Removal.EVICTED)  # after a store: a new event
        pub.start()
        assert pub.flush()
        ((_, _, batch),) = replay.replay(0)
        got = []
        for e in batch.events[1:]:
            assert isinstance(e, BlockStored | BlockRemoved), e  # (no AllBlocksCleared here)
            got.append((type(e).__name__, e.medium, e.block_hashes))
        assert got == [
            ("BlockRemoved", "CPU", [low8(key(i)) for i in range(3)]),
            ("BlockRemoved", "STORAGE", [low8(key(3))]),
            ("BlockStored", "CPU", [low8(key(4))]),
            ("BlockRemoved", "CPU", [low8(key(4))]),
        ]
    finally:
        replay.close()
        pub.close()


def test_chunks_without_notes_are_published_alone_with_full_hashes_when_asked(
    endpoints: tuple[str, str],
) -> None:
    pub = publisher(endpoints, int_hashes=False)
    replay = Replayer(endpoints[1])
    try:
        pub.start()
        pub.stored([key(1), key(2)], "disk")
        assert pub.flush()
        ((_, _, batch),) = replay.replay(0)
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert [e.block_hashes for e in stored] == [[key(1).chunk_hash], [key(2).chunk_hash]]
        assert all(e.token_ids == [] and e.parent_block_hash is None for e in stored)
    finally:
        replay.close()
        pub.close()


def test_a_clear_of_a_model_empties_its_topic_and_a_clear_by_salt_lists_nothing(
    endpoints: tuple[str, str],
) -> None:
    pub = publisher(endpoints)
    replay = Replayer(endpoints[1])
    try:
        pub.start()
        pub.stored([key(1, model="a")], "redis")
        pub.stored([key(2, model="b")], "redis")
        assert pub.flush()
        pub.cleared("redis", compose("", "a"), compose("", "s"))  # by salt: cannot list
        pub.cleared("redis", None, None)  # everything: every model seen
        assert pub.flush()
        later = replay.replay(2)
        assert sorted(topic for topic, _, _ in later) == ["kv/a", "kv/b"]
        assert all(b.events == [AllBlocksCleared()] for _, _, b in later)
    finally:
        replay.close()
        pub.close()


def test_dropped_reports_leave_a_gap_in_the_sequence(endpoints: tuple[str, str]) -> None:
    pub = publisher(endpoints, max_reports=2)
    replay = Replayer(endpoints[1])
    try:
        for i in range(3):  # the thread is not running: the third does not fit
            pub.stored([key(i)], "l1")
        assert pub.stats().dropped_reports == 1
        pub.start()
        assert pub.flush()
        got = replay.replay(0)
        assert [seq for _, seq, _ in got] == [1]  # 0 was skipped: the consumer sees the gap
        assert pub.stats().next_seq == 2
    finally:
        replay.close()
        pub.close()


def test_a_malformed_replay_request_is_ignored_and_the_socket_keeps_answering(
    endpoints: tuple[str, str],
) -> None:
    pub = publisher(endpoints)
    replay = Replayer(endpoints[1])
    try:
        pub.start()
        pub.stored([key(1)], "l1")
        assert pub.flush()
        replay.sock.send_multipart((b"", b"not 8 bytes"))
        assert [seq for _, seq, _ in replay.replay(0)] == [0]
    finally:
        replay.close()
        pub.close()


@pytest.mark.parametrize("n", [0, 1, 3 * CS, 70_000])  # 70,000: msgpack's array32 header
def test_token_arrays_decode_to_the_ids_of_their_joined_pieces(n: int) -> None:
    ids = np.arange(n, dtype="<u4") * 65_537
    pieces = [ids[: n // 3].tobytes(), ids[n // 3 :].tobytes()]
    encoded = msgspec.msgpack.encode(token_array(pieces))
    assert msgspec.msgpack.decode(encoded) == ids.tolist()

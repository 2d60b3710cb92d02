"""KV events for routers: what every tier holds, published over ZMQ in vLLM's format.

`EventPublisher` follows storage (it is a `StorageObserver`) and publishes, per chunk group:
`BlockStored` when it becomes complete in a tier, `BlockRemoved` when it leaves one, and
`AllBlocksCleared` when a clear empties a model. `medium` and `locality` say where: the
shared-memory L1 is `CPU`/`LOCAL`, the disk tier `STORAGE`/`LOCAL`, a shared store (Redis,
Valkey, Mooncake) `STORAGE`/`REMOTE`. A chunk is one vLLM block: `block_hashes` are kvtier's
chunk names and `block_size` the chunk size, so with `--hash-algorithm sha256_cbor` they equal
vLLM's block hashes for a block size of the chunk size (requests without a cache salt or extra
key), sent as vLLM sends them (by default the last 8 bytes as an integer, see
`--kv-events-int-hashes`). `parent_block_hash`, `token_ids` and `extra_keys` (the cache salt
on a prompt's first chunk, as vLLM puts it) come from the store that named the chunk
(`ChunkNotes`); a chunk stored by name, or one whose note is gone (an L2 write long after
its store, a chunk that survived a restart), is published alone, without tokens or parent. A
batch's topic is `--kv-events-topic` followed by its chunks' model.

Delivery is vLLM's: one sequence number per batch, monotonic from 0 at each start (a consumer
that sees it go back knows the server restarted; each topic's first batch of a run begins with
`AllBlocksCleared`, and the disk tier's survivors are the first chunks stored), at least once, a
bounded replay buffer behind a ROUTER socket answering vLLM's replay request. Storage only
appends a report to a queue (under the engine lock for the L1's): one thread of this module
turns reports into batches, encodes and sends them, never blocking (PUB drops at its
high-water mark; a full replay socket drops the reply). When reports come faster than that
thread publishes, the excess is dropped and the sequence skips a number, so a consumer sees
the gap; its replay then cannot fill it, and the consumer knows its view is incomplete.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
import zmq

from kvtier.config import ConfigError, ServerConfig
from kvtier.keys import ChunkKey, decompose, shown
from kvtier.storage.observers import L1_TIER, Removal
from kvtier.storage.tiers.base import L2Tier

from .event_wire import (
    END_SEQ,
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    external_hash,
    seq_bytes,
    token_array,
    token_items,
)

__all__ = ["ChunkNotes", "EventPublisher", "EventStats", "Place", "open_events", "place_of"]

logger = logging.getLogger(__name__)

_POLL_MS = 5  # a publishing round at most this often (a batch's added latency)
_BATCH_REPORTS = 4096  # reports turned into one set of batches
_MAX_REPORTS = 1 << 20  # reports waiting for the thread; past it they are dropped (a seq gap)
_SHUTDOWN_S = 2.0

Event = BlockStored | BlockRemoved | AllBlocksCleared


class Place(NamedTuple):
    """Where a tier's chunks live, in vLLM's words."""

    medium: str
    locality: str


L1_PLACE = Place(MEDIUM_CPU, LOCAL)


def place_of(tier: L2Tier) -> Place:
    """An L2 tier's place: the disk tier is on this machine; every shared store is remote."""
    return Place(MEDIUM_STORAGE, LOCAL if getattr(tier, "kind", "") == "disk" else REMOTE)


class Note(NamedTuple):
    parent: bytes | None
    tokens: bytes  # the chunk's token ids as msgpack array items (`event_wire.token_items`)


class ChunkNotes:
    """The parent and tokens of the most recently stored chunks (at most `capacity`; 0 keeps
    none, for a server without KV events), taken from the stores that named them.
    Thread-safe; each call holds its lock briefly."""

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._notes: OrderedDict[ChunkKey, Note] = OrderedDict()
        self._lock = threading.Lock()

    def note(
        self, keys: Sequence[ChunkKey], parent: bytes | None, tokens: bytes, chunk_size: int
    ) -> None:
        """`keys` name consecutive chunks of `tokens` (packed uint32, starting at the first
        key's chunk), after the chunk named `parent` (None: they start the prompt)."""
        # Encoded here, once per store and vectorized, so that publishing a chain only joins
        # bytes: the publisher thread shares the GIL with the request threads.
        keys = keys[: len(tokens) // (4 * chunk_size)]  # only chunks whose every token came
        items = token_items(tokens[: 4 * chunk_size * len(keys)])
        step = 5 * chunk_size
        notes = [
            Note(parent if i == 0 else keys[i - 1].chunk_hash, items[i * step : (i + 1) * step])
            for i in range(len(keys))
        ]
        with self._lock:
            for key, note in zip(keys, notes, strict=True):
                self._notes[key] = note
                self._notes.move_to_end(key)
            while len(self._notes) > self._capacity:
                self._notes.popitem(last=False)

    def __bool__(self) -> bool:
        """Whether notes are kept at all (a server without KV events keeps none)."""
        return self._capacity > 0

    def get_many(self, keys: Sequence[ChunkKey]) -> list[Note | None]:
        get = self._notes.get
        with self._lock:
            return [get(key) for key in keys]


class EventStats(msgspec.Struct, frozen=True, kw_only=True):
    """The publisher's counters (for /status)."""

    endpoint: str
    replay_endpoint: str
    next_seq: int
    batches: int
    events: int
    blocks: int  # block hashes in those events (a chain of stored chunks is one event)
    dropped_reports: int
    replays: int
    buffered: int


class EventPublisher:
    """Publishes what storage reports as vLLM KV event batches (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None,
        topic: str,
        buffer_batches: int,
        chunk_size: int,
        places: Mapping[str, Place],
        notes: ChunkNotes,
        int_hashes: bool = True,
        hwm: int = 100_000,
        max_reports: int = _MAX_REPORTS,
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic
        self._chunk_size = chunk_size
        self._int_hashes = int_hashes
        self._places = {L1_TIER: L1_PLACE, **places}
        self.notes = notes
        self._reports: deque[tuple[Any, ...]] = deque()
        self._max_reports = max_reports
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_batches)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._open(self._pub, endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # room for a whole replay and its end marker (as vLLM 0.33 sizes it)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_batches + 1))
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._gap = False  # reports were dropped since the last batch
        self._seen_models: set[str] = set()  # whose topics an unfiltered clear empties
        self._announced: set[str] = set()  # topics published since start
        self._reported = itertools.count(1)  # next() is atomic: reports come from many threads
        self._num_reported = 0
        self._num_published = 0  # reports turned into sent batches (the thread's own count)
        self._n = dict.fromkeys(("batches", "events", "blocks", "dropped_reports", "replays"), 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)

    @staticmethod
    def _open(sock: zmq.Socket[bytes], endpoint: str) -> None:
        """Bind a wildcard, ipc or inproc address; connect to any other (as vLLM does)."""
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)

    def start(self) -> None:
        """Start the publishing thread (before the tiers report what survived)."""
        self._thread.start()

    # -- what storage reports (any thread, maybe under the engine lock: append only) ---------

    def _report(self, report: tuple[Any, ...]) -> None:
        if len(self._reports) >= self._max_reports:
            self._n["dropped_reports"] += 1
            self._gap = True
            return
        self._reports.append(report)
        self._num_reported = next(self._reported)

    def stored(self, keys: Sequence[ChunkKey], tier: str) -> None:
        self._report(("stored", tuple(keys), tier))

    def removed(self, keys: Sequence[ChunkKey], tier: str, reason: Removal) -> None:
        self._report(("removed", tuple(keys), tier))

    def cleared(self, tier: str, model: str | None, cache_salt: str | None) -> None:
        self._report(("cleared", model, cache_salt, tier))

    # -- the publishing thread ------------------------------------------------------------------

    def _run(self) -> None:
        # One round every _POLL_MS (sooner only for a replay request): what was reported
        # meanwhile goes out together. Draining each report as it came would make this thread
        # take the GIL from the request threads once per chunk, which halved store throughput.
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            stopping = self._stop.is_set()
            try:
                if self._replay is not None:
                    if dict(poller.poll(_POLL_MS)):
                        self._serve_replay()
                else:
                    self._stop.wait(_POLL_MS / 1000)
                while self._reports:
                    self._publish_reports()
            except Exception:
                logger.exception("kv events: publishing failed")
                time.sleep(0.1)
            if stopping:
                return

    def _publish_reports(self) -> None:
        reports = []
        for _ in range(min(_BATCH_REPORTS, len(self._reports))):
            reports.append(self._reports.popleft())
        merged: list[tuple[Any, ...]] = []
        for report in reports:  # one commit reports chunk by chunk: its chain is one event
            last = merged[-1] if merged else None
            if last is not None and report[0] == last[0] == "stored" and report[2] == last[2]:
                last[1].extend(report[1])
            else:
                merged.append(
                    (report[0], list(report[1]), *report[2:]) if report[0] != "cleared" else report
                )
        by_topic: dict[str, list[Event]] = {}
        for report in merged:
            for model, event in self._events(report):
                by_topic.setdefault(self._topic + shown(model), []).append(event)
        now = time.time()
        for topic, events in by_topic.items():
            if topic not in self._announced:  # what a router knew of an earlier run is void
                self._announced.add(topic)
                events.insert(0, AllBlocksCleared())
            self._send(topic.encode(), self._encoder.encode(KVEventBatch(now, events)), events)
        self._num_published += len(reports)

    def _send(self, topic: bytes, payload: bytes, events: list[Event]) -> None:
        if self._gap:  # reports were dropped: skip a number so consumers see it
            self._gap = False
            self._seq += 1
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, topic, payload))
        with contextlib.suppress(zmq.Again):  # PUB drops at its high-water mark, never blocks
            self._pub.send_multipart((topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        self._n["batches"] += 1
        self._n["events"] += len(events)
        self._n["blocks"] += sum(len(getattr(e, "block_hashes", ())) for e in events)

    def _events(self, report: tuple[Any, ...]) -> Iterable[tuple[str, Event]]:
        """(model, event) pairs for one report."""
        kind = report[0]
        if kind == "cleared":
            _, model, cache_salt, _tier = report
            if cache_salt is None:
                for m in [model] if model is not None else self._models():
                    yield m, AllBlocksCleared()
            return
        _, keys, tier = report
        place = self._places.get(tier, Place(MEDIUM_STORAGE, REMOTE))
        model = keys[0].model
        if all(key.model == model for key in keys):  # the usual case: one request's chunks
            by_model = {model: keys}
        else:
            by_model = {}
            for key in keys:
                by_model.setdefault(key.model, []).append(key)
        self._seen_models.update(by_model)
        for model, model_keys in by_model.items():
            if kind == "removed":
                yield (
                    model,
                    BlockRemoved(
                        self._hashes(model_keys),
                        place.medium,
                        locality=place.locality,
                    ),
                )
            else:
                for event in self._stored_events(model_keys, place):
                    yield model, event

    def _models(self) -> list[str]:
        return sorted(self._seen_models)

    def _stored_events(self, keys: list[ChunkKey], place: Place) -> Iterable[BlockStored]:
        """BlockStored events for `keys`: consecutive chunks of one chain in one event (as vLLM
        publishes a request's newly full blocks), each chunk without a note alone."""
        run: list[ChunkKey] = []
        notes: list[Note] = []
        for key, note in zip(keys, self.notes.get_many(keys), strict=True):
            if note is None:
                if run:
                    yield self._block_stored(run, notes, place)
                    run, notes = [], []
                yield self._block_stored([key], [], place)
                continue
            if run and note.parent != run[-1].chunk_hash:
                yield self._block_stored(run, notes, place)
                run, notes = [], []
            run.append(key)
            notes.append(note)
        if run:
            yield self._block_stored(run, notes, place)

    def _block_stored(self, keys: list[ChunkKey], notes: list[Note], place: Place) -> BlockStored:
        salt = _client_salt(keys[0].cache_salt)
        if notes:
            tokens: list[int] | msgspec.Raw = token_array(
                len(notes) * self._chunk_size, [n.tokens for n in notes]
            )
            parent = notes[0].parent
            extra: list[tuple[Any, ...] | None] = [
                (salt,) if salt and i == 0 and parent is None else None for i in range(len(keys))
            ]
        else:
            tokens, parent, extra = [], None, [None]
        return BlockStored(
            block_hashes=self._hashes(keys),
            parent_block_hash=None if parent is None else self._hash(parent),
            token_ids=tokens,
            block_size=self._chunk_size,
            lora_id=None,
            medium=place.medium,
            lora_name=None,
            extra_keys=extra,
            locality=place.locality,
        )

    def _hash(self, chunk_hash: bytes) -> bytes | int:
        return external_hash(chunk_hash, as_int=self._int_hashes)

    def _hashes(self, keys: Sequence[ChunkKey]) -> list[bytes | int]:
        if not self._int_hashes:
            return [k.chunk_hash for k in keys]
        from_bytes = int.from_bytes
        return [from_bytes(k.chunk_hash[-8:], "big") for k in keys]

    def _serve_replay(self) -> None:
        """Answer one replay request: the buffered batches from its sequence number on, then
        vLLM's end marker. A malformed request is ignored (as vLLM does)."""
        assert self._replay is not None
        frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: ignoring a malformed replay request")
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self._n["replays"] += 1
        try:
            for seq, topic, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart(
                        (client, b"", topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK
                    )
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.Again:  # a subscriber that does not read its replay loses it, not us time
            logger.warning("kv events: a replay subscriber is not reading; reply cut short")

    # -- admin and lifecycle --------------------------------------------------------------------

    def stats(self) -> EventStats:
        return EventStats(
            endpoint=self._endpoint,
            replay_endpoint=self._replay_endpoint or "",
            next_seq=self._seq,
            buffered=len(self._buffer),
            **self._n,
        )

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every report so far was published; False on timeout (tests, benchmarks)."""
        target = self._num_reported
        deadline = time.monotonic() + timeout
        while self._num_published < target and time.monotonic() < deadline:
            time.sleep(0.001)
        return self._num_published >= target

    def close(self) -> None:
        """Publish what was reported, stop the thread and close the sockets; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(_SHUTDOWN_S)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def open_events(config: ServerConfig, tiers: Sequence[L2Tier]) -> EventPublisher:
    """The publisher `--kv-events-endpoint` asks for, over the server's L2 `tiers`, not started;
    ConfigError when an endpoint cannot be bound or connected."""
    assert config.kv_events_endpoint is not None
    try:
        return EventPublisher(
            config.kv_events_endpoint,
            replay_endpoint=config.kv_events_replay_endpoint,
            topic=config.kv_events_topic,
            buffer_batches=config.kv_events_buffer,
            chunk_size=config.chunk_size,
            places={tier.name: place_of(tier) for tier in tiers},
            notes=ChunkNotes(config.kv_events_token_chunks),
            int_hashes=config.kv_events_int_hashes,
        )
    except zmq.ZMQError as exc:
        raise ConfigError(
            f"--kv-events-endpoint / --kv-events-replay-endpoint: {exc}: give addresses this "
            "user can bind (a free tcp:// port, e.g. 'tcp://*:5557') or connect to"
        ) from None


def _client_salt(cache_salt: str) -> str:
    """The salt the client sent (the part after its tenant), as vLLM publishes a request's."""
    try:
        parts = decompose(cache_salt)
    except ValueError:
        return cache_salt
    return parts[-1] if len(parts) == 2 else cache_salt

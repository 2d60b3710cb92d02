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
hand-off's chunks (a prefill instance's KV for one decode instance) are no prefix-cache entries
and are never published: their stores hide them (`ChunkNotes.hide`). A batch's topic is
`--kv-events-topic` followed by its chunks' model.

Delivery is vLLM's: one sequence number per batch, monotonic from 0 at each start (a consumer
that sees it go back knows the server restarted; each topic's first batch of a run begins with
`AllBlocksCleared`, and the disk tier's survivors are the first chunks stored), at least once, a
bounded replay buffer behind a ROUTER socket answering vLLM's replay request. Storage only
adds a report to a list (under the engine lock for the L1's), where a run of one kind and tier
joins the previous report, and a store's note keeps its tokens as they came: one thread of
this module takes the list every few milliseconds, turns it into batches, encodes the tokens,
and sends, never blocking (PUB drops at its high-water mark; a full replay socket drops the
reply). When reports come faster than that thread publishes, the excess is dropped and the
sequence skips a number, so a consumer sees the gap; its replay then cannot fill it, and the
consumer knows its view is incomplete.
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
)

__all__ = ["ChunkNotes", "EventPublisher", "EventStats", "Place", "open_events", "place_of"]

logger = logging.getLogger(__name__)

_POLL_MS = 20  # a publishing round at most this often (a batch's added latency)
_MAX_REPORTS = 1 << 20  # chunks reported, waiting for the thread; past it, dropped (a seq gap)
_MAX_HIDDEN = 1 << 16  # hand-off chunks kept unpublished (oldest forgotten first)
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


class _Store(NamedTuple):
    """What one store told of the consecutive chunks it named."""

    keys: tuple[ChunkKey, ...]
    parent: bytes | None  # the chunk before keys[0] (None: they start the prompt)
    tokens: bytes  # their token ids, packed uint32, chunk after chunk


_NO_STORE = _Store((), None, b"")

#: where a chunk's note is: the store that named it last, and the chunk's place in it
Note = tuple[_Store, int]


class ChunkNotes:
    """The parent and tokens of the most recently stored chunks (about `capacity`, whole stores
    forgotten oldest first; 0 keeps none, for a server without KV events), taken from the
    stores that named them. A store is kept as it came, once: a note costs the request that
    makes it one dict entry per chunk, and the publisher encodes the tokens.
    Thread-safe; each call holds its lock briefly."""

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._where: dict[ChunkKey, Note] = {}
        self._stores: deque[_Store] = deque()
        self._chunks = 0  # chunks of the stores kept
        self._lock = threading.Lock()
        # hand-off chunks: never published (a late report of one forgotten would be)
        self._hidden: OrderedDict[ChunkKey, None] = OrderedDict()

    def note(
        self, keys: Sequence[ChunkKey], parent: bytes | None, tokens: bytes, chunk_size: int
    ) -> None:
        """`keys` name consecutive chunks of `tokens` (packed uint32, starting at the first
        key's chunk), after the chunk named `parent` (None: they start the prompt)."""
        step = 4 * chunk_size
        n = min(len(keys), len(tokens) // step)  # only chunks whose every token came
        first = max(0, n - self._capacity)  # more than all we keep: the last ones
        if first == n:
            return
        if first:
            parent = keys[first - 1].chunk_hash
        store = _Store(tuple(keys[first:n]), parent, tokens[first * step : n * step])
        places = zip(itertools.repeat(store), range(n - first), strict=False)
        with self._lock:
            self._where.update(zip(store.keys, places, strict=False))
            self._stores.append(store)
            self._chunks += len(store.keys)
            while self._chunks > self._capacity:
                old = self._stores.popleft()
                self._chunks -= len(old.keys)
                for key in old.keys:
                    if self._where.get(key, (None,))[0] is old:  # not named again since
                        del self._where[key]

    def __bool__(self) -> bool:
        """Whether notes are kept at all (a server without KV events keeps none)."""
        return self._capacity > 0

    def hide(self, keys: Sequence[ChunkKey]) -> None:
        """`keys` are a hand-off's chunks, no prefix-cache entries: never publish them (the
        last `_MAX_HIDDEN` hidden are remembered)."""
        if not self:
            return
        with self._lock:
            for key in keys:
                self._hidden[key] = None
                self._hidden.move_to_end(key)
            while len(self._hidden) > _MAX_HIDDEN:
                self._hidden.popitem(last=False)

    def shown(self, keys: Sequence[ChunkKey]) -> Sequence[ChunkKey]:
        """`keys` less the hidden ones."""
        if not self._hidden:
            return keys
        with self._lock:
            return [key for key in keys if key not in self._hidden]

    def get_many(self, keys: Sequence[ChunkKey]) -> list[Note | None]:
        get = self._where.get
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
        # reports waiting for the thread, a run of one kind and tier merged into one as it
        # comes (a commit or an eviction reports chunk by chunk); `_lock` guards them
        self._reports: list[tuple[Any, ...]] = []
        self._pending = 0  # chunks (and clears) in them
        self._lock = threading.Lock()
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
        self._gap = False  # reports were dropped since the last take (under `_lock`)
        self._seen_models: set[str] = set()  # whose topics an unfiltered clear empties
        self._announced: set[bytes] = set()  # topics published since start
        self._topics: dict[str, bytes] = {}  # a model's topic
        self._num_reported = 0  # reports taken in (under `_lock`)
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

    # -- what storage reports (any thread, maybe under the engine lock: a short lock only) -----

    def _admit(self, chunks: int) -> bool:
        """Count a report of `chunks` in, or drop it (and mark the gap) when the thread is that
        far behind; under `_lock`."""
        if self._pending + chunks > self._max_reports:
            self._n["dropped_reports"] += 1
            self._gap = True
            return False
        self._pending += chunks
        self._num_reported += 1
        return True

    def _report(self, kind: str, keys: Sequence[ChunkKey], tier: str) -> None:
        with self._lock:
            if not self._admit(len(keys)):
                return
            last = self._reports[-1] if self._reports else None
            if last is not None and last[0] == kind and last[2] == tier:
                last[1].extend(keys)
            else:
                self._reports.append((kind, list(keys), tier))

    def stored(self, keys: Sequence[ChunkKey], tier: str) -> None:
        keys = self.notes.shown(keys)
        if keys:
            self._report("stored", keys, tier)

    def removed(self, keys: Sequence[ChunkKey], tier: str, reason: Removal) -> None:
        if reason is Removal.DECLINED:  # never announced, so never taken back
            return
        keys = self.notes.shown(keys)
        if keys:
            self._report("removed", keys, tier)

    def cleared(self, tier: str, model: str | None, cache_salt: str | None) -> None:
        with self._lock:
            if self._admit(1):
                self._reports.append(("cleared", model, cache_salt, tier))

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
                if self._reports:
                    self._publish_reports()
            except Exception:
                logger.exception("kv events: publishing failed")
                time.sleep(0.1)
            if stopping:
                return

    def _publish_reports(self) -> None:
        with self._lock:
            reports, self._reports = self._reports, []
            self._pending = 0
            taken = self._num_reported
            gap, self._gap = self._gap, False
        if gap:  # reports were dropped: skip a number so consumers see it
            self._seq += 1
        by_topic: dict[bytes, list[Event]] = {}
        for report in reports:
            for model, event in self._events(report):
                topic = self._topics.get(model)
                if topic is None:
                    topic = self._topics[model] = (self._topic + shown(model)).encode()
                by_topic.setdefault(topic, []).append(event)
        now = time.time()
        for topic, events in by_topic.items():
            if topic not in self._announced:  # what a router knew of an earlier run is void
                self._announced.add(topic)
                events.insert(0, AllBlocksCleared())
            self._send(topic, self._encoder.encode(KVEventBatch(now, events)), events)
        self._num_published = taken

    def _send(self, topic: bytes, payload: bytes, events: list[Event]) -> None:
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
        step = 4 * self._chunk_size
        run: list[ChunkKey] = []
        parent: bytes | None = None
        pieces: list[bytes] = []  # the run's tokens: a slice of each store it spans
        store, first, last = _NO_STORE, 0, -1  # the run's chunks in `store`: first to last
        for key, note in zip(keys, self.notes.get_many(keys), strict=True):
            if note is not None and note[0] is store and note[1] == last + 1:
                run.append(key)  # the usual case: the next chunk of the same store
                last += 1
                continue
            if run:
                pieces.append(store.tokens[first * step : (last + 1) * step])
            if note is None:
                if run:
                    yield self._block_stored(run, parent, pieces, place)
                yield self._block_stored([key], None, [], place)
                run, pieces, store = [], [], _NO_STORE
                continue
            at, i = note
            previous = at.parent if i == 0 else at.keys[i - 1].chunk_hash
            if run and previous != run[-1].chunk_hash:  # not the chain's next chunk
                yield self._block_stored(run, parent, pieces, place)
                run, pieces = [], []
            if not run:
                parent = previous
            run.append(key)
            store, first, last = at, i, i
        if run:
            pieces.append(store.tokens[first * step : (last + 1) * step])
            yield self._block_stored(run, parent, pieces, place)

    def _block_stored(
        self, keys: list[ChunkKey], parent: bytes | None, tokens: list[bytes], place: Place
    ) -> BlockStored:
        """One BlockStored of the chain `keys` after `parent`, whose packed token ids are
        `tokens` joined (none: a chunk published alone, without tokens or parent)."""
        salt = _client_salt(keys[0].cache_salt)
        if tokens:
            token_ids: list[int] | msgspec.Raw = token_array(tokens)
            extra: list[tuple[Any, ...] | None] = [None] * len(keys)
            if salt and parent is None:
                extra[0] = (salt,)
        else:
            token_ids, parent, extra = [], None, [None]
        return BlockStored(
            block_hashes=self._hashes(keys),
            parent_block_hash=None if parent is None else self._hash(parent),
            token_ids=token_ids,
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

"""KV events for routers: what every tier holds, published over ZMQ in vLLM's format.

`EventPublisher` follows storage (it is a `StorageObserver`) and publishes, per chunk group:
`BlockStored` when it becomes complete in a tier, `BlockRemoved` when it leaves one, and
`AllBlocksCleared` when a clear empties a model. `medium` and `locality` say where: the
shared-memory L1 is `CPU`/`LOCAL`, the disk tier `STORAGE`/`LOCAL`, a shared store (Redis,
Valkey, Mooncake) `STORAGE`/`REMOTE`. A chunk is one vLLM block: `block_hashes` are kvtier's
chunk names and `block_size` the chunk size, so with `--hash-algorithm sha256_cbor` they equal
vLLM's block hashes for a block size of the chunk size (requests without a cache salt or extra
key), sent as vLLM sends them (by default the last 8 bytes as an integer, see
`--kv-events-int-hashes`). `parent_block_hash`, `token_ids` and `extra_keys` (the cache salt on
a prompt's first chunk, as vLLM puts it, and the store's extra key on each; a salted chunk's
published hash is its name mixed with the salt) come from the store that named the chunk
(`ChunkNotes`, in `chunk_notes.py`); a chunk stored by name, or one whose note is gone (an L2
write long after its store, a chunk that survived a restart), is published alone, without tokens
or parent. A hand-off's chunks (a prefill instance's KV for one decode instance) are no
prefix-cache entries and are never published: their stores hide them (`ChunkNotes.hide`). A
batch's topic is `--kv-events-topic` followed by its chunks' model. When a model's engine
registered its KV cache groups (`learn_groups`: vLLM's connector does), each event goes out once
per group, with the group's `group_idx`, `kv_cache_spec_kind` and sliding window, as vLLM labels
its own: a kvtier chunk holds every group's piece and is announced only when a lookup resumes
after it, so each group's event is true of that group.

Delivery is vLLM's: one sequence number per batch, monotonic from 0 at each start (a consumer
that sees it go back knows the server restarted; each topic's first batch of a run begins with
`AllBlocksCleared`, and the disk tier's survivors are the first chunks stored), at least once, a
replay buffer bounded in bytes, one window per tenant, behind a ROUTER socket answering vLLM's
replay request (`event_replay.py`). Storage only
appends a report (a tuple of what it was told) to a queue, without a lock, and a store's note
is appended as it came: one thread of this module takes the queue every few milliseconds in
one go, files the notes, merges each run of one kind and tier into one report, turns them
into batches, encodes the tokens, and sends, never blocking (PUB drops at its high-water
mark; a full replay socket drops the reply). When reports come faster than that thread
publishes, the excess is dropped and the sequence skips a number, so a consumer sees the gap;
its replay then cannot fill it, and the consumer knows its view is incomplete.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np
import zmq

from kvtier.config import ConfigError, ServerConfig
from kvtier.keys import ChunkKey, shown
from kvtier.protocol import KVGroup
from kvtier.storage.observers import L1_TIER, Removal
from kvtier.storage.tiers.base import L2Tier

from .chunk_notes import NO_STORE, ChunkNotes
from .event_replay import ReplayBuffer, ReplayServer, tenant_of
from .event_wire import (
    LOCAL,
    MAX_BATCH_BYTES,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    binds_locally,
    client_salt,
    published_hash,
    seq_bytes,
    split_batches,
    token_array,
)

__all__ = ["EventPublisher", "EventStats", "Place", "open_events", "place_of"]

logger = logging.getLogger(__name__)

_POLL_MS = 20  # a publishing round at most this often (a batch's added latency)
_REPLAY_POLL_MS = 2  # while a replay waits for its peer's queue
#: the longest subscription message taken (a topic prefix and the model's name)
_MAX_SUBSCRIPTION_BYTES = 4096
_MAX_REPORTS = 1 << 20  # chunks reported, waiting for the thread; past it, dropped (a seq gap)
_SHUTDOWN_S = 2.0
# a report's kind (a flush waits for the reports before it), and the parts of a report
_STORED, _REMOVED, _CLEARED, _FLUSH = "stored", "removed", "cleared", "flush"
_KIND_TIER, _KEYS = operator.itemgetter(0, 1), operator.itemgetter(2)
_MODEL, _SALT, _CHUNK_HASH = (operator.itemgetter(i) for i in (0, 1, 3))  # a ChunkKey's

Event = BlockStored | BlockRemoved | AllBlocksCleared


class Place(NamedTuple):
    """Where a tier's chunks live, in vLLM's words."""

    medium: str
    locality: str


L1_PLACE = Place(MEDIUM_CPU, LOCAL)


def place_of(tier: L2Tier) -> Place:
    """An L2 tier's place: the disk tier is on this machine; every shared store is remote."""
    return Place(MEDIUM_STORAGE, LOCAL if getattr(tier, "kind", "") == "disk" else REMOTE)


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
    buffered_bytes: int = 0  # bytes of the batches kept for replay
    malformed_replays: int = 0  # replay requests ignored
    subscriptions: int = 0  # subscribe and unsubscribe messages taken


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
        max_reports: int = _MAX_REPORTS,
        buffer_bytes: int = 256 << 20,
        queue_bytes: int = 32 << 20,
        max_connections: int = 16,
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic
        self._chunk_size = chunk_size
        self._int_hashes = int_hashes
        self._places = {L1_TIER: L1_PLACE, **places}
        self.notes = notes
        # reports waiting for the thread, as they came (a commit or an eviction reports chunk
        # by chunk): a deque's append and popleft are atomic, so a report takes no lock; the
        # thread merges a run of one kind and tier into one
        self._inbox: deque[tuple[str, str, Any]] = deque()  # (kind, tier, what)
        # chunks (and clears) reported (the reporters' count) and taken (the thread's): what
        # waits is the difference, each side writing only its own
        self._in_chunks = 0
        self._out_chunks = 0
        self._max_reports = max_reports
        self._lock = threading.Lock()  # guards `_drops` (the rare path)
        self._drops = 0  # reports dropped
        self._drops_seen = 0  # of those, the ones the thread skipped a number for
        self._buffer = ReplayBuffer(buffer_bytes, buffer_batches)
        # a batch is at most MAX_BATCH_BYTES (see _split): a queue of that many bytes is this
        # many batches, for a subscriber or a replay peer that does not read
        queued = max(4, queue_bytes // MAX_BATCH_BYTES)
        self._ctx = zmq.Context()
        self._ctx.set(zmq.MAX_SOCKETS, 16)
        # XPUB in manual mode: what a subscriber subscribes to is taken here, and the server
        # keeps one subscription per connection (everything; SUB filters on its side too), so
        # subscriptions cost nothing however many or long a peer sends
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_MANUAL, 1)
        self._pub.setsockopt(zmq.SNDHWM, queued)
        self._pub.setsockopt(zmq.MAXMSGSIZE, _MAX_SUBSCRIPTION_BYTES)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        self._replays: ReplayServer | None = None
        try:
            self._open(self._pub, endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, queued)
                self._replay.setsockopt(zmq.RCVHWM, 16)
                self._replay.setsockopt(zmq.MAXMSGSIZE, 64)  # a request is 8 bytes
                self._open(self._replay, replay_endpoint)
                self._replays = ReplayServer(self._replay, self._buffer, max_connections)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._seen_models: set[str] = set()  # whose topics an unfiltered clear empties
        self._announced: set[bytes] = set()  # topics published since start
        self._topics: dict[str, bytes] = {}  # a model's topic
        self._tenants: dict[bytes, str] = {}  # a topic's tenant
        self._salts: dict[str, str] = {}  # a composed salt's client salt
        # a model's KV cache groups, as its engine registered them (see `learn_groups`)
        self._groups: dict[str, tuple[KVGroup, ...]] = {}
        self._n = dict.fromkeys(("batches", "events", "blocks", "subscriptions"), 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)

    @staticmethod
    def _open(sock: zmq.Socket[bytes], endpoint: str) -> None:
        """Bind a wildcard, loopback, ipc or inproc address; connect to any other (as vLLM
        does). A loopback address binds: connecting out to it would send every tenant's
        events to whichever local process binds that port first."""
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        if endpoint.startswith(("ipc://", "inproc://")) or binds_locally(endpoint):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)

    def start(self) -> None:
        """Start the publishing thread (before the tiers report what survived)."""
        self._thread.start()

    # -- what storage reports (any thread, maybe under the engine lock: an append only) -------

    def _admit(self, chunks: int) -> bool:
        """Count a report of `chunks` in, or drop it (and count the drop, which the thread
        turns into a skipped number) when the thread is that far behind."""
        if self._in_chunks - self._out_chunks + chunks > self._max_reports:
            with self._lock:
                self._drops += 1
            return False
        self._in_chunks += chunks
        return True

    def stored(self, keys: Sequence[ChunkKey], tier: str) -> None:
        if self.notes.hides:
            keys = self.notes.shown(keys)
        if keys and self._admit(len(keys)):
            self._inbox.append((_STORED, tier, keys))

    def removed(self, keys: Sequence[ChunkKey], tier: str, reason: Removal) -> None:
        if reason is Removal.DECLINED:  # never announced, so never taken back
            return
        if self.notes.hides:
            keys = self.notes.shown(keys)
        if keys and self._admit(len(keys)):
            self._inbox.append((_REMOVED, tier, keys))

    def cleared(self, tier: str, model: str | None, cache_salt: str | None) -> None:
        if self._admit(1):
            self._inbox.append((_CLEARED, tier, (model, cache_salt)))

    # -- the publishing thread ------------------------------------------------------------------

    def learn_groups(self, model: str, groups: tuple[KVGroup, ...]) -> None:
        """`model`'s engine keeps these KV cache groups: from now on its chunks are announced
        once per group, each event with the group's `group_idx`, kind and window, as the
        engine labels its own events. (Any thread: one dict assignment.)"""
        self._groups[model] = groups

    def _run(self) -> None:
        # One round every _POLL_MS (sooner only for a replay request): what was reported
        # meanwhile goes out together. Draining each report as it came would make this thread
        # take the GIL from the request threads once per chunk, which halved store throughput.
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        replays = self._replays
        while True:
            stopping = self._stop.is_set()
            try:
                busy = replays is not None and replays.busy
                ready = dict(poller.poll(_REPLAY_POLL_MS if busy else _POLL_MS))
                if self._pub in ready:
                    self._take_subscriptions()
                if replays is not None:
                    if self._replay in ready:
                        replays.receive()
                    replays.send()
                if self.notes:
                    self.notes.file()
                if self._inbox:
                    self._publish_reports()
            except Exception:
                logger.exception("kv events: publishing failed")
                time.sleep(0.1)
            if stopping:
                return

    def _take_subscriptions(self) -> None:
        """Read what subscribers sent; each subscription gives its connection everything."""
        pub = self._pub
        while pub.poll(0, zmq.POLLIN):
            message = pub.recv(zmq.NOBLOCK)
            if message[:1] == b"\x01":
                pub.setsockopt(zmq.SUBSCRIBE, b"")
            self._n["subscriptions"] += 1

    def _take(self) -> tuple[list[tuple[Any, ...]], list[threading.Event]]:
        """The reports waiting, each run of one kind and tier merged into one (grouped in C:
        no Python step per report), and the flushes waiting for them."""
        inbox = self._inbox
        popleft = inbox.popleft
        taken = [popleft() for _ in range(len(inbox))]  # only this thread takes
        reports: list[tuple[Any, ...]] = []
        flushes: list[threading.Event] = []
        chunks = 0
        for (kind, tier), run in itertools.groupby(taken, _KIND_TIER):
            if kind is _STORED or kind is _REMOVED:
                keys = list(itertools.chain.from_iterable(map(_KEYS, run)))
                chunks += len(keys)
                reports.append((kind, keys, tier))
            elif kind is _CLEARED:
                for _, _, (model, cache_salt) in run:
                    chunks += 1
                    reports.append((kind, model, cache_salt, tier))
            else:
                flushes.extend(flush for _, _, flush in run)
        self._out_chunks += chunks
        return reports, flushes

    def _publish_reports(self) -> None:
        drops = self._drops
        gap, self._drops_seen = drops != self._drops_seen, drops
        reports, flushes = self._take()
        if gap:  # reports were dropped: skip a number so consumers see it
            self._seq += 1
        by_topic: dict[bytes, list[Event]] = {}
        for report in reports:
            for model, event in self._events(report):
                topic = self._topics.get(model)
                if topic is None:
                    topic = self._topics[model] = (self._topic + shown(model)).encode()
                    self._tenants[topic] = tenant_of(model)
                by_topic.setdefault(topic, []).append(event)
        now = time.time()
        for topic, events in by_topic.items():
            if topic not in self._announced:  # what a router knew of an earlier run is void
                self._announced.add(topic)
                events.insert(0, AllBlocksCleared())
            tenant = self._tenants[topic]
            for batch in split_batches(events, self._chunk_size):
                self._send(tenant, topic, self._encoder.encode(KVEventBatch(now, batch)), batch)
        for flush in flushes:
            flush.set()

    def _send(self, tenant: str, topic: bytes, payload: bytes, events: list[Event]) -> None:
        seq = self._seq
        self._seq += 1
        self._buffer.add(tenant, seq, topic, payload)
        with contextlib.suppress(zmq.Again):  # PUB drops at its high-water mark, never blocks
            self._pub.send_multipart((topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        self._n["batches"] += 1
        self._n["events"] += len(events)
        self._n["blocks"] += sum(len(getattr(e, "block_hashes", ())) for e in events)

    def _events(self, report: tuple[Any, ...]) -> Iterable[tuple[str, Event]]:
        """(model, event) pairs for one report."""
        kind = report[0]
        if kind is _CLEARED:
            _, model, cache_salt, _tier = report
            if cache_salt is None:
                for m in [model] if model is not None else self._models():
                    yield m, AllBlocksCleared()
            return
        _, keys, tier = report
        place = self._places.get(tier, Place(MEDIUM_STORAGE, REMOTE))
        model = keys[0].model
        if len(set(map(_MODEL, keys))) == 1:  # the usual case: one request's chunks
            by_model = {model: keys}
        else:
            by_model = {}
            for key in keys:
                by_model.setdefault(key.model, []).append(key)
        self._seen_models.update(by_model)
        for model, model_keys in by_model.items():
            groups = self._groups.get(model, ())
            if kind is _REMOVED:
                removed = BlockRemoved(
                    self._hashes(model_keys), place.medium, locality=place.locality
                )
                if not groups:
                    yield model, removed
                for g in groups:
                    yield model, msgspec.structs.replace(removed, group_idx=g.group_idx)
            else:
                for event in self._stored_events(model_keys, place):
                    if not groups:
                        yield model, event
                    for g in groups:
                        yield (
                            model,
                            msgspec.structs.replace(
                                event,
                                group_idx=g.group_idx,
                                kv_cache_spec_kind=g.kind,
                                kv_cache_spec_sliding_window=g.sliding_window or None,
                            ),
                        )

    def _models(self) -> list[str]:
        return sorted(self._seen_models)

    def _stored_events(self, keys: list[ChunkKey], place: Place) -> Iterable[BlockStored]:
        """BlockStored events for `keys`: consecutive chunks of one chain in one event (as vLLM
        publishes a request's newly full blocks), each chunk without a note alone."""
        step = 4 * self._chunk_size
        run: list[ChunkKey] = []
        parent: bytes | None = None
        pieces: list[bytes] = []  # the run's tokens: a slice of each store it spans
        store, first, last = NO_STORE, 0, -1  # the run's chunks in `store`: first to last
        for key, note in zip(keys, self.notes.get_many(keys), strict=True):
            if note is not None and note[0] is store and note[1] == last + 1:
                run.append(key)  # the usual case: the next chunk of the same store
                last += 1
                continue
            if run:
                pieces.append(store.tokens[first * step : (last + 1) * step])
            if note is None:
                if run:
                    yield self._block_stored(run, parent, pieces, place, store.extra)
                yield self._block_stored([key], None, [], place)
                run, pieces, store = [], [], NO_STORE
                continue
            at, i = note
            previous = at.parent if i == 0 else at.keys[i - 1].chunk_hash
            if run and previous != run[-1].chunk_hash:  # not the chain's next chunk
                yield self._block_stored(run, parent, pieces, place, store.extra)
                run, pieces = [], []
            if not run:
                parent = previous
            run.append(key)
            store, first, last = at, i, i
        if run:
            pieces.append(store.tokens[first * step : (last + 1) * step])
            yield self._block_stored(run, parent, pieces, place, store.extra)

    def _block_stored(
        self,
        keys: list[ChunkKey],
        parent: bytes | None,
        tokens: list[bytes],
        place: Place,
        extra_key: bytes = b"",
    ) -> BlockStored:
        """One BlockStored of the chain `keys` after `parent`, whose packed token ids are
        `tokens` joined (none: a chunk published alone, without tokens or parent), stored
        under `extra_key`: each chunk's `extra_keys` carries it (hex), the first chunk of a
        prompt its cache salt too, as vLLM puts a request's salt."""
        salt = self._salt(keys[0].cache_salt)
        mark = (extra_key.hex(),) if extra_key else None
        if tokens:
            token_ids: list[int] | msgspec.Raw = token_array(tokens)
            extra: list[tuple[Any, ...] | None] = [mark] * len(keys)
            if salt and parent is None:
                extra[0] = (salt, *(mark or ()))
        else:
            token_ids, parent, extra = [], None, [mark]
        return BlockStored(
            block_hashes=self._hashes(keys),
            parent_block_hash=None if parent is None else self._hash(parent, salt),
            token_ids=token_ids,
            block_size=self._chunk_size,
            lora_id=None,
            medium=place.medium,
            lora_name=None,
            extra_keys=extra,
            locality=place.locality,
        )

    def _salt(self, cache_salt: str) -> str:
        """The salt the client sent for a key's composed `cache_salt` (remembered)."""
        salt = self._salts.get(cache_salt)
        if salt is None:
            if len(self._salts) > 4096:
                self._salts.clear()
            salt = self._salts[cache_salt] = client_salt(cache_salt)
        return salt

    def _hash(self, chunk_hash: bytes, salt: str = "") -> bytes | int:
        """A chunk's published hash: its name, mixed with its cache salt when it has one, so
        that salted and unsalted copies of a prompt (which vLLM hashes apart) differ."""
        return published_hash(chunk_hash, salt, as_int=self._int_hashes)

    def _hashes(self, keys: Sequence[ChunkKey]) -> list[bytes | int]:
        salt = self._salt(keys[0].cache_salt) if keys else ""
        if salt or len(set(map(_SALT, keys))) > 1:
            return [self._hash(k.chunk_hash, self._salt(k.cache_salt)) for k in keys]
        names = list(map(_CHUNK_HASH, keys))
        if not self._int_hashes:
            return names
        if len(names) >= 16 and set(map(len, names)) == {32}:  # each one's last 8 bytes, in C
            return np.frombuffer(b"".join(names), ">u8")[3::4].tolist()  # type: ignore[no-any-return]
        from_bytes = int.from_bytes
        return [from_bytes(name[-8:], "big") for name in names]

    # -- admin and lifecycle --------------------------------------------------------------------

    def sockets(self) -> list[tuple[str, zmq.Socket[bytes], list[str]]]:
        """(name, socket, bound endpoints) of each socket peers connect to (a PUB that
        connects out is none), for the connection guard."""
        out = []
        for name, sock in (("kv-events", self._pub), ("kv-events-replay", self._replay)):
            if sock is None:
                continue
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if endpoint:
                out.append((name, sock, [endpoint]))
        return out

    def stats(self) -> EventStats:
        return EventStats(
            endpoint=self._endpoint,
            replay_endpoint=self._replay_endpoint or "",
            next_seq=self._seq,
            buffered=len(self._buffer),
            buffered_bytes=self._buffer.total_bytes,
            replays=self._replays.replays if self._replays is not None else 0,
            malformed_replays=self._replays.malformed if self._replays is not None else 0,
            dropped_reports=self._drops,
            **self._n,
        )

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every report so far was published; False on timeout (tests, benchmarks)."""
        done = threading.Event()
        self._inbox.append((_FLUSH, "", done))  # set once what came before it went out
        return done.wait(timeout)

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
            buffer_bytes=config.kv_events_buffer_bytes,
            queue_bytes=config.kv_events_queue_bytes,
            max_connections=config.kv_events_max_connections,
        )
    except zmq.ZMQError as exc:
        raise ConfigError(
            f"--kv-events-endpoint / --kv-events-replay-endpoint: {exc}: give addresses this "
            "user can bind (a free tcp:// port, e.g. 'tcp://*:5557') or connect to"
        ) from None

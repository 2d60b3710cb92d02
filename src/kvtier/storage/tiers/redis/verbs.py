"""The object verbs both Redis tiers share (`RespTier`): SET, GET into the caller's buffer,
EXISTS and DEL, in hand-packed RESP over the batch engine."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import redis
from typing_extensions import Buffer

from kvtier.keys import ObjectKey
from kvtier.storage.observers import Removal
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.redis.batch import BatchEngine
from kvtier.storage.tiers.resp import Redirect, Wire, command, set_parts


class RespTier(BatchEngine):
    """What both Redis tiers share: object verbs over `resp.Wire`, batched per node, with
    cluster redirects followed. Subclasses name keys, route names to nodes, clear and report.
    """

    def redis_key(self, key: ObjectKey) -> str:
        """The Redis key name of `key`."""
        raise NotImplementedError

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: ObjectKey, data: Buffer, layout: str, *, resumable: bool = True) -> None:
        """SET the object (with EX ttl when configured); a Redis failure is counted, not raised."""
        self.put_many([(key, data, layout)], unresumable=() if resumable else (key,))

    def put_many(
        self,
        items: Sequence[tuple[ObjectKey, Buffer, str]],
        *,
        unresumable: Collection[ObjectKey] = (),
    ) -> int:
        """SET all objects, one pipeline per node; returns how many Redis accepted."""
        if not items:
            return 0
        names = [self.redis_key(key).encode() for key, _, _ in items]
        prepared = [self._codec.prepare(fmt.byte_view(data), layout) for _, data, layout in items]
        views = [p.payload for p in prepared]
        headers = [
            self._codec.header(key.to_str(), layout, p, resumable=key not in unresumable)
            for (key, _, layout), p in zip(items, prepared, strict=True)
        ]

        def send(i: int) -> list[Buffer]:
            return set_parts(names[i], headers[i], views[i], self.ttl)

        def read(wire: Wire, i: int) -> bool | Redirect:
            reply = wire.simple()
            return reply if isinstance(reply, Redirect) else True

        with self._counters.timed("write", len(items)):
            done = self._batch("put", names, send, read)
        written = [i for i, ok in enumerate(done) if ok]
        self._counters.wrote(len(written), sum(len(headers[i]) + len(views[i]) for i in written))
        return len(written)

    # -- reads ---------------------------------------------------------------------------------

    def _receive(
        self, wire: Wire, key: ObjectKey, out: memoryview, layout: str
    ) -> fmt.Verdict | Redirect | None:
        """Read one GET reply, its payload straight into `out` (a coded object's decoded into
        it); None for a nil reply."""
        n = wire.bulk_len()
        if isinstance(n, Redirect):
            return n
        if n < 0:
            return None
        text = key.to_str()
        hsize = fmt.header_size(text, layout)
        payload_digest: bytes | None = None
        if n == hsize + len(out):
            head = bytearray(hsize)
            wire.read_into(memoryview(head))
            payload_digest = fmt.read_hashed(out, lambda block, _: wire.read_into(block))
            wire.crlf()
            header = fmt.decode_split_header(head, out)
        else:  # not plain: read it whole to decode it or tell a mismatch from corruption
            value = bytearray(n)
            wire.read_into(memoryview(value))
            wire.crlf()
            return self._codec.read_whole(memoryview(value), text, layout, out)
        return fmt.verify(header, text, layout, out, n, payload_digest)

    def get_into(self, key: ObjectKey, out: memoryview, layout: str) -> fmt.Hit:
        """GET the object, its payload straight into `out`, and check it."""
        return self.get_many_into([(key, out, layout)])[0]

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[fmt.Hit]:
        """GET the objects, per node in pipelines of at most `GET_PIPELINE_BYTES`, each payload
        straight into its buffer, then check them.

        Large values go one GET at a time: Redis answers a pipeline of several multi-MiB values
        by queueing all of them, measured 2x slower than fetching them one by one.
        """
        if not items:
            return []
        jobs = [(key, fmt.byte_view(out), layout) for key, out, layout in items]
        names = [self.redis_key(key).encode() for key, _, _ in jobs]

        def send(i: int) -> list[Buffer]:
            return [command(b"GET", names[i])]

        def read(wire: Wire, i: int) -> fmt.Verdict | Redirect | None:
            key, out, layout = jobs[i]
            return self._receive(wire, key, out, layout)

        with self._counters.timed("read", len(jobs)):
            verdicts = self._batch("get", names, send, read, [len(out) for _, out, _ in jobs])
        hits = []
        for (key, out, _), verdict in zip(jobs, verdicts, strict=True):
            hits.append(self._counters.settle(verdict, len(out)))
            if verdict is fmt.Verdict.CORRUPT:
                self._counters.warn("corrupt", f"{self.kind} tier: deleting corrupt {key}")
                self._delete_names([self.redis_key(key).encode()])
                self._observer.removed((key.chunk,), self.name, Removal.CORRUPT)
        return hits

    # -- index verbs ---------------------------------------------------------------------------

    def _int_replies(self, what: str, verb: bytes, names: Sequence[bytes]) -> list[int]:
        def send(i: int) -> list[Buffer]:
            return [command(verb, names[i])]

        def read(wire: Wire, i: int) -> int | Redirect:
            reply = wire.simple()
            return reply if isinstance(reply, Redirect) else int(reply)

        return [r or 0 for r in self._batch(what, names, send, read)]

    def _delete_names(self, names: Sequence[bytes]) -> int:
        return sum(self._int_replies("delete", b"DEL", names))

    def contains(self, key: ObjectKey) -> bool:
        """EXISTS; False while Redis is unreachable."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """EXISTS for each key, one pipeline per node; False where the node is unreachable."""
        names = [self.redis_key(key).encode() for key in keys]
        return [bool(n) for n in self._int_replies("contains", b"EXISTS", names)]

    def delete(self, key: ObjectKey) -> bool:
        """DEL; False when absent or when Redis is unreachable."""
        return bool(self._delete_names([self.redis_key(key).encode()]))

    @staticmethod
    def server_figures(client: redis.Redis) -> tuple[int, int, int]:
        """(objects, used_bytes, capacity_bytes) of one server: its db's key count (all
        prefixes), used_memory and maxmemory."""
        info: dict[str, Any] = client.info("memory")
        return (
            int(client.dbsize()),
            int(info.get("used_memory", 0)),
            int(info.get("maxmemory", 0)),
        )

    def _shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

"""The Mooncake Store L2 tier: a fleet's shared DRAM pool, through Mooncake's own Python client.

`mooncake://master:50051/?metadata=http://master:8080/metadata&protocol=rdma&segment=64GiB`
joins the pool of the master at that address. This kvtier contributes `segment` bytes of its
own DRAM to the pool (0: it only uses what others give) and moves bytes with Mooncake's transfer
engine (TCP, or RDMA where there is a NIC for it).

Objects are named `{prefix}/{ObjectKey.to_str()}` and hold the shared object format (header,
then payload; see `format`). The arena is registered with the transfer engine
(`register_memory`), so a batch put sends each object as two pieces, its header from the staging
area and its payload straight from the arena slot, and a batch get lands the payload straight
in the slot; the digest is checked there before the slot counts as loaded.

Behaviour of the pool this tier is built around (all measured): a put on an existing name keeps
the stored object (chunks are named by their content, so it holds the same bytes; a damaged
one is deleted on read and the next store replaces it); a full pool accepts puts and evicts,
sometimes the new objects at once (later reads are misses); an object whose segment's owner
died is lost (a transfer error, then a miss); after a master restart every object is lost and
clients re-register by themselves. Master calls are bounded by `timeout` (see `mooncake_io`);
after a failure the tier answers misses and no-ops for `cooldown` seconds without asking.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import urllib.request
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

from typing_extensions import Buffer

from kvtier.keys import ObjectKey
from kvtier.redaction import redact
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.accounting import TierCounters
from kvtier.storage.tiers.base import TierStats
from kvtier.storage.tiers.codecs import TierCodec, parse_codec
from kvtier.storage.tiers.mooncake_io import (
    CallTimeout,
    Deadlines,
    Registered,
    Staging,
    address_of,
)
from kvtier.storage.tiers.options import PARSERS, parse_url

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50051
#: URL query options -> parser
OPTIONS = {
    "metadata": PARSERS["str"],
    "protocol": PARSERS["str"],
    "devices": PARSERS["str"],
    "segment": PARSERS["size"],
    "buffer": PARSERS["size"],
    "host": PARSERS["str"],
    "prefix": PARSERS["str"],
    "timeout": PARSERS["seconds"],
    "cooldown": PARSERS["seconds"],
    "metrics": PARSERS["str"],
    "codec": parse_codec,
}
PROTOCOLS = ("tcp", "rdma")
MIN_SEGMENT = 16 << 20  # a smaller segment fails Mooncake's setup
#: skipped: calls not made in a cool-down; late: calls past the deadline; staging_full: objects
#: left out for want of staging room; staged: payloads copied through staging (not in the arena);
#: pool_full: puts the pool refused for want of room (it evicts; not an error)
_EXTRA = ("skipped", "late", "staging_full", "staged", "pool_full")
#: Mooncake's own local buffer: only whole-object reads of objects that do not match a read
_CLIENT_BUFFER = 16 << 20
_NOT_FOUND = -704  # OBJECT_NOT_FOUND
_NO_ROOM = -200  # NO_AVAILABLE_HANDLE: the pool is full until its eviction makes room
_MASTER_FAILED = (-900, -901)  # RPC_FAIL: the master is unreachable or did not answer
#: a put moves its payloads too: its deadline grows by one second per this many bytes
PUT_FLOOR_BYTES_S = 100_000_000
_PREFIX_RE = re.compile(r"[A-Za-z0-9_-]+")
_STATS_EVERY_S = 2.0
_R = TypeVar("_R")


def install_hint() -> str:
    return (
        "the mooncake:// tier needs Mooncake's client: pip install 'kvtier[mooncake]' "
        "(mooncake-transfer-engine-non-cuda; on CUDA machines mooncake-transfer-engine) and "
        "the system library libibverbs1 (apt-get install libibverbs1)"
    )


def local_address(host: str, port: int) -> str:
    """The address of this machine's interface that routes to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def _pool_figures(metrics_url: str) -> tuple[int, int, int]:
    """(objects, allocated bytes, capacity bytes) of the whole pool, from the master's metrics."""
    url = metrics_url.rstrip("/")
    with urllib.request.urlopen(f"{url}/metrics", timeout=0.5) as reply:
        text = reply.read().decode()
    found = dict.fromkeys(
        ("master_key_count", "master_allocated_bytes", "master_total_capacity_bytes"), 0
    )
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in found:
            found[name] = int(float(value))
    return (
        found["master_key_count"],
        found["master_allocated_bytes"],
        found["master_total_capacity_bytes"],
    )


class MooncakeTier:
    """An L2 tier in the Mooncake Store pool whose master is at `master` ("host:port")."""

    kind = "mooncake"
    shared = True  # the pool every client of the master reads

    def __init__(
        self,
        master: str,
        *,
        metadata: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        devices: str = "",
        segment: int = 1 << 30,
        buffer: int = 64 << 20,
        host: str = "",
        prefix: str = "kvtier",
        timeout: float = 1.0,
        cooldown: float = 1.0,
        metrics: str = "",
        name: str = "mooncake",
        url: str = "",
        codec: str = "none",
    ) -> None:
        where = redact(url or f"mooncake://{master}/")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r} in {where}")
        if protocol == "rdma" and not devices:
            logger.info("mooncake tier: no devices= given, the transfer engine picks the NICs")
        if not (segment == 0 or segment >= MIN_SEGMENT) or buffer < 1 << 20:
            raise ValueError(
                f"segment must be 0 or at least 16MiB (Mooncake's smallest) and buffer at "
                f"least 1MiB, got segment={segment} buffer={buffer} in {where}"
            )
        if not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"prefix must be letters, digits, '_' or '-', got {prefix!r}")
        if timeout <= 0 or cooldown < 0:
            raise ValueError(
                f"timeout must be > 0 and cooldown >= 0 seconds, got {timeout}, {cooldown}"
            )
        master_host, _, port_text = master.rpartition(":")
        if not master_host or not port_text.isdigit():
            raise ValueError(f"the master address must be host:port, got {master!r} in {where}")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ValueError(f"{install_hint()} ({exc})") from None
        self.name = name
        self.url = where
        self.prefix = prefix
        self.cooldown = cooldown
        self._metrics = metrics
        self._counters = TierCounters(logger, _EXTRA)
        self._codec = TierCodec(codec)
        self._down_until = float("-inf")
        self._figures = (0, 0, 0)
        self._figures_at = float("-inf")
        host = host or local_address(master_host, int(port_text))
        # The transfer engine advertises the interface MC_TCP_BIND_ADDRESS names (else another
        # one); without a master, setup retries for 91 s unless told to try once (4.7 s).
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        self._store: Any = MooncakeDistributedStore()
        rc = self._store.setup(host, metadata, segment, _CLIENT_BUFFER, protocol, devices, master)
        if rc != 0:
            raise ValueError(
                f"cannot join the Mooncake pool of {where}: setup returned {rc} (is "
                f"mooncake_master running at {master}, and metadata={metadata!r} right?)"
            )
        self._calls = Deadlines(timeout, name=name)
        self._registered = Registered()
        self._staging = Staging(buffer)
        self._register(self._staging.address, self._staging.size)

    @classmethod
    def from_url(cls, url: str) -> MooncakeTier:
        """A tier from "mooncake://host:port/?metadata=...&protocol=tcp&segment=4GiB".

        Options: metadata (the metadata server's URL, or P2PHANDSHAKE, the default), protocol
        (tcp, rdma), devices (RDMA NICs, e.g. mlx5_0,mlx5_1), segment (DRAM this kvtier gives
        the pool, may be 0; default 1GiB), buffer (the registered transfer buffer for headers
        and payloads outside the arena; default 64MiB), host (the address this kvtier
        advertises; default the interface that routes to the master), prefix, timeout and
        cooldown (seconds), metrics (the master's metrics URL, for the pool's figures), codec
        (none, zstd, fp8: how new objects are stored, see `codecs`).
        """
        parts, kwargs = parse_url(url, OPTIONS, tier="Mooncake")
        if not parts.hostname:
            raise ValueError(f"a mooncake:// URL needs the master's host: {redact(url)!r}")
        try:
            port = parts.port or DEFAULT_PORT
        except ValueError as exc:
            raise ValueError(f"bad master port in {redact(url)!r}: {exc}") from None
        return cls(f"{parts.hostname}:{port}", url=url, **kwargs)

    # -- memory --------------------------------------------------------------------------------

    def _register(self, address: int, size: int) -> None:
        rc = self._store.register_buffer(address, size)
        if rc != 0:
            raise ValueError(f"mooncake tier: registering {size} bytes failed ({rc})")
        self._registered.add(address, size)

    def register_memory(self, buffer: memoryview) -> None:
        """Register `buffer` (the arena) with the transfer engine: reads and writes of views
        into it then move bytes in place."""
        self._register(address_of(buffer), buffer.nbytes)

    def _take(self, size: int, held: list[tuple[int, int]]) -> int | None:
        offset = self._staging.take(size)
        if offset is None:
            self._counters.add("staging_full")
            return None
        held.append((offset, size))
        return offset

    def _place(self, view: memoryview, held: list[tuple[int, int]], copy_in: bool) -> int | None:
        """The address Mooncake moves `view`'s bytes from or to: the view itself when it is
        registered memory, else a staging range (filled from it when `copy_in`)."""
        address = address_of(view)
        if self._registered.covers(address, len(view)):
            return address
        offset = self._take(len(view), held)
        if offset is None:
            return None
        self._counters.add("staged")
        if copy_in:
            self._staging.view(offset, len(view))[:] = view
        return self._staging.address + offset

    # -- health --------------------------------------------------------------------------------

    def _available(self, n: int = 1) -> bool:
        if time.monotonic() < self._down_until:
            self._counters.add("skipped", n)
            return False
        return True

    def _down(self, what: str, exc: BaseException | str) -> None:
        self._down_until = time.monotonic() + self.cooldown
        if isinstance(exc, CallTimeout):
            self._counters.add("late")
        self._counters.failed(what, f"mooncake pool {self.url}: {exc}")

    def _call(
        self,
        what: str,
        fn: Callable[[], _R],
        after: Callable[[], None] | None = None,
        *,
        extra_s: float = 0.0,
    ) -> _R:
        try:
            return self._calls.run(fn, after, extra_s=extra_s)
        except CallTimeout as exc:
            self._down(what, exc)
            raise

    def name_of(self, key: ObjectKey) -> str:
        """The pool's name of `key`."""
        return f"{self.prefix}/{key.to_str()}"

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: ObjectKey, data: Buffer, layout: str, *, resumable: bool = True) -> None:
        """Store one object (see `put_many`)."""
        self.put_many([(key, data, layout)], unresumable=() if resumable else (key,))

    def put_many(
        self,
        items: Sequence[tuple[ObjectKey, Buffer, str]],
        *,
        unresumable: Collection[ObjectKey] = (),
    ) -> int:
        """Store the objects in one batch, each as its header and its payload in place;
        returns how many the pool accepted."""
        if not items or not self._available(len(items)):
            return 0
        held: list[tuple[int, int]] = []
        names: list[str] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        nbytes = 0
        for key, data, layout in items:
            prepared = self._codec.prepare(fmt.byte_view(data), layout)
            view = prepared.payload  # a coded one goes through the staging buffer
            header = self._codec.header(
                key.to_str(), layout, prepared, resumable=key not in unresumable
            )
            at = self._take(len(header), held)
            payload_at = None if at is None else self._place(view, held, copy_in=True)
            if at is None or payload_at is None:
                continue
            self._staging.view(at, len(header))[:] = header
            names.append(self.name_of(key))
            ptrs.append([self._staging.address + at, payload_at])
            sizes.append([len(header), len(view)])
            nbytes += len(header) + len(view)
        if not names:
            self._staging.give(held)
            return 0
        try:
            with self._counters.timed("write", len(names)):
                codes = self._call(
                    "put",
                    lambda: self._store.batch_put_from_multi_buffers(names, ptrs, sizes),
                    lambda: self._staging.give(held),
                    extra_s=nbytes / PUT_FLOOR_BYTES_S,
                )
        except CallTimeout:
            return 0
        written = [i for i, rc in enumerate(codes) if rc == 0]
        self._counters.add("pool_full", sum(1 for rc in codes if rc == _NO_ROOM))
        failed = [rc for rc in codes if rc not in (0, _NO_ROOM)]
        if any(rc in _MASTER_FAILED for rc in failed):
            self._down("put", f"master call failed ({failed[0]}) for {len(failed)} puts")
        elif failed:
            self._counters.failed("put", f"mooncake put of {len(failed)} objects: {failed[0]}")
        self._counters.wrote(len(written), sum(sum(sizes[i]) for i in written))
        return len(written)

    # -- reads ---------------------------------------------------------------------------------

    def get_into(self, key: ObjectKey, out: memoryview, layout: str) -> fmt.Hit:
        """Read one object's payload into `out` and check it (see `get_many_into`)."""
        return self.get_many_into([(key, out, layout)])[0]

    def _sizes(self, names: list[str]) -> dict[str, int] | None:
        """Each stored name's object size (one master call); None when the master failed."""
        try:
            desc = self._call("get", lambda: self._store.batch_get_replica_desc(names))
        except CallTimeout:
            return None
        if not desc:  # an empty answer is also how a failed call looks: ask what it was
            try:
                flags = self._call("get", lambda: self._store.batch_is_exist(names))
            except CallTimeout:
                return None
            if any(f < 0 for f in flags):
                self._down("get", f"master call failed ({min(flags)})")
                return None
            return {}
        sizes: dict[str, int] = {}
        for name, replicas in desc.items():
            for replica in replicas:
                if replica.is_memory_replica():
                    sizes[name] = int(replica.get_memory_descriptor().buffer_descriptor.size)
                    break
        return sizes

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[fmt.Hit]:
        """Read the objects in one batch, each payload straight into its buffer, then check
        key, layout, size and digest; anything else is a miss, never bytes handed out.

        The master is asked first (bounded by `timeout`) which objects exist and their sizes;
        objects of exactly the expected size are transferred into the buffers, smaller ones
        (coded objects, or others to tell apart) whole into the staging buffer. That
        transfer is waited for whole: a buffer is never given back while the pool may still
        write into it.
        """
        if not items:
            return []
        jobs = [(key, fmt.byte_view(out), layout) for key, out, layout in items]
        verdicts: list[fmt.Verdict | None] = [None] * len(jobs)
        with self._counters.timed("read", len(jobs)):
            if self._available(len(jobs)):
                names = [self.name_of(key) for key, _, _ in jobs]
                sizes = self._sizes(names)
                if sizes is not None:
                    self._read(jobs, names, sizes, verdicts)
        hits = []
        for (key, out, _), verdict in zip(jobs, verdicts, strict=True):
            hits.append(self._counters.settle(verdict, len(out)))
            if verdict is fmt.Verdict.CORRUPT:
                self._counters.warn("corrupt", f"mooncake tier: deleting corrupt {key}")
                self._remove([self.name_of(key)])
        return hits

    def _read(
        self,
        jobs: list[tuple[ObjectKey, memoryview, str]],
        names: list[str],
        sizes: dict[str, int],
        verdicts: list[fmt.Verdict | None],
    ) -> None:
        held: list[tuple[int, int]] = []
        exact: list[tuple[int, int, int]] = []  # (job index, header offset, payload address)
        whole: list[tuple[int, int, int]] = []  # (job index, staging offset, object size)
        for i, (key, out, layout) in enumerate(jobs):
            size = sizes.get(names[i])
            if size is None:
                continue
            hsize = fmt.header_size(key.to_str(), layout)
            if size < hsize + len(out) and self._staging.size >= size:
                at = self._take(size, held)
                if at is not None:
                    whole.append((i, at, size))
                    continue
            if size != hsize + len(out):
                verdicts[i] = self._judge_whole(names[i], key, out, layout, size)
                continue
            at = self._take(hsize, held)
            payload_at = None if at is None else self._place(out, held, copy_in=False)
            if at is not None and payload_at is not None:
                exact.append((i, at, payload_at))
        try:
            if exact or whole:
                self._transfer(jobs, names, exact, whole, verdicts)
        finally:
            self._staging.give(held)

    def _transfer(
        self,
        jobs: list[tuple[ObjectKey, memoryview, str]],
        names: list[str],
        exact: list[tuple[int, int, int]],
        whole: list[tuple[int, int, int]],
        verdicts: list[fmt.Verdict | None],
    ) -> None:
        stage = self._staging
        hsizes = [fmt.header_size(jobs[i][0].to_str(), jobs[i][2]) for i, _, _ in exact]
        codes = self._store.batch_get_into_multi_buffers(
            [names[i] for i, _, _ in exact] + [names[i] for i, _, _ in whole],
            [[stage.address + at, payload_at] for _, at, payload_at in exact]
            + [[stage.address + at] for _, at, _ in whole],
            [[h, len(jobs[i][1])] for (i, _, _), h in zip(exact, hsizes, strict=True)]
            + [[size] for _, _, size in whole],
        )
        errors = []
        for (i, at, size), rc in zip(whole, codes[len(exact) :], strict=True):
            if rc != size:
                if rc != _NOT_FOUND:
                    errors.append(rc)
                continue
            key, out, layout = jobs[i]
            verdicts[i] = self._codec.read_whole(stage.view(at, size), key.to_str(), layout, out)
        for (i, at, payload_at), hsize, rc in zip(exact, hsizes, codes[: len(exact)], strict=True):
            key, out, layout = jobs[i]
            total = hsize + len(out)
            if rc != total:
                if rc != _NOT_FOUND:  # gone since the master answered: a plain miss
                    errors.append(rc)
                continue
            if payload_at != address_of(out):  # landed in staging: out is not registered
                out[:] = stage.view(payload_at - stage.address, len(out))
            header = fmt.decode_split_header(stage.view(at, hsize), out)
            verdicts[i] = fmt.verify(header, key.to_str(), layout, out, total)
        if any(rc in _MASTER_FAILED for rc in errors):
            self._down("get", f"master call failed ({errors[0]}) for {len(errors)} gets")
        elif errors:
            self._counters.failed("get", f"mooncake get of {len(errors)} objects: {errors[0]}")

    def _judge_whole(
        self, name: str, key: ObjectKey, out: memoryview, layout: str, size: int
    ) -> fmt.Verdict | None:
        """The verdict on an object whose size does not fit the read: read it whole (a copy, in
        Mooncake's own buffer) to decode a coded one that did not fit the staging buffer, or to
        tell a sound object of another layout or size from a damaged one. One larger than that
        buffer is counted as a size mismatch."""
        if size > _CLIENT_BUFFER:
            return fmt.Verdict.SIZE_MISMATCH
        try:
            value = self._call("get", lambda: self._store.get(name))
        except CallTimeout:
            return None
        if not value:  # b"" is how the client says "not stored"
            return None
        return self._codec.read_whole(memoryview(value), key.to_str(), layout, out)

    # -- index verbs ---------------------------------------------------------------------------

    def contains(self, key: ObjectKey) -> bool:
        """Whether the pool holds `key`; False while the master is unreachable."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """One master call for all keys; False where it fails."""
        if not keys or not self._available():
            return [False] * len(keys)
        names = [self.name_of(key) for key in keys]
        try:
            flags = self._call("contains", lambda: self._store.batch_is_exist(names))
        except CallTimeout:
            return [False] * len(keys)
        if any(f < 0 for f in flags):
            self._down("contains", f"master call failed ({min(flags)})")
        return [f == 1 for f in flags]

    def _remove(self, names: list[str]) -> int:
        """Remove the names, leases or not (a read holds one for seconds); how many were."""
        if not self._available():
            return 0
        try:
            codes = self._call("delete", lambda: self._store.batch_remove(names, force=True))
        except CallTimeout:
            return 0
        errors = [rc for rc in codes if rc not in (0, _NOT_FOUND)]
        if errors:
            self._counters.failed("delete", f"mooncake remove failed: {errors[0]}")
        return sum(1 for rc in codes if rc == 0)

    def delete(self, key: ObjectKey) -> bool:
        """Remove the object under `key`; True when there was one."""
        return bool(self._remove([self.name_of(key)]))

    def clear_pattern(self, model: str | None, cache_salt: str | None) -> str:
        """The regular expression of this prefix's names of `model` and `cache_salt`."""
        m = "[0-9a-f]*" if model is None else model.encode().hex()
        s = "[0-9a-f]*" if cache_salt is None else cache_salt.encode().hex()
        # hex has no '.', so "m\.s\." pins each filter to its own field
        return f"^{self.prefix}/{m}\\.{s}\\."

    def clear(self, *, model: str | None = None, cache_salt: str | None = None) -> int:
        """Remove this prefix's objects matching the filters (one master call)."""
        if not self._available():
            return 0
        pattern = self.clear_pattern(model, cache_salt)
        try:
            n = int(self._call("clear", lambda: self._store.remove_by_regex(pattern, force=True)))
        except CallTimeout:
            return 0
        if n < 0:
            self._down("clear", f"remove_by_regex failed ({n})")
            return 0
        return n

    def stats(self) -> TierStats:
        """Counters of this process; objects, used and capacity are the whole pool's (from the
        master's metrics when `metrics` names them, else 0)."""
        now = time.monotonic()
        if self._metrics and now - self._figures_at >= _STATS_EVERY_S:
            self._figures_at = now
            try:
                self._figures = _pool_figures(self._metrics)
            except (OSError, ValueError) as exc:  # reported, but not a failed tier call
                self._counters.failed(
                    "stats", f"mooncake metrics {self._metrics}: {exc}", count=False
                )
        objects, used, capacity = self._figures
        return self._counters.snapshot(
            name=self.name,
            kind=self.kind,
            url=self.url,
            objects=objects,
            used_bytes=used,
            capacity_bytes=capacity,
            healthy=time.monotonic() >= self._down_until,
            extra={"staging_bytes": self._staging.size, "late_now": self._calls.late},
            codec=self._codec.stats(),
        )

    def close(self) -> None:
        """Leave the pool (this kvtier's segment and its objects go with it)."""
        self._calls.close()
        try:
            self._store.close()
        except Exception as exc:  # the client's own teardown; nothing left to protect
            logger.warning("mooncake tier: close failed: %s", exc)

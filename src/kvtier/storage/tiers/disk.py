"""The local-disk L2 tier: one file per object in a folder, with its own byte capacity and LRU.

Layout: `<root>/<first 2 hex chars of the chunk hash>/<key.to_str()>` (a 256-way shard keeps
folders small). A name longer than `MAX_NAME` is replaced by "h-" + the xxh3-128 hex of the key
text; the key is recovered from the file's header on restart.

Writes are atomic: the object goes to `.tmp.kvtier.<pid>.<random>` in the destination folder and
is renamed onto its real name, so a crash never leaves half an object under a real name. At
startup only temp files named so by a process that no longer runs are removed: the tier never
touches files it did not make (another program's `.tmp.*` in a shared folder is left alone).
fsync is off by default: this is a cache, so losing the last writes in a
power cut costs only misses, and a torn file that survives one is caught by the header digest
and deleted on read. `fsync=True` adds a file and folder fsync per write for a durable cache.

Replacing a file by renaming onto it makes ext4 (auto_da_alloc) start writeback of the new file
at once, which doubled the cost of a rewrite; so a rewrite swaps the two names atomically with
renameat2(RENAME_EXCHANGE) where Linux offers it and then unlinks the old file under the temp
name. A rewrite whose object is already stored intact (same header, payload digest checked) is
skipped and counted as `unchanged`.

What the tier loses on its own (an eviction, a corrupt file deleted on read), what it deletes
or clears, and at start what its folder holds, it reports to the observer the tier manager
hands it (`kvtier.storage.observers`).

The index (key -> file size, in LRU order) lives in memory and is rebuilt from the folder at
startup, ordered by file mtime; a read refreshes an mtime older than a second so the rebuilt
order follows reads too. One lock guards the index; file data is read and written outside it.
Only metadata operations (rename, unlink) run under it, so an eviction can never remove a newer
file that a concurrent put renamed onto the same name.

A full filesystem does not stop the tier: the effective capacity is at most what the tier holds
plus the filesystem's free space (checked at most once a second), and a write that still fails
with ENOSPC or EDQUOT shrinks the effective capacity to 90% of what the tier holds, evicts down
to it and retries once. Repeated warnings are rate-limited (`accounting.WARN_EVERY_S`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import xxhash
from typing_extensions import Buffer

from kvtier.keys import ChunkKey, ObjectKey
from kvtier.storage.observers import NO_OBSERVER, Removal, StorageObserver
from kvtier.storage.tiers import files
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.accounting import TierCounters
from kvtier.storage.tiers.base import TierStats
from kvtier.storage.tiers.codecs import Prepared, TierCodec, parse_codec
from kvtier.storage.tiers.options import PARSERS, parse_url

logger = logging.getLogger(__name__)

MAX_NAME = 200  # file names longer than this are hashed (most filesystems allow 255 bytes)
TEMP_PREFIX = files.TEMP_PREFIX
DEFAULT_CAPACITY = 10 << 30  # for a URL without ?size=
OPTIONS = {"size": PARSERS["size"], "fsync": PARSERS["bool"], "codec": parse_codec}
_EXTRA = ("evictions", "stale_temps_removed", "unchanged", "disk_full")
_FREE_CHECK_S = 1.0  # statvfs at most this often
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_REBUILD_REPORT_S = 5.0  # a start that indexes a big folder says how far it got this often
_TOUCH_NS = 1_000_000_000  # a read refreshes an mtime older than this (one metadata write less)


class _Read(NamedTuple):
    """An object read from its file, its digest not checked yet."""

    key: ObjectKey
    text: str
    layout: str
    out: memoryview
    header: fmt.Header | None
    total: int
    path: str
    st: os.stat_result
    payload_digest: bytes | None  # computed while reading
    stored: bytearray | None = None  # a coded object's stored payload (out not filled yet)


class _Truncated(Exception):
    """A file ended before its size said it would."""


def _check_writable(folder: Path) -> None:
    """Create and remove one temp file in `folder`: a folder this process cannot write fails
    here, at start, as an OSError naming it, instead of on every later write."""
    probe = folder / files.temp_name()
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        reason = f"disk tier folder is not writable: {exc.strerror}"
        raise OSError(exc.errno, reason, str(folder)) from None
    os.close(fd)
    os.unlink(probe)


class DiskTier:
    """An L2 tier of files under `path`, at most `capacity_bytes` in all (0 = unbounded)."""

    kind = "disk"
    shared = False  # this machine's own files

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        fsync: bool = False,
        name: str = "disk",
        codec: str = "none",
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (0 = unbounded), got {capacity_bytes}")
        self.name = name
        self.root = Path(path).expanduser().resolve()
        self._root_text = str(self.root).rstrip("/")
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._codec = TierCodec(codec)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_writable(self.root)
        self._lock = threading.Lock()
        self._index: OrderedDict[ObjectKey, int] = OrderedDict()
        self._used = 0
        self._shards: set[str] = set()
        self._counters = TierCounters(logger, _EXTRA)
        self._effective = capacity_bytes  # shrunk while the filesystem is full (0 = unbounded)
        self._free_checked = float("-inf")
        self._digest_pool: ThreadPoolExecutor | None = None
        self._observer: StorageObserver = NO_OBSERVER
        self._rebuild()

    def observe(self, observer: StorageObserver) -> None:
        """Report evictions, corrupt reads, deletes and clears to `observer` from now on."""
        self._observer = observer

    def complete_chunks(self) -> list[ChunkKey]:
        """The groups whose every piece is indexed (at start: what survived a restart)."""
        with self._lock:
            pieces: dict[ChunkKey, int] = {}
            for key in self._index:
                chunk = key.chunk
                pieces[chunk] = pieces.get(chunk, 0) + 1
        return [chunk for chunk, n in pieces.items() if n == chunk.world_size]

    @classmethod
    def from_url(cls, url: str) -> DiskTier:
        """A tier from "disk:///abs/path?size=50GiB&fsync=1&codec=zstd" or "disk://relative/path".

        In "disk://relative/path" everything after "//" is a path relative to the current
        working directory when the tier is opened; "disk:///abs" (three slashes) is absolute and
        "disk://~/x" is under the home folder. `size` defaults to 10GiB; "0" means unbounded.
        `codec` (none, zstd, fp8; see `codecs`) is how new objects are stored.
        """
        parts, options = parse_url(url, OPTIONS, tier="disk")
        if parts.scheme.lower() != "disk":
            raise ValueError(f"not a disk tier URL: {url!r}")
        path = parts.netloc + parts.path
        if not path:
            raise ValueError(f"disk tier URL without a path: {url!r}")
        size = options.get("size", DEFAULT_CAPACITY)
        fsync = options.get("fsync", False)
        codec = options.get("codec", "none")
        return cls(os.path.abspath(os.path.expanduser(path)), size, fsync=fsync, codec=codec)

    # -- naming --------------------------------------------------------------------------------

    def _path(self, key: ObjectKey, text: str | None = None) -> tuple[str, str]:
        """(shard folder, file path) of `key`."""
        text = key.to_str() if text is None else text
        shard = f"{key.chunk_hash[0]:02x}" if key.chunk_hash else "00"
        name = text if len(text) <= MAX_NAME else "h-" + xxhash.xxh3_128_hexdigest(text.encode())
        folder = f"{self._root_text}/{shard}"  # the read path's hot spot: no os.path.join
        return folder, f"{folder}/{name}"

    def _ensure_folder(self, folder: str) -> None:
        if folder not in self._shards:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            self._shards.add(folder)

    # -- startup -------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index every object file under the root (LRU by mtime); remove stale temp files."""
        found: list[tuple[int, ObjectKey, int]] = []
        started = next_report = time.monotonic()
        for shard in os.scandir(self.root):
            if time.monotonic() >= next_report + _REBUILD_REPORT_S:  # a big tier takes minutes
                next_report = time.monotonic()
                logger.info(
                    "disk tier: indexing %s: %d objects so far (%.0f s)",
                    self.root, len(found), next_report - started,
                )  # fmt: skip
            if files.own_stale_temp(shard.name):
                self._remove_temp(shard.path)
            if not shard.is_dir(follow_symlinks=False) or len(shard.name) != 2:
                continue
            self._shards.add(shard.path)
            for entry in os.scandir(shard.path):
                if entry.name.startswith(".tmp."):
                    if files.own_stale_temp(entry.name):
                        self._remove_temp(entry.path)
                    continue
                if not entry.is_file(follow_symlinks=False):
                    continue
                key = self._key_of(entry.path, entry.name)
                if key is None or self._path(key)[1] != entry.path:
                    logger.warning("disk tier: ignoring foreign file %s", entry.path)
                    continue
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, key, st.st_size))
        if time.monotonic() - started >= _REBUILD_REPORT_S:
            logger.info("disk tier: indexed %d objects in %s", len(found), self.root)
        found.sort(key=lambda t: t[0])
        for _, key, size in found:
            self._index[key] = size
            self._used += size
        with self._lock:
            self._make_room(0)

    def _remove_temp(self, path: str) -> None:
        try:
            os.unlink(path)
            self._counters.add("stale_temps_removed")
        except OSError as exc:
            logger.warning("disk tier: cannot remove stale temp file %s: %s", path, exc)

    @staticmethod
    def _key_of(path: str, name: str) -> ObjectKey | None:
        """The key a file name stands for (read from the header for hashed names)."""
        try:
            if not name.startswith("h-"):
                return ObjectKey.from_str(name)
            with open(path, "rb") as f:
                header = fmt.decode_header(f.read(fmt.FIXED_SIZE + 2 * fmt.MAX_TEXT))
            return None if header is None else ObjectKey.from_str(header.key_text)
        except (ValueError, OSError):
            return None

    # -- capacity ------------------------------------------------------------------------------

    def _make_room(self, size: int) -> None:
        """Evict least-recently-used objects until `size` more bytes fit the effective capacity.
        Caller holds the lock."""
        self._follow_free_space()
        if not self._effective:
            return
        while self._index and self._used + size > self._effective:
            key, old = self._index.popitem(last=False)
            self._used -= old
            self._counters.add("evictions")
            self._unlink(key)
            self._observer.removed((key.chunk,), self.name, Removal.EVICTED)

    def _follow_free_space(self) -> None:
        """Effective capacity = min(capacity, held + free space), checked at most once a second,
        so the tier evicts before the filesystem fills. Caller holds the lock."""
        now = time.monotonic()
        if now - self._free_checked < _FREE_CHECK_S:
            return
        self._free_checked = now
        try:
            st = os.statvfs(self.root)
        except OSError:
            return
        room = self._used + st.f_bavail * st.f_frsize
        self._effective = room if not self.capacity_bytes else min(self.capacity_bytes, room)

    def _disk_full(self, size: int, exc: OSError) -> None:
        """A write of `size` bytes failed for want of space: shrink the effective capacity to 90%
        of what the tier holds and evict down to it, leaving room for that write."""
        with self._lock:
            self._effective = max(1, self._used * 9 // 10)
            self._free_checked = time.monotonic()  # hold the shrunk figure for a while
            self._counters.add("disk_full")
            self._make_room_fixed(size)
        self._counters.failed(
            "disk full",
            f"disk tier {self.root}: filesystem full ({exc.strerror}); effective capacity "
            f"shrunk to {self._effective} bytes",
        )

    def _make_room_fixed(self, size: int) -> None:
        """`_make_room` without re-reading the free space. Caller holds the lock."""
        while self._index and self._used + size > self._effective:
            key, old = self._index.popitem(last=False)
            self._used -= old
            self._counters.add("evictions")
            self._unlink(key)
            self._observer.removed((key.chunk,), self.name, Removal.EVICTED)

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: ObjectKey, data: Buffer, layout: str, *, resumable: bool = True) -> None:
        """Write atomically (temp file + rename); raises OSError when the disk write fails.

        A write that finds the filesystem full shrinks the effective capacity, evicts and is
        tried once more (see the module docstring).
        """
        self._put(key, self._codec.prepare(fmt.byte_view(data), layout), layout, resumable)

    def _put(self, key: ObjectKey, prepared: Prepared, layout: str, resumable: bool = True) -> None:
        text = key.to_str()
        view = prepared.payload
        header = self._codec.header(text, layout, prepared, aligned=True, resumable=resumable)
        size = len(header) + len(view)
        if self.capacity_bytes and size > self.capacity_bytes:
            raise ValueError(
                f"an object of {size} bytes cannot fit the disk tier's "
                f"capacity_bytes={self.capacity_bytes}"
            )
        folder, final = self._path(key, text)
        with self._lock:
            known = key in self._index
        if known and self._holds(final, header, len(view)):
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
            self._counters.add("puts")
            self._counters.add("unchanged")
            return
        with self._counters.timed("write"):
            try:
                self._write(key, header, view, folder, final)
            except OSError as exc:
                if exc.errno not in _FULL_ERRNOS:
                    raise
                self._disk_full(size, exc)
                try:
                    self._write(key, header, view, folder, final)
                except OSError as again:
                    if again.errno in _FULL_ERRNOS:
                        self._counters.failed("disk full", f"disk tier {self.root}: {again}")
                    raise

    def _write(
        self, key: ObjectKey, header: bytes, view: memoryview, folder: str, final: str
    ) -> None:
        size = len(header) + len(view)
        with self._lock:
            self._make_room(size)
            self._used += size  # reserved until the rename (or failure) settles it
        tmp = os.path.join(folder, files.temp_name())
        try:
            self._ensure_folder(folder)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                files.write_all(fd, [memoryview(header), view])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                # the old file, if any, ends up under the temp name
                swapped = key in self._index and not self.fsync and files.exchange(tmp, final)
                if not swapped:
                    os.rename(tmp, final)
                old = self._index.pop(key, None)
                if old is not None:
                    self._used -= old
                self._index[key] = size
            self._counters.wrote(1, size)
        except BaseException as exc:
            with self._lock:
                self._used -= size
            if not (isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS):
                self._counters.failed("write", f"disk tier: cannot write {key}: {exc}")
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if swapped:
            try:
                os.unlink(tmp)
            except OSError as exc:  # removed as a stale temp file at the next start
                self._counters.warn("unlink", f"disk tier: cannot remove replaced {tmp}: {exc}")
        if self.fsync:
            dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    @staticmethod
    def _holds(path: str, header: bytes, payload_len: int) -> bool:
        """Whether `path` already holds exactly this object: same header, payload digest checked."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            if os.fstat(fd).st_size != len(header) + payload_len:
                return False
            if os.pread(fd, len(header), 0) != header:
                return False
            if payload_len:
                with (
                    mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m,
                    memoryview(m) as stored,
                ):
                    if fmt.digest(stored[len(header) :]) != header[fmt.DIGEST_AT]:
                        return False
            os.utime(fd)
            return True
        except (OSError, ValueError):
            return False
        finally:
            os.close(fd)

    def put_many(
        self,
        items: Sequence[tuple[ObjectKey, Buffer, str]],
        *,
        unresumable: Collection[ObjectKey] = (),
    ) -> int:
        """`put` each item; a failed one is logged and counted in `errors`, not raised.

        The digests of objects of `fmt.BLOCK` bytes or more (with a codec: the encoding and the
        digest of every object) are computed ahead on the digest thread, so the next object is
        prepared while this one is written (both release the GIL).
        """
        views = [fmt.byte_view(data) for _, data, _ in items]
        ahead: list[Future[Prepared] | None] = [None] * len(items)
        if len(items) > 1:
            pool = self._digester()
            coded = self._codec.codec.id != 0
            ahead = [
                pool.submit(self._codec.prepare, v, layout)
                if coded or len(v) >= fmt.BLOCK
                else None
                for (_, _, layout), v in zip(items, views, strict=True)
            ]
        written = 0
        for (key, _, layout), view, pending in zip(items, views, ahead, strict=True):
            try:
                prepared = (
                    self._codec.prepare(view, layout) if pending is None else pending.result()
                )
                self._put(key, prepared, layout, key not in unresumable)
                written += 1
            except (OSError, ValueError) as exc:
                self._counters.warn("write", f"disk tier: cannot write {key}: {exc}")
        return written

    # -- reads ---------------------------------------------------------------------------------

    def get_into(self, key: ObjectKey, out: memoryview, layout: str) -> fmt.Hit:
        """Read the payload straight into `out` (one preadv with the header; no extra copy),
        then check it."""
        with self._counters.timed("read"):
            return self._check(self._read(key, fmt.byte_view(out), layout))

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[fmt.Hit]:
        """`get_into` for each item, in order, the reads overlapped with the digests.

        Objects of at least `fmt.BLOCK` bytes are read whole (one preadv with the header) while
        the digest thread hashes the one before; both calls release the GIL, so on a quiet
        2-core machine 4 MiB objects came in at 0.81-0.84 of plain reads (the tiers benchmark),
        against 0.70-0.72 hashing each block right after it lands (`format.read_hashed`, still
        used for smaller objects, where handing one to the thread would cost more than hashing
        it). Every verdict is given after its object's digest is known, as in `get_into`.
        """
        if len(items) < 2:
            return [self.get_into(key, out, layout) for key, out, layout in items]
        with self._counters.timed("read", len(items)):
            reads: list[tuple[_Read | None, Future[bytes] | None]] = []
            for key, out, layout in items:
                view = fmt.byte_view(out)
                whole = len(view) >= fmt.BLOCK
                read = self._read(key, view, layout, hash_blocks=not whole)
                pending = None
                if whole and read is not None and read.header is not None:
                    pending = self._digester().submit(fmt.digest, read.out)
                reads.append((read, pending))
            hits = []
            for read, pending in reads:
                if read is not None and pending is not None:
                    read = read._replace(payload_digest=pending.result())
                hits.append(self._check(read))
            return hits

    def _digester(self) -> ThreadPoolExecutor:
        """The thread that hashes batch reads' payloads, started on first use."""
        if self._digest_pool is None:
            with self._lock:
                if self._digest_pool is None:
                    self._digest_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-digest")
        return self._digest_pool

    def _read(
        self, key: ObjectKey, out: memoryview, layout: str, *, hash_blocks: bool = True
    ) -> _Read | None:
        """The I/O half of a read: the object's header and payload (into `out`), None on a miss
        that needs no check (not indexed, gone, unreadable: counted here). With `hash_blocks`
        the payload is hashed block by block as it lands; without, the digest is left to the
        caller (`payload_digest` None)."""
        with self._lock:
            known = key in self._index
        if not known:
            self._counters.settle(None, 0)
            return None
        text = key.to_str()
        _, path = self._path(key, text)
        n = len(out)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # evicted or deleted since the index lookup
            self._counters.settle(None, 0)
            return None
        except OSError as exc:
            self._read_error(key, exc)
            return None
        try:
            st = os.fstat(fd)
            total = st.st_size
            # the payload starts page-aligned (fmt.ALIGNED); files from before that have none
            expected_header = fmt.header_size(text, layout, aligned=True)
            if total != expected_header + n:
                expected_header = fmt.header_size(text, layout)
            header: fmt.Header | None = None
            payload_digest: bytes | None = None
            stored: bytearray | None = None
            if total == expected_header + n:
                head = bytearray(expected_header)
                if not hash_blocks:
                    if os.preadv(fd, [head, out], 0) == total:
                        header = fmt.decode_split_header(head, out)
                elif os.preadv(fd, [head], 0) == expected_header:

                    def fill(block: memoryview, offset: int) -> None:
                        if os.preadv(fd, [block], expected_header + offset) != len(block):
                            raise _Truncated

                    try:
                        payload_digest = fmt.read_hashed(out, fill)
                        header = fmt.decode_split_header(head, out)
                    except _Truncated:  # shrank since fstat: corrupt or being replaced
                        header = None
            else:  # not plain: read the header to tell a coded object, a mismatch, corruption
                header = fmt.decode_header(os.pread(fd, fmt.FIXED_SIZE + 2 * fmt.MAX_TEXT, 0))
                if fmt.judge(header, text, layout, n, total) is fmt.Verdict.CODED:
                    assert header is not None
                    stored = bytearray(header.payload_len)
                    if os.preadv(fd, [stored], header.size) != len(stored):
                        header, stored = None, None  # shrank since fstat
        except OSError as exc:
            self._read_error(key, exc)
            return None
        finally:
            os.close(fd)
        return _Read(key, text, layout, out, header, total, path, st, payload_digest, stored)

    def _check(self, read: _Read | None) -> fmt.Hit:
        """The checking half of a read: verdict, digest, counters; a corrupt file is deleted."""
        if read is None:
            return fmt.Hit.MISS
        if read.stored is not None and read.header is not None:
            verdict = self._codec.decode_into(read.header, memoryview(read.stored), read.out)
        else:
            verdict = fmt.verify(
                read.header, read.text, read.layout, read.out, read.total, read.payload_digest
            )
        hit = self._counters.settle(verdict, len(read.out))
        if hit:
            with self._lock:
                if read.key in self._index:
                    self._index.move_to_end(read.key)
            if time.time_ns() - read.st.st_mtime_ns > _TOUCH_NS:
                with contextlib.suppress(OSError):
                    os.utime(read.path)  # keeps the LRU order across restarts
        elif verdict is fmt.Verdict.CORRUPT:
            with self._lock:
                self._discard_corrupt(read.key, read.path, read.st)
        return hit

    def _read_error(self, key: ObjectKey, exc: OSError) -> None:
        self._counters.failed("read", f"disk tier: cannot read {key}: {exc}")
        self._counters.settle(None, 0)

    def _discard_corrupt(self, key: ObjectKey, path: str, st: os.stat_result) -> None:
        """Delete a corrupt file unless a newer one replaced it meanwhile. Caller holds the lock."""
        self._counters.warn("corrupt", f"disk tier: deleting corrupt object {path}")
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            return
        try:
            os.unlink(path)
        except OSError as exc:
            self._counters.failed("delete", f"disk tier: cannot delete corrupt {path}: {exc}")
            return
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size
            self._observer.removed((key.chunk,), self.name, Removal.CORRUPT)

    # -- index verbs ---------------------------------------------------------------------------

    def contains(self, key: ObjectKey) -> bool:
        """Whether the index holds `key` (the file's content is checked only on read)."""
        with self._lock:
            return key in self._index

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """`contains` for several keys under one lock acquisition."""
        with self._lock:
            return [key in self._index for key in keys]

    def delete(self, key: ObjectKey) -> bool:
        """Remove the object's file and index entry; True when it was indexed."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is None:
                return False
            self._used -= size
            self._unlink(key)
            self._observer.removed((key.chunk,), self.name, Removal.DELETED)
            return True

    def clear(self, *, model: str | None = None, cache_salt: str | None = None) -> int:
        """Remove every indexed object of `model` and/or `cache_salt` (all when both are None)."""
        with self._lock:
            doomed = [
                k
                for k in self._index
                if (model is None or k.model == model)
                and (cache_salt is None or k.cache_salt == cache_salt)
            ]
            for key in doomed:
                self._used -= self._index.pop(key)
                self._unlink(key)
            if doomed:
                chunks = list(dict.fromkeys(key.chunk for key in doomed))
                self._observer.removed(chunks, self.name, Removal.CLEARED)
            return len(doomed)

    def _unlink(self, key: ObjectKey) -> None:
        try:
            os.unlink(self._path(key)[1])
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._counters.failed("delete", f"disk tier: cannot delete {key}: {exc}")

    def stats(self) -> TierStats:
        """Counters, plus what the index holds and the configured capacity (0 = unbounded);
        `extra["effective_capacity"]` is the capacity in force (lower while the disk is full)."""
        with self._lock:
            objects, used, effective = len(self._index), self._used, self._effective
        return self._counters.snapshot(
            name=self.name,
            kind=self.kind,
            url=f"disk://{self.root}",
            objects=objects,
            used_bytes=used,
            capacity_bytes=self.capacity_bytes,
            extra={"effective_capacity": effective},
            codec=self._codec.stats(),
        )

    def close(self) -> None:
        """Stop the digest thread (the tier holds no file open between calls)."""
        pool, self._digest_pool = self._digest_pool, None
        if pool is not None:
            pool.shutdown(wait=True)

"""The disk tier's folder and index: where each object's file is, what the folder holds at
start, the LRU index and its capacity (following the filesystem's free space), and the verbs
that only touch the index: contains, delete, clear, stats (see `kvtier.storage.tiers.disk`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from kvtier.keys import ChunkKey, ObjectKey
from kvtier.storage.observers import NO_OBSERVER, Removal, StorageObserver
from kvtier.storage.tiers import files
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.accounting import TierCounters
from kvtier.storage.tiers.base import TierStats
from kvtier.storage.tiers.codecs import TierCodec

logger = logging.getLogger(__name__)

MAX_NAME = 200  # file names longer than this are hashed (most filesystems allow 255 bytes)
_EXTRA = ("evictions", "stale_temps_removed", "unchanged", "disk_full")
_FREE_CHECK_S = 1.0  # statvfs at most this often
_REBUILD_REPORT_S = 5.0  # a start that indexes a big folder says how far it got this often


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


class DiskIndex:
    """The index of an L2 tier of files under `path`, at most `capacity_bytes` in all
    (0 = unbounded); its reads and writes are subclasses (see `DiskTier`)."""

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

    def _digester(self) -> ThreadPoolExecutor:
        """The thread that hashes batch reads' payloads, started on first use."""
        if self._digest_pool is None:
            with self._lock:
                if self._digest_pool is None:
                    self._digest_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-digest")
        return self._digest_pool

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

"""The local-disk L2 tier: one file per object in a folder, with its own byte capacity and LRU.

Layout: `<root>/<first 2 hex chars of the chunk hash>/<key.to_str()>` (a 256-way shard keeps
folders small). A name longer than `MAX_NAME` is replaced by "h-" + the xxh3-128 hex of the key
text; the key is recovered from the file's header on restart.

Writes are atomic: the object goes to `.tmp.<random>` in the destination folder and is renamed
onto its real name, so a crash never leaves half an object under a real name; stale temp files
are removed at startup. fsync is off by default: this is a cache, so losing the last writes in a
power cut costs only misses, and a torn file that survives one is caught by the header digest
and deleted on read. `fsync=True` adds a file and folder fsync per write for a durable cache.

Replacing a file by renaming onto it makes ext4 (auto_da_alloc) start writeback of the new file
at once, which doubled the cost of a rewrite; so a rewrite swaps the two names atomically with
renameat2(RENAME_EXCHANGE) where Linux offers it and then unlinks the old file under the temp
name. A rewrite whose object is already stored intact (same header, payload digest checked) is
skipped and counted as `unchanged`.

The index (key -> file size, in LRU order) lives in memory and is rebuilt from the folder at
startup, ordered by file mtime; a read refreshes an mtime older than a second so the rebuilt
order follows reads too. One lock guards the index; file data is read and written outside it.
Only metadata operations (rename, unlink) run under it, so an eviction can never remove a newer
file that a concurrent put renamed onto the same name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import xxhash
from typing_extensions import Buffer

from kvtier.config import parse_size
from kvtier.keys import ObjectKey
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.base import TierStats

logger = logging.getLogger(__name__)

MAX_NAME = 200  # file names longer than this are hashed (most filesystems allow 255 bytes)
TEMP_PREFIX = ".tmp."
DEFAULT_CAPACITY = 10 << 30  # for a URL without ?size=
_COUNTERS = (
    "hits",
    "misses",
    "corrupt",
    "errors",
    "evictions",
    "layout_mismatches",
    "size_mismatches",
    "puts",
    "bytes_written",
    "bytes_read",
    "stale_temps_removed",
    "unchanged",
)
_TOUCH_NS = 1_000_000_000  # a read refreshes an mtime older than this (one metadata write less)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _load_renameat2() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a libc older than glibc 2.28
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_renameat2 = _load_renameat2()


def _exchange(a: str, b: str) -> bool:
    """Atomically swap the files named `a` and `b`; False when unsupported or `b` is gone."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _byte_view(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _write_all(fd: int, parts: list[memoryview]) -> None:
    """os.writev until every byte of `parts` is written (writev may write less)."""
    while parts:
        done = os.writev(fd, parts)
        while parts and done >= len(parts[0]):
            done -= len(parts[0])
            parts.pop(0)
        if parts and done:
            parts[0] = parts[0][done:]


class DiskTier:
    """An L2 tier of files under `path`, at most `capacity_bytes` in all (0 = unbounded)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        fsync: bool = False,
        name: str = "disk",
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (0 = unbounded), got {capacity_bytes}")
        self.name = name
        self.root = Path(path).expanduser().resolve()
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[ObjectKey, int] = OrderedDict()
        self._used = 0
        self._shards: set[str] = set()
        self._n: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._rebuild()

    @classmethod
    def from_url(cls, url: str) -> DiskTier:
        """A tier from "disk:///abs/path?size=50GiB&fsync=1" or "disk://relative/path".

        In "disk://relative/path" everything after "//" is a path relative to the current
        working directory when the tier is opened; "disk:///abs" (three slashes) is absolute and
        "disk://~/x" is under the home folder. `size` defaults to 10GiB; "0" means unbounded.
        """
        parts = urlsplit(url)
        if parts.scheme.lower() != "disk":
            raise ValueError(f"not a disk tier URL: {url!r}")
        path = parts.netloc + parts.path
        if not path:
            raise ValueError(f"disk tier URL without a path: {url!r}")
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        unknown = set(query) - {"size", "fsync"}
        if unknown:
            raise ValueError(f"unknown disk tier URL options {sorted(unknown)} in {url!r}")
        size = parse_size(query["size"]) if "size" in query else DEFAULT_CAPACITY
        fsync = query.get("fsync", "0").lower() in ("1", "true", "yes", "on")
        return cls(os.path.abspath(os.path.expanduser(path)), size, fsync=fsync)

    # -- naming --------------------------------------------------------------------------------

    def _path(self, key: ObjectKey, text: str | None = None) -> tuple[str, str]:
        """(shard folder, file path) of `key`."""
        text = key.to_str() if text is None else text
        shard = (key.chunk_hash.hex() + "00")[:2]
        name = text if len(text) <= MAX_NAME else "h-" + xxhash.xxh3_128_hexdigest(text.encode())
        folder = os.path.join(self.root, shard)
        return folder, os.path.join(folder, name)

    def _ensure_folder(self, folder: str) -> None:
        if folder not in self._shards:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            self._shards.add(folder)

    # -- startup -------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index every object file under the root (LRU by mtime); remove stale temp files."""
        found: list[tuple[int, ObjectKey, int]] = []
        for shard in os.scandir(self.root):
            if shard.name.startswith(TEMP_PREFIX):
                self._remove_temp(shard.path)
            if not shard.is_dir(follow_symlinks=False) or len(shard.name) != 2:
                continue
            self._shards.add(shard.path)
            for entry in os.scandir(shard.path):
                if entry.name.startswith(TEMP_PREFIX):
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
        found.sort(key=lambda t: t[0])
        for _, key, size in found:
            self._index[key] = size
            self._used += size
        with self._lock:
            self._make_room(0)

    def _remove_temp(self, path: str) -> None:
        try:
            os.unlink(path)
            self._n["stale_temps_removed"] += 1
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
        """Evict least-recently-used objects until `size` more bytes fit. Caller holds the lock."""
        if not self.capacity_bytes:
            return
        while self._index and self._used + size > self.capacity_bytes:
            key, old = self._index.popitem(last=False)
            self._used -= old
            self._n["evictions"] += 1
            self._unlink(key)

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: ObjectKey, data: Buffer, layout: str) -> None:
        """Write atomically (temp file + rename); raises OSError when the disk write fails."""
        view = _byte_view(data)
        text = key.to_str()
        header = fmt.encode_header(text, layout, view)
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
                self._n["puts"] += 1
                self._n["unchanged"] += 1
            return
        with self._lock:
            self._make_room(size)
            self._used += size  # reserved until the rename (or failure) settles it
        tmp = os.path.join(folder, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        try:
            self._ensure_folder(folder)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, [memoryview(header), view])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                # the old file, if any, ends up under the temp name
                swapped = key in self._index and not self.fsync and _exchange(tmp, final)
                if not swapped:
                    os.rename(tmp, final)
                old = self._index.pop(key, None)
                if old is not None:
                    self._used -= old
                self._index[key] = size
                self._n["puts"] += 1
                self._n["bytes_written"] += size
        except BaseException:
            with self._lock:
                self._used -= size
                self._n["errors"] += 1
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if swapped:
            try:
                os.unlink(tmp)
            except OSError as exc:  # removed as a stale temp file at the next start
                logger.warning("disk tier: cannot remove replaced file %s: %s", tmp, exc)
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

    def put_many(self, items: Sequence[tuple[ObjectKey, Buffer, str]]) -> int:
        """`put` each item; a failed one is logged and counted in `errors`, not raised."""
        written = 0
        for key, data, layout in items:
            try:
                self.put(key, data, layout)
                written += 1
            except (OSError, ValueError) as exc:
                logger.warning("disk tier: cannot write %s: %s", key, exc)
        return written

    # -- reads ---------------------------------------------------------------------------------

    def get_into(self, key: ObjectKey, out: memoryview, layout: str) -> bool:
        """Read the payload straight into `out` (one preadv with the header; no extra copy)."""
        out = _byte_view(out)
        with self._lock:
            known = key in self._index
            if not known:
                self._n["misses"] += 1
        if not known:
            return False
        text = key.to_str()
        _, path = self._path(key, text)
        n = len(out)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # evicted or deleted since the index lookup
            with self._lock:
                self._n["misses"] += 1
            return False
        except OSError as exc:
            return self._read_error(key, exc)
        try:
            st = os.fstat(fd)
            total = st.st_size
            expected_header = fmt.header_size(text, layout)
            if total == expected_header + n:
                head = bytearray(expected_header)
                got = os.preadv(fd, [head, out], 0)
                header = fmt.decode_header(head) if got == total else None
                if header is None and got == total:  # maybe a longer header of another layout
                    header = fmt.decode_header(os.pread(fd, fmt.FIXED_SIZE + 2 * fmt.MAX_TEXT, 0))
            else:  # cannot be a hit; read the header alone to tell a mismatch from corruption
                header = fmt.decode_header(os.pread(fd, fmt.FIXED_SIZE + 2 * fmt.MAX_TEXT, 0))
            verdict = fmt.judge(header, text, layout, n, total)
            if verdict is fmt.Verdict.OK:
                assert header is not None
                if fmt.digest(out) != header.digest:
                    verdict = fmt.Verdict.CORRUPT
                elif time.time_ns() - st.st_mtime_ns > _TOUCH_NS:
                    os.utime(fd)  # keeps the LRU order across restarts
        except OSError as exc:
            return self._read_error(key, exc)
        finally:
            os.close(fd)
        with self._lock:
            if verdict is fmt.Verdict.OK:
                if key in self._index:
                    self._index.move_to_end(key)
                self._n["hits"] += 1
                self._n["bytes_read"] += n
                return True
            self._n["misses"] += 1
            if verdict is fmt.Verdict.LAYOUT_MISMATCH:
                self._n["layout_mismatches"] += 1
            elif verdict is fmt.Verdict.SIZE_MISMATCH:
                self._n["size_mismatches"] += 1
            else:
                self._discard_corrupt(key, path, st)
        return False

    def _read_error(self, key: ObjectKey, exc: OSError) -> bool:
        logger.warning("disk tier: cannot read %s: %s", key, exc)
        with self._lock:
            self._n["errors"] += 1
            self._n["misses"] += 1
        return False

    def _discard_corrupt(self, key: ObjectKey, path: str, st: os.stat_result) -> None:
        """Delete a corrupt file unless a newer one replaced it meanwhile. Caller holds the lock."""
        self._n["corrupt"] += 1
        logger.warning("disk tier: deleting corrupt object %s", path)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            return
        try:
            os.unlink(path)
        except OSError as exc:
            self._n["errors"] += 1
            logger.warning("disk tier: cannot delete corrupt object %s: %s", path, exc)
            return
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[bool]:
        """`get_into` for each item, in order."""
        return [self.get_into(key, out, layout) for key, out, layout in items]

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
            return len(doomed)

    def _unlink(self, key: ObjectKey) -> None:
        try:
            os.unlink(self._path(key)[1])
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._n["errors"] += 1
            logger.warning("disk tier: cannot delete %s: %s", key, exc)

    def stats(self) -> TierStats:
        """Counters plus used_bytes, capacity_bytes (0 = unbounded), objects and path."""
        with self._lock:
            out: TierStats = dict(self._n)
            out.update(
                used_bytes=self._used,
                capacity_bytes=self.capacity_bytes,
                objects=len(self._index),
                path=str(self.root),
            )
            return out

    def close(self) -> None:
        """Nothing to release: the tier holds no file open between calls."""

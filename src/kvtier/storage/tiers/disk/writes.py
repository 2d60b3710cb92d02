"""The disk tier's writes: atomic (temp file + rename or name swap), skipped when the object is
stored intact already, retried once after a full filesystem shrank the capacity."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Collection, Sequence
from concurrent.futures import Future

from typing_extensions import Buffer

from kvtier.keys import ObjectKey
from kvtier.storage.tiers import files
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.codecs import Prepared
from kvtier.storage.tiers.disk.index import DiskIndex

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskWrites(DiskIndex):
    """`put` and `put_many` (see `DiskTier`)."""

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

"""The disk tier's reads: the payload straight into the caller's buffer, its digest checked
(on the digest thread for a batch's large objects), a corrupt file deleted."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import NamedTuple

from kvtier.keys import ObjectKey
from kvtier.storage.observers import Removal
from kvtier.storage.tiers import format as fmt
from kvtier.storage.tiers.disk.index import DiskIndex

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


class DiskReads(DiskIndex):
    """`get_into` and `get_many_into` (see `DiskTier`)."""

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

"""The shared-memory arena clients read and write KV bytes in (its ranges: `storage.allocator`).

The server creates one segment under /dev/shm and hands out offsets; engine processes attach the
same segment and copy KV bytes in and out themselves, so the server never touches them. The
segment is a plain tmpfs file mapped with mmap: `multiprocessing.shared_memory` is avoided because
on Python 3.11 its resource tracker unlinks a segment when any attaching process exits.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import secrets
from types import TracebackType

import numpy as np

from kvtier.errors import KVTierError

__all__ = [
    "PAGE_SIZE",
    "SHM_DIR",
    "Arena",
    "ArenaInUseError",
    "default_arena_name",
    "remove_dead_segments",
]

log = logging.getLogger(__name__)

PAGE_SIZE = mmap.PAGESIZE
SHM_DIR = "/dev/shm"


class ArenaInUseError(KVTierError):
    """A live server already owns the shared-memory segment this server wanted to create."""


def default_arena_name(address: str) -> str:
    """The segment name a server bound to `address` uses: per user, stable across restarts."""
    digest = hashlib.blake2b(address.encode(), digest_size=6).hexdigest()
    return f"kvtier-{os.getuid()}-{digest}"


def _round_up(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _segment_path(name: str) -> str:
    if not name or "/" in name or name.startswith(".") or "\0" in name:
        raise ValueError(f"arena name {name!r} must be a non-empty file name without '/'")
    return os.path.join(SHM_DIR, name)


class Arena:
    """A shared-memory segment mapped read-write: the server's (`create`) or a client's (`attach`).

    Offset 0 is page aligned, so page-aligned offsets from the allocator
    (`kvtier.storage.allocator`) are page aligned in memory.
    """

    def __init__(self, name: str, path: str, size: int, mm: mmap.mmap, lock_fd: int | None) -> None:
        """Use `create` or `attach`; `lock_fd` is the creator's locked descriptor, else None."""
        self.name = name
        self.path = path
        self.size = size
        self._mmap: mmap.mmap | None = mm
        self._lock_fd = lock_fd
        self.buffer: memoryview = memoryview(mm)

    @classmethod
    def create(cls, name: str, size: int, *, prefault: bool = True) -> Arena:
        """Create segment `name` of `size` bytes (rounded up to pages), owner-only, and lock it.

        A leftover segment of a dead server is replaced; one whose owner is alive raises
        ArenaInUseError. With `prefault`, every page is allocated and mapped before returning,
        so a full /dev/shm fails here (OSError ENOSPC) rather than with SIGBUS on first write.
        """
        path = _segment_path(name)
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size} (see --l1-size)")
        size = _round_up(size, PAGE_SIZE)
        _remove_if_stale(path)  # fail fast on a live owner, before paying for the pages
        remove_dead_segments()  # what crashed or killed servers of this user left behind
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        mm: mmap.mmap | None = None
        try:
            try:
                os.fchmod(fd, 0o600)  # the umask may only have narrowed it; make it exact
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                mm = _size_and_map(fd, size, prefault)
                # Publish under the real name only once sized and locked: link() fails if the
                # name exists, so no other process can see this segment unlocked or short.
                for _ in range(3):
                    try:
                        os.link(tmp, path)
                        break
                    except FileExistsError:
                        _remove_if_stale(path)
                else:
                    raise ArenaInUseError(f"could not claim shared-memory segment {path!r}")
            finally:
                os.unlink(tmp)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            raise
        return cls(name, path, size, mm, fd)

    @classmethod
    def attach(cls, name: str, size: int) -> Arena:
        """Map an existing segment read-write (a client's view); takes no lock."""
        path = _segment_path(name)
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        size = _round_up(size, PAGE_SIZE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT,
                f"no kvtier arena {path!r}: is `kvtier serve` running on this machine"
                " with the same address and arena name?",
                path,
            ) from None
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(
                    f"arena {path!r} holds {actual} bytes but {size} were asked for: the client"
                    " and server disagree on the arena size (--l1-size)"
                )
            # MAP_POPULATE maps every (already allocated) page into this process now: without
            # it each first touch of a 4 KiB page costs a minor fault, which capped stores at a
            # fifth of memcpy speed.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)  # the mapping keeps the segment alive on its own
        return cls(name, path, size, mm, None)

    def view(self, offset: int, size: int) -> memoryview:
        """A writable memoryview of [offset, offset + size); ValueError when out of bounds."""
        self._check(offset, size)
        return self.buffer[offset : offset + size]

    def ndarray(self, offset: int, size: int) -> np.ndarray:
        """A writable uint8 array over [offset, offset + size), sharing memory with the arena."""
        self._check(offset, size)
        return np.frombuffer(self.buffer, dtype=np.uint8, count=size, offset=offset)

    def _check(self, offset: int, size: int) -> None:
        if self._mmap is None:
            raise ValueError(f"arena {self.name!r} is closed")
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(
                f"range [{offset}, {offset + size}) is outside arena {self.name!r}"
                f" of {self.size} bytes"
            )

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Unmap (the creator also unlinks the segment and drops its lock); idempotent.

        Views or arrays still alive keep their pages mapped until they are garbage collected,
        so closing never invalidates memory under a live view.
        """
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        self.buffer.release()
        try:
            mm.close()
        except BufferError:
            log.debug("arena %s: views still alive, unmapping when they are released", self.name)
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            try:
                if _same_file(fd, self.path):
                    os.unlink(self.path)
            finally:
                os.close(fd)  # releases the lock only after the name is gone

    def __enter__(self) -> Arena:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self._lock_fd is not None else "attached"
        state = "closed" if self._mmap is None else role
        return f"Arena({self.name!r}, size={self.size}, {state})"


def _size_and_map(fd: int, size: int, prefault: bool) -> mmap.mmap:
    """Size the segment and map it, allocating and faulting in every page when `prefault`."""
    if not prefault:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    # Measured for 256 MiB on the dev machine: a numpy strided write of one byte per page took
    # 280 ms; posix_fallocate + MAP_POPULATE took 250 ms and left the mapping as fully faulted as
    # the strided write (a later strided rewrite costs 1.3 ms after either, 4.5 ms after
    # MAP_POPULATE alone), and fallocate reports a full /dev/shm as ENOSPC here instead of SIGBUS.
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)
    populate = getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
    if not populate:
        np.frombuffer(mm, dtype=np.uint8)[::PAGE_SIZE] = 0
    return mm


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_dead_segments(shm_dir: str | None = None) -> list[str]:
    """Unlink this user's kvtier segments whose server is dead; the paths removed.

    A segment is `kvtier-<uid>-...` (published) or `kvtier-<uid>-....<pid>.<hex>.tmp` (being
    sized). Its creator holds an exclusive flock on it from before it is sized until after it
    is unlinked, so a segment whose lock can be taken has no live creator. A temporary one is
    also left alone while the pid in its name runs: its creator may not have locked it yet.
    Nothing else in the folder (another user's, another program's) is ever touched.
    """
    folder = shm_dir or SHM_DIR
    prefix = f"kvtier-{os.getuid()}-"
    removed: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not name.startswith(prefix):
            continue
        if name.endswith(".tmp"):
            parts = name.rsplit(".", 3)
            if len(parts) != 4 or not parts[1].isdigit() or _pid_alive(int(parts[1])):
                continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live server's
            if _same_file(fd, entry.path):
                os.unlink(entry.path)
                removed.append(entry.path)
                log.warning("removed shared-memory segment %s left by a dead server", entry.path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _remove_if_stale(path: str) -> None:
    """Unlink the segment at `path` when no live creator holds its lock; else ArenaInUseError."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArenaInUseError(
                f"shared-memory segment {path!r} belongs to a running kvtier server: stop it,"
                " or serve on another address / arena name"
            ) from None
        # Locked: its creator is dead. Check the name still points at what we locked, in case a
        # concurrent creator already replaced it.
        if _same_file(fd, path):
            os.unlink(path)
            log.warning("removed stale shared-memory segment %s left by a dead server", path)
    finally:
        os.close(fd)

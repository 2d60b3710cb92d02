"""Fencing: knowing when a client can no longer touch the arena slots it was granted.

A same-host client copies bytes into and out of the shared-memory arena itself, so the server
cannot take a slot back by refusing a request: a client that was paused (SIGSTOP, swapped out,
a debugger) past its lease would write into, or read from, a slot that now holds another chunk.
So a lapsed slot is *quarantined*: it stays allocated, invisible and unevictable, until its
owner can no longer touch it, which the server knows in exactly two ways:

- the owner acknowledges (Commit, Abort or RetrieveDone answer LEASE_EXPIRED and free it), or
- the owner's process is gone. The server learns the process from the connection, never from
  what the client says: over ipc:// the kernel's peer credential (SO_PEERCRED) names the
  process that connected; over tcp:// nothing does, so no tcp client is ever watched. It opens
  a pidfd on that process (`os.pidfd_open`), which becomes readable when the process exits and,
  unlike a pid, can never come to mean another process.

A client without a watchable process (tcp, another machine, another pid namespace, a kernel
without pidfds) is never granted slots: it moves bytes inline, through the server, which copies
them under its lock.

`ProcessWatches` holds one pidfd per process, shared by every client of that process, and at
most `--max-watched-processes` (and never more than a quarter of the descriptor limit): what a
flood of Hellos can make the server hold is bounded, and running out of descriptors refuses the
Hello with NO_SPACE instead of leaving libzmq without one (it aborts the process then).
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import select
from typing import Protocol

import msgspec

from kvtier.errors import NoSpaceError

__all__ = [
    "CopyGuard",
    "FencingStats",
    "ProcessWatch",
    "ProcessWatches",
    "Watch",
    "watch_process",
]


class FencingStats(msgspec.Struct, frozen=True, kw_only=True):
    """The quarantine at one instant, for status and metrics."""

    lapsed: int  # reservations and retrieve leases waiting for their owner to ack or exit
    fenced_slots: int  # staging slots quarantined (allocated, in no chunk)
    fenced_bytes: int
    lease_expired: int  # commits and retrieve-dones answered LEASE_EXPIRED since start


class Watch(Protocol):
    """Whoever may touch a reservation's or lease's slots: alive while it still may."""

    def alive(self) -> bool: ...

    def retain(self) -> Watch: ...

    def release(self) -> None: ...


class CopyGuard:
    """The server's own copy into or out of slots (inline clients), outside its lock: the
    slots are fenced, should their lease lapse meanwhile, until `finish`."""

    __slots__ = ("_copying",)

    def __init__(self) -> None:
        self._copying = True

    def alive(self) -> bool:
        return self._copying

    def finish(self) -> None:
        self._copying = False

    def retain(self) -> CopyGuard:
        return self

    def release(self) -> None:
        pass


class ProcessWatch:
    """A pidfd on one client process; shared (reference-counted) by everything that needs it."""

    __slots__ = ("_fd", "_home", "pid", "refs")

    def __init__(self, pid: int, fd: int, home: dict[int, ProcessWatch] | None = None) -> None:
        self.pid = pid
        self._fd = fd
        self.refs = 1
        self._home = home  # the ProcessWatches table that shares it, left at the last release

    def alive(self) -> bool:
        """False once the process has exited (or the watch was closed)."""
        if self._fd < 0:
            return False
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return not poller.poll(0)

    def retain(self) -> ProcessWatch:
        self.refs += 1
        return self

    def release(self) -> None:
        """Drop one reference; the pidfd is closed with the last one."""
        self.refs -= 1
        if self.refs <= 0 and self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
            if self._home is not None and self._home.get(self.pid) is self:
                del self._home[self.pid]


def watch_process(pid: int) -> ProcessWatch | None:
    """A watch on `pid` in this server's pid namespace; None when it cannot be watched (no such
    process, no pidfd support): such a client is not granted arena slots."""
    if pid <= 0 or not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    return ProcessWatch(pid, fd)


#: descriptors a pidfd may never take: the rest of the limit is for connections, files, libzmq
_FD_SHARE = 4


class ProcessWatches:
    """One shared pidfd per watched process, at most `limit` of them (and at most a quarter of
    RLIMIT_NOFILE, read at each new watch, so a lowered limit is honoured). Not thread-safe:
    the engine lock guards it, as it guards the lease book that holds the watches."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_pid: dict[int, ProcessWatch] = {}

    def __len__(self) -> int:
        return len(self._by_pid)

    def _room(self) -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.limit
        return min(self.limit, soft // _FD_SHARE)

    def watch(self, pid: int) -> ProcessWatch | None:
        """A (retained) watch on `pid`; None when it cannot be watched (no such process, no
        pidfd support). NoSpaceError when the server may not hold another descriptor."""
        if pid <= 0 or not hasattr(os, "pidfd_open"):
            return None
        known = self._by_pid.get(pid)
        if known is not None:
            if known.alive():
                return known.retain()
            del self._by_pid[pid]  # that process exited; the pid now names another one
        if len(self._by_pid) >= self._room():
            raise NoSpaceError(
                f"the server watches {len(self._by_pid)} client processes already, its most "
                f"(--max-watched-processes {self.limit}, at most a quarter of its descriptor "
                "limit, ulimit -n): close idle clients, or raise the limits"
            )
        try:
            fd = os.pidfd_open(pid)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise NoSpaceError(
                    f"the server is out of file descriptors ({os.strerror(exc.errno)}) and "
                    "cannot watch another client process: raise its `ulimit -n`, or lower "
                    "--max-watched-processes"
                ) from None
            return None
        watch = self._by_pid[pid] = ProcessWatch(pid, fd, self._by_pid)
        return watch

"""Fencing: knowing when a client can no longer touch the arena slots it was granted.

A same-host client copies bytes into and out of the shared-memory arena itself, so the server
cannot take a slot back by refusing a request: a client that was paused (SIGSTOP, swapped out,
a debugger) past its lease would write into, or read from, a slot that now holds another chunk.
So a lapsed slot is *quarantined*: it stays allocated, invisible and unevictable, until its
owner can no longer touch it, which the server knows in exactly two ways:

- the owner acknowledges (Commit, Abort or RetrieveDone answer LEASE_EXPIRED and free it), or
- the owner's process is gone. The client names its pid at Hello; the server opens a pidfd on
  it (`os.pidfd_open`), which becomes readable when that process exits and, unlike a pid, can
  never come to mean another process.

A client without a watchable process (another machine, another pid namespace, a kernel without
pidfds) is never granted slots: it moves bytes inline, through the server, which copies them
under its lock.
"""

from __future__ import annotations

import contextlib
import os
import select
from typing import Protocol

import msgspec

__all__ = ["CopyGuard", "FencingStats", "ProcessWatch", "Watch", "watch_process"]


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

    __slots__ = ("_fd", "pid", "refs")

    def __init__(self, pid: int, fd: int) -> None:
        self.pid = pid
        self._fd = fd
        self.refs = 1

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

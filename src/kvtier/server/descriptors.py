"""File descriptors, budgeted across every listening socket, so that no socket's peers can take
the descriptors another needs.

Every connection is a descriptor, and libzmq aborts the whole process (SIGABRT) when an
ipc:// accept finds none left (`EMFILE`): the data socket's engines must always find one. So:

- at start the server raises its soft `ulimit -n` to the hard limit (`raise_limit`);
- `DescriptorBudget.plan` splits what is left after the descriptors in use and a reserve for
  the engines (ipc connections, pidfds, files the tiers open) among the sockets anyone can
  connect to: the admin API (`--max-admin-connections`), each KV events socket
  (`--kv-events-max-connections`) and the tcp:// data addresses (half of the rest: the other
  half is a margin for a burst of accepts the guard has not shut down yet), shrinking those
  caps (and saying so) when the limit is too small for them;
- the admin API closes a connection past its cap as soon as it is accepted (see
  `server/observe/admin.py`); a ZMQ socket's tcp connections are counted by the socket's monitor
  in `ConnectionGuard`'s thread, which shuts down each one past the socket's cap the moment it
  is accepted (libzmq then closes it).

A raw tcp connection that never completes ZMQ's greeting is dropped by libzmq after
`HANDSHAKE_S` (ZMQ_HANDSHAKE_IVL), so idle connections do not hold a cap for long either.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = [
    "HANDSHAKE_S",
    "ConnectionGuard",
    "DescriptorBudget",
    "descriptors_in_use",
    "raise_limit",
]

logger = logging.getLogger(__name__)

#: seconds a tcp peer of a ZMQ socket has to complete the ZMTP greeting (ZMQ_HANDSHAKE_IVL)
HANDSHAKE_S = 10.0
#: descriptors always kept for the engines and the server itself (ipc connections, pidfds,
#: tier files, the transient accepts of a listen backlog): at least this, half of a small limit
#: (up to 2048), a quarter of a large one
MIN_RESERVE = 256
_POLL_MS = 200


def raise_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit, as servers do; the soft limit now."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def descriptors_in_use() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


@dataclass(frozen=True, slots=True)
class DescriptorBudget:
    """How many connections each listening socket may hold at once (see the module doc)."""

    limit: int  # the soft RLIMIT_NOFILE
    reserved: int  # kept for the engines and the server itself
    admin: int  # admin API connections
    events: int  # connections per KV events socket (PUB, replay)
    tcp_data: int  # tcp:// connections to the data socket, all its tcp addresses together
    shrunk: bool = False  # the configured caps did not fit and were scaled down

    @classmethod
    def plan(
        cls,
        limit: int,
        in_use: int,
        *,
        admin: int,
        events: int,
        events_sockets: int,
    ) -> DescriptorBudget:
        """Caps for a process with `limit` descriptors, `in_use` open now, whose admin API may
        hold `admin` connections and each of its `events_sockets` KV events sockets `events`."""
        reserved = max(MIN_RESERVE, limit // 4, min(limit // 2, 2048))
        room = max(0, limit - in_use - reserved)
        wanted = admin + events * events_sockets
        shrunk = wanted > room // 2  # the tcp data connections keep at least half the room
        if shrunk:
            scale = (room // 2) / max(1, wanted)
            admin = max(1, int(admin * scale))
            events = max(1, int(events * scale))
        # the tcp data connections get half of what is left: the other half is the margin
        # for a burst of accepts that the guard has not shut down yet
        tcp_data = max(1, (room - admin - events * events_sockets) // 2)
        return cls(limit, reserved, admin, events, tcp_data, shrunk)


class _Capped:
    """One ZMQ socket whose tcp connections are counted and capped."""

    __slots__ = ("cap", "monitor", "name", "open", "ports", "refused", "socket")

    def __init__(self, sock: zmq.Socket[bytes], cap: int, name: str, ports: set[int]) -> None:
        self.socket = sock
        self.cap = cap
        self.name = name
        self.ports = ports
        self.open: set[int] = set()  # descriptors of its tcp connections now
        self.refused = 0
        self.monitor: zmq.Socket[bytes] = sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )


def _tcp_ports(sock: zmq.Socket[bytes], endpoints: Sequence[str]) -> set[int]:
    ports = set()
    for endpoint in endpoints:
        if endpoint.startswith("tcp://"):
            with contextlib.suppress(ValueError):
                ports.add(int(endpoint.rsplit(":", 1)[1]))
    return ports


def _shut(fd: int, ports: set[int]) -> bool:
    """Shut down (never close: libzmq owns it) the tcp connection on `fd`, if `fd` still is
    one accepted on one of `ports`; whether it was."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        if sock.getsockname()[1] not in ports:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


class ConnectionGuard:
    """A thread that holds each watched ZMQ socket to its cap of tcp connections."""

    def __init__(self) -> None:
        self._watched: list[_Capped] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, sock: zmq.Socket[bytes], cap: int, name: str, endpoints: Sequence[str]) -> None:
        """Cap the tcp connections `sock` accepted on `endpoints` (its bound addresses) at
        `cap`; ipc:// connections are not counted. Call before `start`."""
        ports = _tcp_ports(sock, endpoints)
        if not ports:
            return
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        self._watched.append(_Capped(sock, cap, name, ports))

    def start(self) -> None:
        if self._watched and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="kvtier-connection-guard", daemon=True
            )
            self._thread.start()

    def connections(self) -> dict[str, int]:
        """Tcp connections each watched socket holds now (for status and tests)."""
        with self._lock:
            return {w.name: len(w.open) for w in self._watched}

    def refused(self) -> dict[str, int]:
        with self._lock:
            return {w.name: w.refused for w in self._watched}

    def _run(self) -> None:
        poller = zmq.Poller()
        by_monitor = {}
        for w in self._watched:
            poller.register(w.monitor, zmq.POLLIN)
            by_monitor[w.monitor] = w
        while not self._stop.is_set():
            try:
                for monitor, _ in poller.poll(_POLL_MS):
                    self._drain(by_monitor[monitor])
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                logger.exception("connection guard: polling failed")
                self._stop.wait(0.1)

    def _drain(self, w: _Capped) -> None:
        while w.monitor.poll(0):
            event = recv_monitor_message(w.monitor, zmq.NOBLOCK)
            fd = int(event["value"])
            raw: Any = event["endpoint"]
            endpoint = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
            if not endpoint.startswith("tcp://"):
                continue
            with self._lock:
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    w.open.discard(fd)
                elif len(w.open) < w.cap:
                    w.open.add(fd)
                elif _shut(fd, w.ports):
                    w.refused += 1

    def close(self) -> None:
        """Stop the thread and close the monitors (before the watched sockets close)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * _POLL_MS / 1000 + 1)
            self._thread = None
        for w in self._watched:
            with contextlib.suppress(zmq.ZMQError):
                w.socket.disable_monitor()
            w.monitor.close(linger=0)
        self._watched.clear()

"""The connection under a `Client`: the socket pool, the handshake, heartbeats, the rejoin
after a server restart and the server's arena as mapped in this process.

Everything above it sends a protocol message with `Connection.call` and reads the reply; it
never sees a socket. Each call takes a ZMQ socket from a small pool and gives it back, all
under one client id, so TP workers in threads do not serialize on a lock, and threads that end
leave no socket behind.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt
import zmq

from kvtier import protocol as p
from kvtier.errors import (
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    KVTierError,
    NotConnectedError,
    NotRegisteredError,
    error_from_code,
)
from kvtier.hashing import TokenHasher
from kvtier.storage.arena import Arena

__all__ = ["Connection", "NoReply", "Transfer", "reply_as"]

logger = logging.getLogger(__name__)

Transfer = Literal["auto", "shm", "inline"]
R = TypeVar("R", bound=p.Reply)

_PROBE_TIMEOUT = 5.0  # how long a heartbeat waits before it calls the server unreachable
_GOODBYE_TIMEOUT = 0.5  # how long close() waits for the server to hear its goodbye
_CLOSE_WAIT_S = 2.0  # how long close() waits for woken calls to give their sockets back
_MAX_IDLE_SOCKETS = 32  # idle sockets kept for later calls; more are closed when given back


class NoReply(NotConnectedError):
    """No reply within the wait: the server is down, stalled or unreachable (or, for a call
    given `wait_s`, still busy with what the request waits on)."""


class _Forgotten(NotConnectedError):
    """The server answered "send Hello first": it restarted and no longer knows this client."""


def reply_as(reply: p.Reply, kind: type[R], request: str) -> R:
    """`reply` as the reply type `request` gets; InternalError (a kvtier error, so the engine
    adapters recompute) when the server answered with another."""
    if not isinstance(reply, kind):
        raise InternalError(
            f"{request} was answered with {type(reply).__name__}, not {kind.__name__}: the "
            "server at the other end does not speak this client's protocol"
        )
    return reply


def _encode(msg: Any) -> bytes:
    """The request header; a value msgpack cannot carry (an int past 64 bits, a string with
    lone surrogates) is the caller's error, raised as kvtier's typed error."""
    try:
        return p.encode(msg)
    except (TypeError, ValueError, OverflowError) as exc:  # UnicodeEncodeError is a ValueError
        raise InvalidArgumentError(f"{type(msg).__name__} cannot be sent: {exc}") from None


def _check_address(address: object) -> None:
    """A ZMQ address kvtier can connect to, or InvalidArgumentError naming the fix."""
    if not isinstance(address, str) or not address.startswith(("ipc://", "tcp://")):
        raise InvalidArgumentError(
            f"address {address!r} needs a scheme: ipc:///tmp/kvtier.sock or tcp://host:port "
            "(the --address the server was started with)"
        )


class _Conn:
    """One DEALER socket of the pool, and a poller that waits on it and on close()'s wake-up."""

    __slots__ = ("poller", "sock")

    def __init__(self, sock: zmq.Socket[bytes], wake_fd: int) -> None:
        self.sock = sock
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(wake_fd, zmq.POLLIN)


class Connection:
    """A live connection to one `kvtier serve`, thread-safe; `Client` builds its requests on it.

    On the server's machine it maps the server's shared-memory arena (`arena_bytes`), so KV
    bytes go straight between the caller's arrays and the arena; elsewhere they travel inline
    as ZMQ frames.
    """

    def __init__(
        self,
        address: str,
        *,
        hasher: TokenHasher | None,
        timeout: float,
        connect_timeout: float,
        transfer: Transfer,
        heartbeat_interval: float,
        client_id: str,
        token: str,
    ) -> None:
        if transfer not in ("auto", "shm", "inline"):
            raise InvalidArgumentError(
                f"transfer must be 'auto', 'shm' or 'inline', got {transfer!r}"
            )
        _check_address(address)
        for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if not value > 0:
                raise InvalidArgumentError(f"{name} must be > 0 seconds, got {value!r}")
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.hasher = hasher
        self.client_id = client_id
        self._token = token
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._idle: list[_Conn] = []  # the socket pool: sockets no call holds now
        self._busy = 0  # sockets checked out by calls in flight
        self._pool_lock = threading.Lock()
        self._pool_changed = threading.Condition(self._pool_lock)
        self._wake_r, self._wake_w = os.pipe()  # written once by close(): wakes every call
        self._released = False
        self._seq = itertools.count(1)
        self._registrations: dict[tuple[str, int, int], p.Register] = {}
        self._closing = False  # close() began: no new call, no new handshake
        self._closed = False  # calls in flight end with NotConnectedError
        self._hello_timeout = connect_timeout  # the first handshake fails fast
        self._transfer = transfer
        self._arena: Arena | None = None
        self._arena_bytes: npt.NDArray[np.uint8] | None = None
        self._rejoin_lock = threading.Lock()
        self._unreachable_since: float | None = None  # monotonic time of the first missed reply
        try:
            try:
                conn, self.server = self._open()
            except NoReply as exc:
                raise NotConnectedError(exc.message) from None
            self._idle.append(conn)
            if transfer != "inline":
                self._attach_arena(transfer)
        except BaseException:
            self._closing = self._closed = True
            self._release_sockets()
            raise
        self._hello_timeout = timeout
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop,
            args=(heartbeat_interval,),
            name=f"kvtier-client-heartbeat-{client_id[:8]}",
            daemon=True,
        )
        self._heartbeat.start()

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk, as the server names chunks."""
        return self.server.chunk_size

    @property
    def transfer(self) -> str:
        """ "shm" when bytes go through the server's arena, "inline" when they go as frames."""
        return "shm" if self._arena is not None else "inline"

    @property
    def arena_bytes(self) -> npt.NDArray[np.uint8] | None:
        """The server's arena as mapped in this process (uint8, whole arena), or None when
        bytes go inline; a rejoin after a server restart maps a new one."""
        return self._arena_bytes

    @property
    def closing(self) -> bool:
        """Whether close() began: no new call is sent from then on."""
        return self._closing

    def _attach_arena(self, transfer: Transfer) -> None:
        if self.server.host_id == p.local_host_id():
            try:
                self._arena = Arena.attach(self.server.arena_name, self.server.arena_size)
                self._arena_bytes = self._arena.ndarray(0, self._arena.size)
                return
            except OSError as exc:
                if transfer == "shm":
                    raise NotConnectedError(
                        f"cannot map the server's arena {self.server.arena_name!r}: {exc}"
                    ) from exc
                logger.info("arena not mappable (%s); moving bytes inline", exc)
        elif transfer == "shm":
            raise NotConnectedError(
                f"transfer='shm' needs the server on this machine; it runs on "
                f"{self.server.host_id!r}, this is {p.local_host_id()!r}"
            )

    # -- sockets --------------------------------------------------------------------------------
    #
    # A call checks a socket out of the pool and gives it back when it ends, so a thread that
    # ends leaves nothing behind and the sockets number at most the calls in flight at once.
    # Each socket says Hello once, when it is opened. A late reply to a call that timed out
    # can still arrive on a socket; the sequence number in every reply tells it apart, so the
    # next call on that socket skips it.

    def _checkout(self, *, closing: bool = False) -> _Conn:
        """A socket for one call: an idle one, else a new one that shook hands; `closing`
        lets close() have one for its goodbye."""
        with self._pool_lock:
            if self._closed or (self._closing and not closing):
                raise NotConnectedError(f"the client is closed: a new Client({self.address!r})")
            self._busy += 1
            conn = self._idle.pop() if self._idle else None
        if conn is not None:
            return conn
        try:
            conn, hello = self._open()
            if hello.server_id != self.server.server_id:
                self._rejoin(conn, hello)  # the server restarted: its arena, our registrations
        except BaseException:
            self._checkin(None)
            raise
        return conn

    def _checkin(self, conn: _Conn | None, *, broken: bool = False) -> None:
        """Give a socket back after its call; closed instead when the client closed, when it
        failed (`broken`), or when enough sockets are idle already."""
        with self._pool_lock:
            self._busy -= 1
            keep = not (broken or self._closed) and len(self._idle) < _MAX_IDLE_SOCKETS
            if conn is not None and keep:
                self._idle.append(conn)
                conn = None
            finish = self._closed and self._busy == 0
            if self._closed:  # only close() waits for the pool, and only once it closed it
                self._pool_changed.notify_all()
        if conn is not None:
            conn.sock.close(linger=0)
        if finish:
            self._release_sockets()

    def _open(self) -> tuple[_Conn, p.HelloReply]:
        """A new socket, connected, after its Hello (closed again if that fails)."""
        try:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
        except zmq.ZMQError as exc:
            raise NotConnectedError(f"cannot connect to {self.address!r}: {exc}") from exc
        conn = _Conn(sock, self._wake_r)
        try:
            return conn, self._hello_on(conn)
        except BaseException:
            sock.close(linger=0)
            raise

    def _release_sockets(self) -> None:
        """Once the client is closed and no call holds a socket: close them all, end the
        context. Runs once, on whichever thread gave the last socket back (or in close())."""
        with self._pool_lock:
            if self._released:
                return
            self._released = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.sock.close(linger=0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _hello_on(self, conn: _Conn) -> p.HelloReply:
        hello = p.Hello(
            protocol_version=p.PROTOCOL_VERSION,
            client_id=self.client_id,
            contract=self.hasher.contract() if self.hasher else None,
            contract_info=dict(self.hasher.contract_info()) if self.hasher else {},
            host_id=p.local_host_id(),
            pid=os.getpid(),  # the server fences our arena slots by this process
            token=self._token,
        )
        reply, _ = self._call_on(conn, hello, timeout=self._hello_timeout)
        return reply_as(reply, p.HelloReply, "Hello")

    # -- requests -------------------------------------------------------------------------------

    def call(
        self,
        msg: Any,
        payloads: Sequence[Any] = (),
        *,
        probe: bool = False,
        wait_s: float | None = None,
    ) -> tuple[p.Reply, list[zmq.Frame]]:
        """One request and its reply (with the payload frames after it), re-joining a
        restarted server once; fails fast while it is unreachable.

        A request that timed out, or a heartbeat (`probe`) that did, marks the server
        unreachable: later requests raise NotConnectedError at once instead of each waiting out
        the timeout, until a heartbeat gets an answer again. `wait_s`: a request the server
        answers only once something ends (a lookup's loads); its silence for that long is no
        sign of an unreachable server, and is raised as `NoReply`.
        """
        if self._closing:
            raise NotConnectedError(
                f"the client is closed: {type(msg).__name__} needs a new Client({self.address!r})"
            )
        if self._unreachable_since is not None and not probe:
            raise NotConnectedError(
                f"kvtier at {self.address} has not answered for "
                f"{time.monotonic() - self._unreachable_since:.1f}s; failing fast until a "
                "heartbeat gets through"
            )
        if wait_s is not None:
            timeout = wait_s
        else:
            timeout = min(self.timeout, _PROBE_TIMEOUT) if probe else self.timeout
        try:
            conn = self._checkout()
        except NoReply as exc:  # a new socket's Hello went unanswered
            self._unreachable_since = self._unreachable_since or time.monotonic()
            raise NotConnectedError(exc.message) from None
        broken = False
        try:
            try:
                result = self._call_on(conn, msg, payloads, timeout)
            except _Forgotten:
                self._rejoin(conn)  # the server restarted: shake hands again, then retry once
                result = self._call_on(conn, msg, payloads, timeout)
            except NotRegisteredError:
                # the server forgot a layout no live client held (--layout-ttl): register
                # what this client registered again, then retry once
                if isinstance(msg, p.Register) or not self._registrations:
                    raise
                for register in list(self._registrations.values()):
                    self._call_on(conn, register)
                result = self._call_on(conn, msg, payloads, timeout)
        except NoReply as exc:
            if wait_s is not None:
                raise
            if self._unreachable_since is None:
                self._unreachable_since = time.monotonic()
            raise NotConnectedError(exc.message) from None
        except zmq.ZMQError as exc:
            broken = True
            raise NotConnectedError(f"kvtier at {self.address}: socket failed ({exc})") from None
        finally:
            self._checkin(conn, broken=broken)
        self._unreachable_since = None
        return result

    def register(self, register: p.Register) -> None:
        """Send a worker's layout; it is sent again to a restarted server on the rejoin."""
        self.call(register)
        self._registrations[register.model, register.world_size, register.worker_id] = register

    def _rejoin(self, conn: _Conn, hello: p.HelloReply | None = None) -> None:
        """Hello again on `conn` (or take the `hello` it just got); if the server is a new one,
        map its arena and re-register.

        The old mapping is closed at once: a thread still copying through it holds its own
        reference, which keeps those pages mapped until the copy ends (its store's commit is then
        refused, since the new server never reserved it). So no restart leaves a whole old L1
        mapped in a long-lived client.
        """
        with self._rejoin_lock:
            if self._closing:  # a goodbye was said: never shake hands again
                raise NotConnectedError(f"the client is closed: a new Client({self.address!r})")
            if hello is None:
                hello = self._hello_on(conn)
            if hello.server_id == self.server.server_id:
                return  # another thread already re-joined this server
            logger.info("kvtier at %s restarted: re-joining", self.address)
            self.server = hello
            if self._arena is not None:
                old, self._arena, self._arena_bytes = self._arena, None, None
                old.close()
            if self._transfer != "inline":
                self._attach_arena(self._transfer)
            for register in self._registrations.values():
                self._call_on(conn, register)

    def _call_on(
        self,
        conn: _Conn,
        msg: Any,
        payloads: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> tuple[p.Reply, list[zmq.Frame]]:
        """Send on `conn` and wait for the reply of the same sequence number; close() wakes
        the wait (NotConnectedError), so no call outlives the client."""
        timeout = self.timeout if timeout is None else timeout
        if self._closed:
            raise NotConnectedError("the client is closed")
        seq = next(self._seq).to_bytes(8, "little")
        sock = conn.sock
        # The header is copied, even a 16k-token lookup's 64 KiB: pyzmq sends a frame from 64
        # KiB on without a copy and frees it on its garbage-collector thread, a wake-up and a
        # GIL hand-off per request that cost more CPU than the copy. KV payloads go uncopied.
        header = _encode(msg)
        if payloads:
            sock.send_multipart([seq, zmq.Frame(header, copy=True), *payloads], copy=False)
        else:
            sock.send_multipart([seq, header])
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            ready = conn.poller.poll(int(remaining * 1000) + 1) if remaining > 0 else []
            if self._closed:
                raise NotConnectedError(
                    f"the client was closed while {type(msg).__name__} waited for its reply"
                )
            if not any(item is sock for item, _ in ready):
                if remaining > 0 and time.monotonic() < deadline:
                    continue
                raise NoReply(
                    f"no reply from kvtier at {self.address} within {timeout:g}s to "
                    f"{type(msg).__name__}: is `kvtier serve --address {self.address}` running?"
                )
            frames = sock.recv_multipart(copy=False)
            if frames[0].bytes != seq:
                continue  # the late answer to a request that already timed out
            reply = p.decode_reply(frames[1].buffer)
            if isinstance(reply, p.ErrorReply):
                if reply.code == ErrorCode.NOT_CONNECTED and not isinstance(msg, p.Hello):
                    raise _Forgotten(reply.message)
                raise error_from_code(reply.code, reply.message)
            return reply, frames[2:]

    def _heartbeat_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.call(p.Heartbeat(), probe=True)
            except KVTierError as exc:
                logger.debug("heartbeat failed: %s", exc)
            except zmq.ZMQError:
                return  # the context is being destroyed

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Say goodbye and disconnect; idempotent. The server reclaims what this client holds.

        Safe while other threads are mid-call: they are woken and raise NotConnectedError, and
        each socket is closed by the thread holding it (a ZMQ socket is never touched by two
        threads at once), the last one ending the context.
        """
        with self._pool_lock:
            if self._closing:
                return
            self._closing = True  # no new call from here on
        self._stop.set()
        if self._unreachable_since is None:
            self._hello_timeout = _GOODBYE_TIMEOUT  # if every socket is in use
            try:  # best effort: a server that does not hear it notices the missing heartbeats
                conn = self._checkout(closing=True)
                try:
                    self._call_on(conn, p.Goodbye(), timeout=_GOODBYE_TIMEOUT)
                finally:
                    self._checkin(conn)
            except (KVTierError, zmq.ZMQError) as exc:
                logger.debug("goodbye not answered: %s", exc)
        with self._pool_lock:
            self._closed = True
            os.write(self._wake_w, b"\0")  # every poll in flight returns, now and later
            self._pool_changed.wait_for(lambda: self._busy == 0, timeout=_CLOSE_WAIT_S)
            idle = self._busy == 0
        if idle:
            self._release_sockets()
        # else: a call still holds its socket; the last one given back ends the context
        if self._heartbeat.is_alive() and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=_CLOSE_WAIT_S)
        self._arena_bytes = None
        if self._arena is not None:
            self._arena.close()
        self._arena = None

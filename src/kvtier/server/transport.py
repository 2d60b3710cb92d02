"""The ZMQ ROUTER loop: receives request frames, hands them to the engine, sends the replies.

One thread owns the socket. A message is `[identity, seq, header, *payloads]`; the reply is
`[identity, seq, reply-header, *payloads]`. Anything that is not shaped like that still gets
exactly one error reply, so no client is ever left waiting for a timeout.

The engine may answer later from another thread (a lookup waiting on L2 loads): such a reply
goes into an outbox and an eventfd wakes the loop, which alone sends on the socket. Writing the
eventfd and closing it at shutdown hold one lock, so no reply ever writes a closed (or reused)
descriptor.

What a peer can make the server hold is bounded here, before any decoding:

- a frame: MAXMSGSIZE, `--max-frame-bytes` but never more than the largest frame a valid request
  carries (a header of `--max-request-tokens`, or a piece of inline KV: `INLINE_FRAME_BYTES`),
  whatever the arena's size;
- the sequence frame every reply echoes: at most `MAX_SEQ_BYTES` (a longer one is answered
  MALFORMED_FRAME with its first `MAX_SEQ_BYTES` bytes), so replies queued for a peer that does
  not read them are small, before its Hello and after;
- queued messages: RCVHWM, `--max-queued-requests` per connection, and SNDHWM, 16 times that
  (replies to a peer that does not read them are dropped beyond it);
- before its Hello, a connection's request of more than `MAX_UNKNOWN_BYTES` is answered
  NOT_CONNECTED unread (a Hello is tiny);
- bytes received and not yet answered: `--max-inflight-bytes` (NO_SPACE beyond it).

A connection is named to the engine by its routing id and the peer address libzmq recorded
when it accepted the connection (for ipc:// that ends with the peer's uid:gid:pid): a peer that
picks another connection's routing id once that one is gone is a new connection, which must say
Hello. For a Hello over ipc:// the transport proves the connecting process with the socket's
SO_PEERCRED (found through the message's ZMQ_SRCFD), checked against that recorded peer address,
and hands the pid to the handshake (`Handshake.prove`); over tcp:// there is nothing to prove.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvtier import protocol as p
from kvtier.errors import KVTierError, MalformedFrameError, NoSpaceError, NotConnectedError
from kvtier.names import MAX_NAME_BYTES, MAX_NAMES
from kvtier.server.descriptors import raise_limit
from kvtier.server.engine import Engine

__all__ = ["MAX_SEQ_BYTES", "MAX_UNKNOWN_BYTES", "Transport", "frame_limit", "peer_pid"]

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often the loop checks its stop event while idle

#: the most a connection may send in one request before its Hello (a Hello is a few hundred
#: bytes; its fields are bounded to well under this by limits.py)
MAX_UNKNOWN_BYTES = 64 << 10
#: the longest sequence frame echoed in a reply (a kvtier Client sends 8 bytes)
MAX_SEQ_BYTES = 64
#: requests up to this size never count against --max-inflight-bytes (heartbeats, commits,
#: short lookups); every bigger one does, whether a handler thread or this one takes it
_SMALL_BYTES = 4096
#: replies queued for one peer that does not read them, per request it may queue unread: a
#: client that pipelines requests reads its replies later, one that never reads loses them
_SNDHWM_FACTOR = 16
#: how a Hello header starts: a msgpack array, then the tag "Hello" as a 5-byte fixstr
_HELLO_TAG = b"\xa5Hello"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_pid(frame: zmq.Frame) -> int | None:
    """The pid of the process at the other end of the ipc:// connection `frame` came on, as the
    kernel reports it (SO_PEERCRED); None over tcp:// or when it cannot be proven.

    libzmq (4.3) gives the connection's descriptor as the message's ZMQ_SRCFD (deprecated, still
    served) and, in its "Peer-Address" metadata, the `...:uid:gid:pid` it read with SO_PEERCRED
    when it accepted the connection. The descriptor may have been closed and reused since the
    message was read, so the two must agree."""
    try:
        address = frame.get("Peer-Address")
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    if not isinstance(address, str) or not isinstance(fd, int) or fd < 0:
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family != socket.AF_UNIX:
            return None
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    finally:
        sock.detach()  # the descriptor is libzmq's: never closed here
    pid, uid, gid = (int(v) for v in _UCRED.unpack(raw))
    if pid <= 0 or not address.endswith(f":{uid}:{gid}:{pid}"):
        return None
    return pid


def frame_limit(configured: int, max_request_tokens: int) -> int:
    """The largest frame worth reading: `configured`, but no more than a valid request's
    largest frame: a header carries at most the tokens or the names a request may have, plus
    its other bounded fields; inline KV travels in frames of at most INLINE_FRAME_BYTES. It
    does not follow the arena's size: every peer may send it before any credential."""
    header = 4 * max_request_tokens + MAX_NAMES * (MAX_NAME_BYTES + 8) + (64 << 10)
    return min(configured, max(p.INLINE_FRAME_BYTES, header))


_umask_lock = threading.Lock()


def _bind_private(sock: zmq.Socket[bytes], address: str) -> None:
    """Bind; an ipc:// socket file is created 0600 whatever the process umask, so only this
    user can connect (the umask is process-wide: tightened just around the bind)."""
    if not address.startswith("ipc://"):
        sock.bind(address)
        return
    with _umask_lock:
        old = os.umask(0o177)
        try:
            sock.bind(address)
        finally:
            os.umask(old)
    path = sock.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("ipc://")
    if not path.startswith("@"):  # an abstract socket has no file
        os.chmod(path, 0o600)


class Transport:
    """A ROUTER socket bound to every configured address, served by one thread."""

    def __init__(
        self,
        engine: Engine,
        addresses: Sequence[str],
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        max_frame_bytes: int = -1,
    ) -> None:
        """`max_frame_bytes` becomes MAXMSGSIZE: ZMQ drops a peer that sends a bigger frame
        before reading it into memory (-1: the bound the engine's config allows)."""
        self.engine = engine
        cfg = engine.config
        configured = max_frame_bytes if max_frame_bytes > 0 else cfg.max_frame_bytes
        self.max_frame_bytes = frame_limit(configured, cfg.max_request_tokens)
        self.max_inflight_bytes = cfg.max_inflight_bytes
        raise_limit()  # every connection is a descriptor (see descriptors.py)
        self.context = context or zmq.Context.instance()
        self.socket: zmq.Socket[bytes] = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, cfg.max_queued_requests)
        self.socket.setsockopt(zmq.SNDHWM, _SNDHWM_FACTOR * cfg.max_queued_requests)
        self.socket.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        self.addresses: list[str] = []
        self._thread: threading.Thread | None = None  # the loop's thread while it serves
        self._closed = False
        self._outbox: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        # writing the eventfd (any thread) and closing it (close) hold this lock, in that order
        # of checks: a reply never writes a descriptor that is closed, or reused by then
        self._wake_lock = threading.Lock()
        self._inflight = 0  # bytes of big requests received and not yet answered
        self._inflight_lock = threading.Lock()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            for address in addresses:
                _bind_private(self.socket, address)
                self.addresses.append(self.socket.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError as exc:
            self.socket.close()
            os.close(self._wake)
            raise OSError(f"cannot listen on {address!r}: {exc}") from exc

    def serve_forever(self, stop: threading.Event) -> None:
        """Serve until `stop` is set."""
        self._thread = threading.current_thread()
        sock = self.socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        try:
            while not stop.is_set():
                ready = poller.poll(_POLL_MS)
                if not ready:
                    continue
                if any(item == self._wake for item, _ in ready):
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.eventfd_read(self._wake)  # rearmed: replies queued from now wake it
                self._send_outbox()
                # drain everything that is ready before polling again (EVENTS asks without the
                # cost of a failed receive's exception)
                while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    self._serve_one(sock.recv_multipart(zmq.NOBLOCK, copy=False))
                    self._send_outbox()
        finally:
            self._thread = None

    def _send_outbox(self) -> None:
        """Send the replies other threads left in the outbox (this thread alone takes them)."""
        outbox = self._outbox
        while not outbox.empty():
            self._send(outbox.get_nowait())

    def _responder(
        self, identity: bytes, seq: bytes, inflight: int = 0
    ) -> Callable[[list[Any]], None]:
        """How the engine answers this request, from this thread (at once) or another;
        `inflight` bytes are given back to --max-inflight-bytes with the answer."""

        def respond(reply: list[Any]) -> None:
            if inflight:
                with self._inflight_lock:
                    self._inflight -= inflight
            message = [identity, seq, *reply]
            if threading.current_thread() is self._thread:
                self._send(message)
                return
            with self._wake_lock:
                if self._closed:
                    return  # shutting down: the socket is gone, the reply with it
                self._outbox.put(message)
                os.eventfd_write(self._wake, 1)

        return respond

    def _send(self, message: list[Any]) -> None:
        try:
            self.socket.send_multipart(message, copy=False)
        except zmq.ZMQError:
            logger.exception("could not send a reply")

    def _serve_one(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) > 1 and len(frames[1]) > MAX_SEQ_BYTES:
            self._refuse(identity, frames[1].buffer[:MAX_SEQ_BYTES].tobytes(), MalformedFrameError(
                f"the sequence frame has {len(frames[1])} bytes; at most {MAX_SEQ_BYTES}"
            ))  # fmt: skip
            return
        if len(frames) < 3:
            seq = frames[1].bytes if len(frames) > 1 else b""
            err = MalformedFrameError(
                f"a request is [seq, header, *payloads]; got {len(frames) - 1} frames"
            )
            self.engine.metrics.count_error("unknown", err.code.name)
            self._send([identity, seq, p.error_reply(err)])
            return
        seq = frames[1].bytes
        # the connection: its routing id and the peer libzmq accepted (see the module doc)
        try:
            peer = frames[1].get("Peer-Address")
        except zmq.ZMQError:
            peer = ""
        key = identity + b"\x00" + str(peer).encode("utf-8", "replace")
        size = sum(len(f) for f in frames[2:])
        if size > MAX_UNKNOWN_BYTES and not self.engine.leases.is_connected(key):
            self._refuse(identity, seq, NotConnectedError(
                f"send Hello before a request of {size} bytes: this connection has not said "
                f"Hello, and before it requests of more than {MAX_UNKNOWN_BYTES} bytes are "
                "refused unread"
            ))  # fmt: skip
            return
        inflight = 0
        if size > _SMALL_BYTES:
            with self._inflight_lock:
                busy = self._inflight
                if busy == 0 or busy + size <= self.max_inflight_bytes:
                    self._inflight += size
                    inflight = size
            if not inflight:
                self._refuse(identity, seq, NoSpaceError(
                    f"the server holds {busy} bytes of requests not yet answered; this one of "
                    f"{size} would pass --max-inflight-bytes {self.max_inflight_bytes}: retry"
                ))  # fmt: skip
                return
        header = frames[2].buffer
        hello = header[1:7] == _HELLO_TAG or header[3:9] == _HELLO_TAG
        if hello:
            pid = peer_pid(frames[1])
            if pid is not None:
                self.engine.handshake.prove(key, pid)
        try:
            self.engine.handle(
                key,
                header,
                [f.buffer for f in frames[3:]],
                self._responder(identity, seq, inflight),
            )
        finally:
            if hello:
                self.engine.handshake.forget_proof(key)

    def _refuse(self, identity: bytes, seq: bytes, err: KVTierError) -> None:
        """Answer a request the transport refuses before the engine sees it."""
        self.engine.metrics.count_error("unknown", err.code.name)
        self._send([identity, seq, p.error_reply(err)])

    def close(self) -> None:
        """Close the socket and remove the ipc:// socket files this server created."""
        with self._wake_lock:
            self._closed = True
            with contextlib.suppress(OSError):
                os.close(self._wake)
        self.socket.close(linger=0)
        for address in self.addresses:
            if address.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(address.removeprefix("ipc://"))

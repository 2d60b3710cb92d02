"""The ZMQ ROUTER loop: receives request frames, hands them to the engine, sends the replies.

One thread owns the socket. A message is `[identity, seq, header, *payloads]`; the reply is
`[identity, seq, reply-header, *payloads]`. Anything that is not shaped like that still gets
exactly one error reply, so no client is ever left waiting for a timeout.

The engine may answer later from another thread (a lookup waiting on L2 loads): such a reply
goes into an outbox and an eventfd wakes the loop, which alone sends on the socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvtier import protocol as p
from kvtier.errors import MalformedFrameError
from kvtier.server.engine import Engine

__all__ = ["Transport"]

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often the loop checks its stop event while idle


class Transport:
    """A ROUTER socket bound to every configured address, served by one thread."""

    def __init__(
        self,
        engine: Engine,
        addresses: Sequence[str],
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.engine = engine
        self.context = context or zmq.Context.instance()
        self.socket: zmq.Socket[bytes] = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.addresses: list[str] = []
        self._thread: threading.Thread | None = None  # the loop's thread while it serves
        self._closed = False
        self._outbox: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            for address in addresses:
                self.socket.bind(address)
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
                if not poller.poll(_POLL_MS):
                    continue
                self._send_outbox()
                while True:  # drain everything that is ready before polling again
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._serve_one(frames)
                    self._send_outbox()
        finally:
            self._thread = None

    def _send_outbox(self) -> None:
        """Send the replies other threads left in the outbox."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._wake)
        while True:
            try:
                message = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(message)

    def _responder(self, identity: bytes, seq: bytes) -> Callable[[list[Any]], None]:
        """How the engine answers this request, from this thread (at once) or another."""

        def respond(reply: list[Any]) -> None:
            message = [identity, seq, *reply]
            if threading.current_thread() is self._thread:
                self._send(message)
            elif not self._closed:
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
        if len(frames) < 3:
            seq = frames[1].bytes if len(frames) > 1 else b""
            err = MalformedFrameError(
                f"a request is [seq, header, *payloads]; got {len(frames) - 1} frames"
            )
            self.engine.metrics.count_error("unknown", err.code.name)
            self._send([identity, seq, p.error_reply(err)])
            return
        seq = frames[1].bytes
        self.engine.handle(
            identity,
            frames[2].buffer,
            [f.buffer for f in frames[3:]],
            self._responder(identity, seq),
        )

    def close(self) -> None:
        """Close the socket and remove the ipc:// socket files this server created."""
        self._closed = True
        self.socket.close(linger=0)
        with contextlib.suppress(OSError):
            os.close(self._wake)
        for address in self.addresses:
            if address.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(address.removeprefix("ipc://"))

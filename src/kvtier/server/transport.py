"""The ZMQ ROUTER loop: receives request frames, hands them to the engine, sends the reply.

One thread owns the socket. A message is `[identity, seq, header, *payloads]`; the reply is
`[identity, seq, reply-header, *payloads]`. Anything that is not shaped like that still gets
exactly one error reply, so no client is ever left waiting for a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import zmq

from kvtier import protocol as p
from kvtier.errors import MalformedFrameError
from kvtier.server.engine import Engine

__all__ = ["Transport"]

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often the loop checks its stop event while idle


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
        before reading it into memory (-1: no limit)."""
        self.engine = engine
        self.context = context or zmq.Context.instance()
        self.socket: zmq.Socket[bytes] = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.addresses: list[str] = []
        try:
            for address in addresses:
                _bind_private(self.socket, address)
                self.addresses.append(self.socket.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError as exc:
            self.socket.close()
            raise OSError(f"cannot listen on {address!r}: {exc}") from exc

    def serve_forever(self, stop: threading.Event) -> None:
        """Serve until `stop` is set."""
        sock = self.socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            while True:  # drain everything that is ready before polling again
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._serve_one(frames)

    def _serve_one(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) < 3:
            seq = frames[1].bytes if len(frames) > 1 else b""
            err = MalformedFrameError(
                f"a request is [seq, header, *payloads]; got {len(frames) - 1} frames"
            )
            self.engine.metrics.count_error("unknown", err.code.name)
            reply: list[Any] = [p.error_reply(err)]
        else:
            seq = frames[1].bytes
            reply = self.engine.handle(identity, frames[2].buffer, [f.buffer for f in frames[3:]])
        try:
            self.socket.send_multipart([identity, seq, *reply], copy=False)
        except zmq.ZMQError:
            logger.exception("could not send a reply")

    def close(self) -> None:
        """Close the socket and remove the ipc:// socket files this server created."""
        self.socket.close(linger=0)
        for address in self.addresses:
            if address.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(address.removeprefix("ipc://"))

"""A client that speaks the wire protocol by hand, frame by frame, so a test can send what
kvtier's own Client never would."""

from __future__ import annotations

import zmq

from kvtier import protocol as p


class RawPeer:
    """A bare DEALER socket that speaks (or garbles) the protocol by hand."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, *frames: bytes) -> list[bytes] | None:
        self.sock.send_multipart(list(frames))
        if not self.sock.poll(5000):
            return None
        return self.sock.recv_multipart()

    def error(self, *frames: bytes) -> int:
        reply = self.send(*frames)
        assert reply is not None, "the server did not reply"
        decoded = p.decode_reply(reply[-1])
        assert isinstance(decoded, p.ErrorReply), decoded
        return decoded.code

    def hello(self) -> None:
        msg = p.Hello(p.PROTOCOL_VERSION, "raw-peer")
        reply = self.send(b"seq00001", p.encode(msg))
        assert reply is not None and isinstance(p.decode_reply(reply[1]), p.HelloReply)

    def close(self) -> None:
        self.ctx.destroy(linger=0)

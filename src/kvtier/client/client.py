"""The client library used by schedulers and workers.

One `Client` per process is enough: it is thread-safe (each call takes a ZMQ socket from a small
pool and gives it back, all under one client id, so TP workers in threads do not serialize on a
lock, and threads that end leave no socket behind). On the server's
machine the KV bytes go straight between the caller's arrays and the server's shared-memory
arena; elsewhere they travel inline as ZMQ frames. Both paths give the same results.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt
import zmq

from kvtier import protocol as p
from kvtier.arena import Arena
from kvtier.client.slots import RetrievedSlots, StoreSlots, reply_as
from kvtier.copying import copy_pairs
from kvtier.errors import (
    BadArrayError,
    ErrorCode,
    InvalidArgumentError,
    KVTierError,
    NotConnectedError,
    ProtocolVersionError,
    error_from_code,
)
from kvtier.hashing import TokenHasher, TokenIds, token_bytes
from kvtier.names import ChunkName, check_names

__all__ = ["Client", "LookupHandle", "RetrievedSlots", "StoreSlots"]

logger = logging.getLogger(__name__)

Transfer = Literal["auto", "shm", "inline"]


def _tokens(tokens: TokenIds) -> bytes:
    try:
        raw = token_bytes(tokens)
    except KVTierError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentError(
            f"tokens must be ints in [0, 2**32), a numpy integer array or packed uint32 "
            f"bytes: {exc}"
        ) from None
    return raw if isinstance(raw, bytes) else bytes(raw)


def _encode(msg: Any) -> bytes:
    """The request header; a value msgpack cannot carry (an int past 64 bits, a string with
    lone surrogates) is the caller's error, raised as kvtier's typed error."""
    try:
        return p.encode(msg)
    except (TypeError, ValueError, OverflowError) as exc:  # UnicodeEncodeError is a ValueError
        raise InvalidArgumentError(f"{type(msg).__name__} cannot be sent: {exc}") from None


def _chunk_rows(
    array: Any, what: str, *, writable: bool
) -> tuple[npt.NDArray[np.uint8], list[int], str]:
    """A (num_chunks, chunk_bytes) uint8 view of a numpy array or CPU torch tensor, no copy.

    Returns the view, the chunk shape (array shape without its first axis) and the dtype name.
    """
    if isinstance(array, np.ndarray):
        if array.ndim < 2:
            raise BadArrayError(
                f"{what} must be (num_chunks, *chunk_shape), got shape {array.shape}"
            )
        if not array.flags.c_contiguous:
            raise BadArrayError(f"{what} must be C-contiguous (use np.ascontiguousarray)")
        if not array.dtype.isnative:
            raise BadArrayError(
                f"{what} has byte order {array.dtype.str!r}, not this machine's: convert it "
                "(array.astype(array.dtype.newbyteorder('=')))"
            )
        if writable and not array.flags.writeable:
            raise BadArrayError(f"{what} is read-only; retrieve writes into it")
        rows = array.reshape(array.shape[0], math.prod(array.shape[1:])).view(np.uint8)
        return rows, list(array.shape[1:]), array.dtype.name
    if type(array).__module__.startswith("torch"):
        if array.device.type != "cpu":
            raise BadArrayError(f"{what} is on {array.device}; kvtier moves CPU tensors")
        if array.dim() < 2:
            raise BadArrayError(
                f"{what} must be (num_chunks, *chunk_shape), got {tuple(array.shape)}"
            )
        if not array.is_contiguous():
            raise BadArrayError(f"{what} must be contiguous (call .contiguous())")
        import torch  # only reached when the caller already uses torch

        flat = array.detach().reshape(array.shape[0], math.prod(array.shape[1:]))
        rows_t = flat.view(torch.uint8)
        return rows_t.numpy(), list(array.shape[1:]), str(array.dtype).removeprefix("torch.")
    raise BadArrayError(f"{what} must be a numpy array or a CPU torch tensor, got {type(array)}")


class _Forgotten(NotConnectedError):
    """The server answered "send Hello first": it restarted and no longer knows this client."""


class _NoReply(NotConnectedError):
    """No reply within the timeout: the server is down, stalled or unreachable."""


_PROBE_TIMEOUT = 5.0  # how long a heartbeat waits before it calls the server unreachable
_GOODBYE_TIMEOUT = 0.5  # how long close() waits for the server to hear its goodbye
_CLOSE_WAIT_S = 2.0  # how long close() waits for woken calls to give their sockets back
_MAX_IDLE_SOCKETS = 32  # idle sockets kept for later calls; more are closed when given back


class _Conn:
    """One DEALER socket of the pool, and a poller that waits on it and on close()'s wake-up."""

    __slots__ = ("poller", "sock")

    def __init__(self, sock: zmq.Socket[bytes], wake_fd: int) -> None:
        self.sock = sock
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(wake_fd, zmq.POLLIN)


def _check_address(address: object) -> None:
    """A ZMQ address kvtier can connect to, or InvalidArgumentError naming the fix."""
    if not isinstance(address, str) or not address.startswith(("ipc://", "tcp://")):
        raise InvalidArgumentError(
            f"address {address!r} needs a scheme: ipc:///tmp/kvtier.sock or tcp://host:port "
            "(the --address the server was started with)"
        )


class LookupHandle:
    """A lookup whose L2 loads may still run on the server: `poll()` asks without waiting,
    `result()` waits on the server for the answer."""

    def __init__(
        self, client: Client, request_id: str, hit_tokens: int | None, cache_salt: str = ""
    ) -> None:
        self._client = client
        self.request_id = request_id
        self._hit_tokens = hit_tokens
        self._cache_salt = cache_salt

    def poll(self) -> int | None:
        """The hit tokens once known, else None; one round trip at most, never waits."""
        if self._hit_tokens is None:
            poll = p.LookupPoll(self.request_id, cache_salt=self._cache_salt)
            reply, _ = self._client._call(poll)
            done = reply_as(reply, p.LookupReply, "LookupPoll")
            if not done.pending:
                self._hit_tokens = done.hit_tokens
        return self._hit_tokens

    def result(self, timeout: float | None = None) -> int:
        """Wait until the hit is known; NotConnectedError when `timeout` seconds pass first.

        One request that the server answers when the loads end (no polling). Without a
        timeout it waits as long as the server answers heartbeats, asking again each
        `Client.timeout` seconds.
        """
        if self._hit_tokens is not None:
            return self._hit_tokens
        client = self._client
        poll = p.LookupPoll(self.request_id, wait=True, cache_salt=self._cache_salt)
        while True:
            wait_s = client.timeout if timeout is None else timeout
            try:
                if wait_s <= 0:  # no time to wait: one look, then the timeout's error
                    hit = self.poll()
                    if hit is not None:
                        return hit
                    raise _NoReply("no time to wait")
                reply, _ = client._call(poll, wait_s=wait_s)
                break
            except _NoReply:
                if timeout is not None:
                    raise NotConnectedError(
                        f"lookup of request {self.request_id!r} still loading from L2 after "
                        f"{timeout:g}s (LookupHandle.result(timeout=...))"
                    ) from None
                # no timeout: ask again; a server that stopped answering heartbeats meanwhile
                # makes the next call fail fast with NotConnectedError
        self._hit_tokens = reply_as(reply, p.LookupReply, "LookupPoll").hit_tokens
        return self._hit_tokens

    def __repr__(self) -> str:
        state = "pending" if self._hit_tokens is None else f"hit_tokens={self._hit_tokens}"
        return f"LookupHandle({self.request_id!r}, {state})"


class Client:
    """A connection to one `kvtier serve`. See the README for the flow of one request."""

    def __init__(
        self,
        address: str,
        *,
        hasher: TokenHasher | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 2.0,
        transfer: Transfer = "auto",
        heartbeat_interval: float = 1.0,
        client_id: str | None = None,
        token: str = "",
    ) -> None:
        """`token`: a credential from the server's --auth-tokens-file, when it has one."""
        if transfer not in ("auto", "shm", "inline"):
            raise InvalidArgumentError(
                f"transfer must be 'auto', 'shm' or 'inline', got {transfer!r}"
            )
        self._token = token
        _check_address(address)
        for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if not value > 0:
                raise InvalidArgumentError(f"{name} must be > 0 seconds, got {value!r}")
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.hasher = hasher
        self.client_id = client_id or uuid.uuid4().hex
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._idle: list[_Conn] = []  # the socket pool: sockets no call holds now
        self._busy = 0  # sockets checked out by calls in flight
        self._pool_lock = threading.Lock()
        self._pool_changed = threading.Condition(self._pool_lock)
        self._wake_r, self._wake_w = os.pipe()  # written once by close(): wakes every call
        self._released = False
        self._seq = itertools.count(1)
        self._world_sizes: dict[str, int] = {}
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
            except _NoReply as exc:
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
            name=f"kvtier-client-heartbeat-{self.client_id[:8]}",
            daemon=True,
        )
        self._heartbeat.start()

    # -- connection -----------------------------------------------------------------------------

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
        """The server's shared-memory arena as mapped in this process (uint8, whole arena), or
        None when bytes go inline. A re-join after a server restart maps a new arena: read it
        again rather than keeping it across calls. For callers that register the arena with a
        device (pinned host memory); slot views come from `store_slots` / `retrieve_slots`."""
        return self._arena_bytes

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

    def _call(
        self,
        msg: Any,
        payloads: Sequence[Any] = (),
        *,
        probe: bool = False,
        wait_s: float | None = None,
    ) -> tuple[p.Reply, list[zmq.Frame]]:
        """One request, re-joining a restarted server once; fails fast while it is unreachable.

        A request that timed out, or a heartbeat (`probe`) that did, marks the server
        unreachable: later requests raise NotConnectedError at once instead of each waiting out
        the timeout, until a heartbeat gets an answer again. `wait_s`: a request the server
        answers only once something ends (a lookup's loads); its silence for that long is no
        sign of an unreachable server, and is raised as `_NoReply`.
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
        except _NoReply as exc:  # a new socket's Hello went unanswered
            self._unreachable_since = self._unreachable_since or time.monotonic()
            raise NotConnectedError(exc.message) from None
        broken = False
        try:
            try:
                result = self._call_on(conn, msg, payloads, timeout)
            except _Forgotten:
                self._rejoin(conn)  # the server restarted: shake hands again, then retry once
                result = self._call_on(conn, msg, payloads, timeout)
        except _NoReply as exc:
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
                raise _NoReply(
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
                self._call(p.Heartbeat(), probe=True)
            except KVTierError as exc:
                logger.debug("heartbeat failed: %s", exc)
            except zmq.ZMQError:
                return  # the context is being destroyed

    # -- operations -----------------------------------------------------------------------------

    def register(
        self,
        *,
        model: str,
        world_size: int = 1,
        worker_id: int = 0,
        chunk_shape: Sequence[int],
        dtype: str,
    ) -> None:
        """Tell the server this worker's KV layout: one chunk of its shard is `chunk_shape`."""
        dtype = str(dtype).removeprefix("torch.")
        try:
            shape = [int(d) for d in chunk_shape]
        except (TypeError, ValueError) as exc:
            raise BadArrayError(f"chunk_shape {chunk_shape!r} must be a sequence of ints") from exc
        register = p.Register(model, world_size, worker_id, shape, dtype)
        self._call(register)
        self._registrations[model, world_size, worker_id] = register  # replayed on a rejoin
        self._world_sizes[model] = world_size

    @overload
    def lookup(
        self,
        request_id: str,
        tokens: TokenIds,
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
        wait: Literal[True] = True,
        readers: int = 0,
        prefill_tokens_per_s: float = 0.0,
    ) -> int: ...

    @overload
    def lookup(
        self,
        request_id: str,
        tokens: TokenIds,
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
        wait: Literal[False],
        readers: int = 0,
        prefill_tokens_per_s: float = 0.0,
    ) -> LookupHandle: ...

    def lookup(
        self,
        request_id: str,
        tokens: TokenIds,
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
        wait: bool = True,
        readers: int = 0,
        prefill_tokens_per_s: float = 0.0,
    ) -> int | LookupHandle:
        """Leading tokens whose chunks every rank has cached (pinned until retrieved).

        Chunks that must first load from an L2 tier load on the server; with `wait=False` this
        returns at once a `LookupHandle` to poll while they do (a scheduler step is not held up).
        `readers`: how many ranks retrieve under the pin (0: world_size); the pin is released
        once each of readers 0..readers-1 retrieved (see `retrieve(reader=...)`).
        With `prefill_tokens_per_s` (the engine's prefill speed) the server leaves out the L2
        chunks it predicts load slower than they recompute; 0 (unknown) reports every one.
        """
        msg = p.Lookup(
            request_id,
            _tokens(tokens),
            model,
            world_size,
            cache_salt,
            wait,
            extra_key,
            readers,
            prefill_tokens_per_s,
        )
        raw, _ = self._call(msg)
        reply = reply_as(raw, p.LookupReply, "Lookup")
        if wait:
            return reply.hit_tokens
        hit = None if reply.pending else reply.hit_tokens
        return LookupHandle(self, request_id, hit, cache_salt)

    def store_slots(
        self,
        request_id: str,
        tokens: TokenIds,
        *,
        model: str,
        worker_id: int = 0,
        start: int = 0,
        end: int,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
        resumable: Sequence[bool] = (),
    ) -> StoreSlots:
        """Slots to write this rank's chunks [start, end) into; commits on leaving `with`.

        `resumable[i]`: whether chunk i is a point the engine can resume from (empty: every
        chunk is); a lookup's hit ends at the last resume point of its leading stored chunks.
        """
        num_chunks = max(0, (end - start) // self.chunk_size)
        fields = self._fields(
            request_id, tokens, model, worker_id, start, end, chunk_shape, dtype, num_chunks,
            cache_salt, extra_key, world_size,
        )  # fmt: skip
        return StoreSlots(self, {**fields, "resumable": [bool(r) for r in resumable]})

    def retrieve_slots(
        self,
        request_id: str,
        tokens: TokenIds,
        *,
        model: str,
        worker_id: int = 0,
        start: int = 0,
        end: int,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
        reader: int = -1,
    ) -> RetrievedSlots:
        """Read-only views of this rank's leading cached chunks of [start, end); `reader` is
        the rank marked done on the lookup's pin (-1: worker_id)."""
        num_chunks = max(0, (end - start) // self.chunk_size)
        fields = self._fields(
            request_id, tokens, model, worker_id, start, end, chunk_shape, dtype, num_chunks,
            cache_salt, extra_key, world_size,
        )  # fmt: skip
        return RetrievedSlots(self, {**fields, "reader": reader})

    def store(
        self,
        request_id: str,
        tokens: TokenIds,
        kv: Any,
        *,
        model: str,
        worker_id: int = 0,
        start: int = 0,
        end: int | None = None,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
        resumable: Sequence[bool] = (),
    ) -> int:
        """Store chunks [start, end) of this rank from `kv` (num_chunks, *chunk_shape).

        `end` defaults to start + num_chunks * chunk_size. Returns the tokens now stored.
        `resumable` as in `store_slots`.
        """
        rows, fields = self._range(
            request_id, tokens, kv, "kv", model, worker_id, start, end, cache_salt, extra_key,
            world_size,
        )  # fmt: skip
        fields["resumable"] = [bool(r) for r in resumable]
        with StoreSlots(self, fields) as slots:
            copy_pairs([(view, rows[i]) for i, view in slots.targets()])
            return slots.commit()

    def retrieve(
        self,
        request_id: str,
        tokens: TokenIds,
        out: Any,
        *,
        model: str,
        worker_id: int = 0,
        start: int = 0,
        end: int | None = None,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
        reader: int = -1,
    ) -> int:
        """Copy this rank's shards of chunks [start, end) into `out` (num_chunks, *chunk_shape).

        Returns the tokens retrieved from `start`: it stops at the first chunk not cached.
        Raises LeaseExpiredError when the server's lease on the slots lapsed during the copy.
        `reader`: the rank marked done on the lookup's pin (-1: worker_id).
        """
        rows, fields = self._range(
            request_id, tokens, out, "out", model, worker_id, start, end, cache_salt, extra_key,
            world_size,
        )  # fmt: skip
        with RetrievedSlots(self, {**fields, "reader": reader}) as got:
            copy_pairs([(rows[i], view) for i, view in enumerate(got.views)])
        return got.num_tokens

    def _range(
        self,
        request_id: str,
        tokens: TokenIds,
        array: Any,
        what: str,
        model: str,
        worker_id: int,
        start: int,
        end: int | None,
        cache_salt: str,
        extra_key: bytes,
        world_size: int | None,
    ) -> tuple[npt.NDArray[np.uint8], dict[str, Any]]:
        """The array's chunk rows and the fields of a RangeRequest for it."""
        rows, shape, dtype = _chunk_rows(array, what, writable=what == "out")
        if end is not None and (end - start) % self.chunk_size == 0:
            # an explicit range may use only the leading rows of a larger array (e.g. `out`
            # sized for the whole prompt, `end=hit`); a smaller array is the server's to refuse
            rows = rows[: max(0, (end - start) // self.chunk_size)]
        num_chunks = rows.shape[0]
        end = start + num_chunks * self.chunk_size if end is None else end
        fields = self._fields(
            request_id, tokens, model, worker_id, start, end, shape, dtype, num_chunks,
            cache_salt, extra_key, world_size,
        )  # fmt: skip
        return rows, fields

    def _fields(
        self,
        request_id: str,
        tokens: TokenIds,
        model: str,
        worker_id: int,
        start: int,
        end: int,
        chunk_shape: Sequence[int],
        dtype: str,
        num_chunks: int,
        cache_salt: str,
        extra_key: bytes,
        world_size: int | None,
    ) -> dict[str, Any]:
        """The fields of a RangeRequest (the server checks them against the layout)."""
        return {
            "request_id": request_id,
            "tokens": _tokens(tokens),
            "model": model,
            "world_size": world_size or self._world_sizes.get(model, 1),
            "worker_id": worker_id,
            "start": start,
            "end": end,
            "chunk_shape": [int(d) for d in chunk_shape],
            "dtype": str(dtype).removeprefix("torch."),
            "num_chunks": num_chunks,
            "cache_salt": cache_salt,
            "extra_key": extra_key,
        }

    # -- key-addressed chunks (named by the caller, e.g. SGLang's page hashes) ---------------------

    def exists_keys(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
        prefill_tokens_per_s: float = 0.0,
    ) -> int:
        """How many leading named chunks every rank has stored (L2 hits are loaded into L1;
        with `prefill_tokens_per_s`, as for `lookup`, not those slower to load than recompute)."""
        names = check_names(names)
        msg = p.ExistsKeys(
            names,
            model,
            world_size,
            cache_salt,
            extra_key,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        raw, _ = self._call(msg)
        return reply_as(raw, p.ExistsReply, "ExistsKeys").num_chunks

    def exists_each_key(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        world_size: int = 1,
        cache_salt: str = "",
        extra_key: bytes = b"",
    ) -> list[bool]:
        """Per named chunk, whether every rank has stored it (past a missing one too; L2 hits
        are loaded into L1)."""
        names = check_names(names)
        request = p.ExistsKeys(names, model, world_size, cache_salt, extra_key, each=True)
        raw, _ = self._call(request)
        present = reply_as(raw, p.ExistsReply, "ExistsKeys").present
        if len(present) != len(names):
            raise ProtocolVersionError(
                f"the server answered {len(present)} flags for {len(names)} names: it predates "
                "ExistsKeys.each (upgrade the server)"
            )
        return present

    def store_key_slots(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        worker_id: int = 0,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
    ) -> StoreSlots:
        """Slots to write this rank's named chunks into; `with` commits them.

        As `store_slots`, with `targets()` indexing into `names` and `stored_chunks` counting
        the named chunks stored after the commit.
        """
        fields = self._key_fields(
            names, model, worker_id, chunk_shape, dtype, cache_salt, extra_key, world_size
        )
        return StoreSlots(self, fields, reserve=p.ReserveKeys, store_inline=p.StoreKeysInline)

    def retrieve_key_slots(
        self,
        names: Sequence[ChunkName],
        *,
        model: str,
        worker_id: int = 0,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
    ) -> RetrievedSlots:
        """Read-only views of this rank's leading stored named chunks (as `retrieve_slots`)."""
        fields = self._key_fields(
            names, model, worker_id, chunk_shape, dtype, cache_salt, extra_key, world_size
        )
        return RetrievedSlots(self, fields, retrieve=p.RetrieveKeys)

    def put_keys(
        self,
        names: Sequence[ChunkName],
        chunks: Any,
        *,
        model: str,
        worker_id: int = 0,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
    ) -> int:
        """Store this rank's named chunks from `chunks` (len(names), *chunk_shape).

        Returns how many of them are now stored (written now or already present).
        """
        names = check_names(names)
        rows, shape, dtype = _chunk_rows(chunks, "chunks", writable=False)
        if rows.shape[0] != len(names):
            raise BadArrayError(f"{len(names)} names but {rows.shape[0]} chunks in the array")
        if self._arena_bytes is None:  # inline: send the rows themselves, no staging copy
            fields = self._key_fields(
                names, model, worker_id, shape, dtype, cache_salt, extra_key, world_size
            )
            raw, _ = self._call(p.StoreKeysInline(**fields), [rows[i] for i in range(len(rows))])
            return reply_as(raw, p.StoreReply, "StoreKeysInline").stored_chunks
        slots = self.store_key_slots(
            names,
            model=model,
            worker_id=worker_id,
            chunk_shape=shape,
            dtype=dtype,
            cache_salt=cache_salt,
            extra_key=extra_key,
            world_size=world_size,
        )
        with slots:
            copy_pairs([(view, rows[i]) for i, view in slots.targets()])
        return slots.stored_chunks

    def get_keys(
        self,
        names: Sequence[ChunkName],
        out: Any,
        *,
        model: str,
        worker_id: int = 0,
        cache_salt: str = "",
        extra_key: bytes = b"",
        world_size: int | None = None,
    ) -> int:
        """Copy this rank's leading stored named chunks into `out` (>= len(names), *chunk_shape).

        Returns how many leading names were copied: it stops at the first one not stored.
        """
        names = check_names(names)
        rows, shape, dtype = _chunk_rows(out, "out", writable=True)
        if rows.shape[0] < len(names):
            raise BadArrayError(f"out holds {rows.shape[0]} chunks, fewer than {len(names)} names")
        with self.retrieve_key_slots(
            names,
            model=model,
            worker_id=worker_id,
            chunk_shape=shape,
            dtype=dtype,
            cache_salt=cache_salt,
            extra_key=extra_key,
            world_size=world_size,
        ) as got:
            copy_pairs([(rows[i], view) for i, view in enumerate(got.views)])
        return got.num_chunks

    def _key_fields(
        self,
        names: Sequence[ChunkName],
        model: str,
        worker_id: int,
        chunk_shape: Sequence[int],
        dtype: str,
        cache_salt: str,
        extra_key: bytes,
        world_size: int | None,
    ) -> dict[str, Any]:
        """The fields of a KeyRequest, names validated here before anything is sent."""
        checked = check_names(names)
        return {
            "names": checked,
            "model": model,
            "world_size": world_size or self._world_sizes.get(model, 1),
            "worker_id": worker_id,
            "chunk_shape": [int(d) for d in chunk_shape],
            "dtype": str(dtype).removeprefix("torch."),
            "num_chunks": len(checked),
            "cache_salt": cache_salt,
            "extra_key": extra_key,
        }

    def release(self, request_id: str, *, cache_salt: str = "") -> None:
        """Drop the request's lookup pins (the engine computed those chunks itself)."""
        self._call(p.Release(request_id, cache_salt))

    def end_session(self, request_id: str, *, cache_salt: str = "") -> None:
        """The request is finished: the server forgets its session and releases its pins.

        Without a credential, sessions are scoped by cache salt: pass the request's salt."""
        self._call(p.EndSession(request_id, cache_salt))

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

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

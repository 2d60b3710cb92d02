"""The attackers `make soak` mixes into its chaos: another tenant that floods and lies.

Each runs in its own process under the tenant `mallory` (its own credential), beside the honest
tenant's verified clients, and reports what the server granted it. None of them ever reads an
honest byte: the soak's verification counts what the honest clients read; these count what the
server let an attacker hold.

- `flood`: connections (Hellos with fresh client ids, dropped without Goodbye), sessions that
  are never ended, lookups whose pins are never released, reservations never committed, all at
  a bounded rate. The per-tenant shares must keep it from shedding honest sessions, taking the
  prefetch slots, or filling L1 with its pins and staging.
- `liar`: says Hello naming pid 1 and the server's own host id (copied from a first reply),
  asks for arena slots it could never touch, and vanishes without a word, again and again. The
  server must grant no slots to a pid it cannot prove, and a quarantine it causes must stay
  within its tenant's share.

- `conns`: idle tcp connections to the admin port by the hundred (never a byte sent),
  requests whose sequence frame is 1 MiB sent before any Hello and never read, and a layout
  registration per action until its client's bound.
- `events`: subscriptions of long random topics to the KV events, replay requests whose answers
  are never read, and malformed replay requests.

The honest side has a hazard of its own, in the run without attackers too: two of its clients
number requests from one small shared pool of request ids (see `soak_clients.worker`), so one id
is used at once for two prompts.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np

HONEST_TOKEN = "honest-" + "h" * 25
ATTACKER_TOKEN = "mallory-" + "m" * 24
TOKENS_FILE = f"{HONEST_TOKEN} honest\n{ATTACKER_TOKEN} mallory\n"
KINDS = ("flood", "liar", "conns", "events")
RATE_S = 0.005  # an attacker's pause between actions: a flood, not a busy loop on a shared CPU


def attacker(
    address: str,
    kind: str,
    seed: int,
    out: Any,
    stop: Any,
    shape: tuple[int, ...],
    ports: dict[str, int] | None = None,
) -> None:
    """One attacker process: `kind` until `stop` is set; reports its counters as it goes.
    `ports`: the server's admin, events and replay ports (tcp on loopback)."""
    counts: Counter[str] = Counter()
    rng = random.Random(seed)
    step = {"flood": _flood, "liar": _lie, "conns": _conns, "events": _events}[kind]
    state: dict[str, Any] = {"ports": ports or {}}
    last = 0.0
    try:
        while not stop.is_set():
            try:
                step(address, rng, counts, state, shape)
            except Exception as exc:  # a refusal is the expected answer to most of this
                counts[f"refused:{type(exc).__name__}"] += 1
            if time.monotonic() - last > 0.5:
                out.put((kind, os.getpid(), dict(counts)))
                last = time.monotonic()
            time.sleep(RATE_S)
    finally:
        out.put((kind, os.getpid(), dict(counts)))
        for sock in state.get("sockets", []):
            sock.close(linger=0)
        for sock in state.get("tcp", []):
            sock.close()
        client = state.get("client")
        if client is not None:
            client.close()


def _hello(address: str, *, pid: int, host_id: str, client_id: str | None = None) -> Any:
    """A raw DEALER socket that said Hello as tenant mallory; returns (socket, reply)."""
    import zmq

    from kvtier import protocol as p

    sock: Any = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(address)
    hello = p.Hello(
        p.PROTOCOL_VERSION,
        client_id or uuid.uuid4().hex,
        pid=pid,
        host_id=host_id,
        token=ATTACKER_TOKEN,
    )
    sock.send_multipart([b"\0" * 8, p.encode(hello)])
    frames = sock.recv_multipart()
    return sock, p.decode_reply(frames[1])


def _call(sock: Any, msg: Any) -> Any:
    from kvtier import protocol as p

    sock.send_multipart([b"\1" * 8, p.encode(msg)])
    return p.decode_reply(sock.recv_multipart()[1])


def _flood(
    address: str, rng: random.Random, counts: Counter[str], state: dict[str, Any], shape: Any
) -> None:
    from kvtier import protocol as p
    from kvtier.client import Client

    action = rng.choice(("hello", "session", "pin", "stage"))
    counts[action] += 1
    if action == "hello":  # connections that are never closed: descriptors and client ids
        sockets = state.setdefault("sockets", [])
        sock, reply = _hello(address, pid=os.getpid(), host_id=p.local_host_id())
        if isinstance(reply, p.HelloReply):
            counts["hello_accepted"] += 1
        sockets.append(sock)
        if len(sockets) > 500:  # keep the attacker's own descriptors bounded
            sockets.pop(0).close(linger=0)
        return
    client = state.get("client")
    if client is None:
        client = state["client"] = Client(address, token=ATTACKER_TOKEN, timeout=5)
        client.register(model="soak", chunk_shape=shape, dtype="float16")
    n = rng.randrange(64)
    tokens = list(range(7_000_000 + n * 1000, 7_000_000 + n * 1000 + 4 * shape[2]))
    kv = np.zeros((4, *shape), dtype=np.float16)
    if action == "session":  # a session per request, never ended
        client.lookup(uuid.uuid4().hex, tokens, model="soak")
    elif action == "pin":  # store, then look up under fresh ids: pins nobody releases
        client.store(uuid.uuid4().hex, tokens, kv, model="soak")
        counts["pinned_tokens"] += client.lookup(uuid.uuid4().hex, tokens, model="soak")
    else:  # reservations never committed: staging slots held until the lease ends
        reply, _ = client.connection.call(
            p.Reserve(uuid.uuid4().hex, np.asarray(tokens, np.uint32).tobytes(), "soak", 1, 0,
                      0, 4 * shape[2], list(shape), "float16", 4)
        )  # fmt: skip
        if isinstance(reply, p.ReserveReply):
            counts["staged_chunks"] += sum(1 for o in reply.offsets if o >= 0)


def _lie(
    address: str, rng: random.Random, counts: Counter[str], state: dict[str, Any], shape: Any
) -> None:
    from kvtier import protocol as p

    if "host_id" not in state:  # copy the server's host id from an honest-looking Hello
        sock, reply = _hello(address, pid=os.getpid(), host_id="")
        sock.close(linger=0)
        if not isinstance(reply, p.HelloReply):
            raise RuntimeError(f"the liar's first Hello was refused: {reply}")
        state["host_id"] = reply.host_id
    sock, reply = _hello(address, pid=1, host_id=state["host_id"])
    try:
        counts["hellos"] += 1
        if not isinstance(reply, p.HelloReply):
            return
        _call(sock, p.Register("soak", 1, 0, list(shape), "float16"))
        n = rng.randrange(1 << 30)
        tokens = np.arange(n, n + 8 * shape[2], dtype=np.uint32).tobytes()
        reserve = p.Reserve(uuid.uuid4().hex, tokens, "soak", 1, 0, 0, 8 * shape[2],
                            list(shape), "float16", 8)  # fmt: skip
        got = _call(sock, reserve)
        if isinstance(got, p.ReserveReply):
            counts["liar_granted_slots"] += sum(1 for o in got.offsets if o >= 0)
        else:
            counts["liar_refused_slots"] += 1
    finally:
        sock.close(linger=0)  # vanish: no Goodbye, no Abort


def _conns(
    address: str, rng: random.Random, counts: Counter[str], state: dict[str, Any], shape: Any
) -> None:
    import socket

    import zmq

    from kvtier import protocol as p
    from kvtier.client import Client

    action = rng.choice(("idle", "echo", "register"))
    counts[action] += 1
    if action == "idle":  # descriptors: connections to the admin port that never speak
        held = state.setdefault("tcp", [])
        for _ in range(20):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(OSError):
                s.connect(("127.0.0.1", state["ports"]["admin"]))
            held.append(s)
        while len(held) > 400:
            held.pop(0).close()
    elif action == "echo":  # big sequence frames before any Hello, replies never read
        sock = state.get("echo")
        if sock is None:
            sock = state["echo"] = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.connect(address)
            state.setdefault("sockets", []).append(sock)
        sock.send_multipart([b"q" * (1 << 20), p.encode(p.Heartbeat())], zmq.NOBLOCK)
    else:  # a layout per action, until the client's bound
        client = state.get("client")
        if client is None:
            client = state["client"] = Client(address, token=ATTACKER_TOKEN, timeout=5)
        n = state["registered"] = state.get("registered", 0) + 1
        client.register(model=f"reg-{n}", chunk_shape=shape, dtype="float16")
        counts["registered"] += 1


def _events(
    address: str, rng: random.Random, counts: Counter[str], state: dict[str, Any], shape: Any
) -> None:
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    action = rng.choice(("subscribe", "replay", "malformed"))
    counts[action] += 1
    if action == "subscribe":  # long random subscriptions, on one connection
        sub = state.get("sub")
        if sub is None:
            sub = state["sub"] = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 1)
            sub.connect(f"tcp://127.0.0.1:{state['ports']['events']}")
            state.setdefault("sockets", []).append(sub)
        for _ in range(50):
            sub.setsockopt(zmq.SUBSCRIBE, rng.randbytes(1000))
        return
    peers = state.setdefault("replays", [])
    if len(peers) < 16:
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.RCVHWM, 1)
        peer.connect(f"tcp://127.0.0.1:{state['ports']['replay']}")
        peers.append(peer)
        state.setdefault("sockets", []).append(peer)
    peer = rng.choice(peers)
    start = (0).to_bytes(8, "big") if action == "replay" else b"bad"
    peer.send_multipart((b"", start), zmq.NOBLOCK)  # answers never read

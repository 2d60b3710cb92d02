"""KV events from a real server, followed as a router follows them: a subscriber on vLLM's own
decoder (`kv_follower`) rebuilds, per medium and locality, what the server holds, through
stores, L1 evictions into the disk tier, a shared store's TTL expiry, a clear, a restart and a
subscriber that joins late and replays; subscribers that stall or die hold nothing up, and one
that misses batches sees the gap and replays them; and the block hashes are vLLM's own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from testkit.admin import changes
from testkit.kv import CS, SHAPE, kv_for
from testkit.kv_servers import start_kv_server
from testkit.servers import ServerProcess, free_port
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.keys import decompose
from kvtier.server.observe.event_wire import published_hash

from .kv_follower import BlockStored, Follower, Hash

PREFIX = "evt"
TTL_S = 3
CHUNKS = 8  # per prompt
SEED = "0"  # --hash-seed: vLLM's PYTHONHASHSEED

Places = dict[tuple[str, str], set[Hash]]
CPU, DISK, SHARED = ("CPU", "LOCAL"), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")


@pytest.fixture
def notifying_redis() -> Iterator[redis.Redis]:
    """A private Redis that publishes expired and evicted key events (the tier follows them)."""
    port = free_port()
    proc = start_kv_server("redis", port, "--notify-keyspace-events", "Exe")
    try:
        yield redis.Redis(port=port)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def ipc_pair() -> Iterator[tuple[str, str]]:
    """A PUB and a replay ipc:// endpoint, their socket files removed afterwards."""
    tag = uuid.uuid4().hex[:8]
    paths = [f"/tmp/kvtier-ev-{tag}.pub", f"/tmp/kvtier-ev-{tag}.rep"]
    yield f"ipc://{paths[0]}", f"ipc://{paths[1]}"
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def prompt(i: int) -> list[int]:
    return [(i * 100_003 + t * 7919) % 150_000 for t in range(CHUNKS * CS)]


def store(server: ServerProcess, i: int, *, salt: str = "") -> None:
    with Client(server.address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        stored = c.store(f"r{i}", prompt(i), kv_for(i, CHUNKS), model="m", cache_salt=salt)
        assert stored == CHUNKS * CS


def held(server: ServerProcess, r: redis.Redis) -> Places:
    """What the server holds, per place: the L1 and the disk tier through the admin API, the
    shared store by its keys (a Redis cannot be listed through kvtier)."""
    assert server.admin_url is not None

    def listed(tier: str) -> set[Hash]:
        reply = httpx.get(f"{server.admin_url}/chunks?tier={tier}&limit=100000", timeout=10)
        assert reply.status_code == 200, reply.text
        return {external(c["chunk_hash"], c["cache_salt"]) for c in reply.json()["chunks"]}

    shared = set()
    for name in r.scan_iter(f"{PREFIX}:*"):  # PREFIX:{model_hex.salt_hex}:ws.worker.hash_hex
        salt_hex = name.split(b"}", 1)[0].rsplit(b".", 1)[1].decode()
        salt = bytes.fromhex(salt_hex).decode()
        client_salt = decompose(salt)[-1] if salt else ""
        shared.add(external(name.rsplit(b".", 1)[1].decode(), client_salt))
    return {CPU: listed("l1"), DISK: listed("disk"), SHARED: shared}


def external(chunk_hash_hex: str, salt: str = "") -> Hash:
    """A chunk name as vLLM publishes a block hash (its own conversion, default settings); a
    salted chunk's name is first mixed with its salt, as the events publish it."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    name = bytes.fromhex(chunk_hash_hex)
    if salt:
        mixed = published_hash(name, salt, as_int=False)
        assert isinstance(mixed, bytes)
        name = mixed
    converted: Hash = maybe_convert_block_hash(BlockHash(name))
    return converted


def view(follower: Follower) -> Places:
    return {place: follower.hashes(*place) for place in (CPU, DISK, SHARED)}


def converges(follower: Follower, server: ServerProcess, r: redis.Redis) -> bool:
    """Whether the follower's view comes to equal what the server holds (both re-read)."""

    def same() -> bool:
        follower.poll(0.1)
        return view(follower) == held(server, r)

    return wait_for(same, timeout=20)


def differences(follower: Follower, server: ServerProcess, r: redis.Redis) -> dict[str, Any]:
    """Per place: how many hashes the follower has that the server does not, and the reverse."""
    seen, truth = view(follower), held(server, r)
    return {
        f"{place}": (len(seen[place] - truth[place]), len(truth[place] - seen[place]))
        for place in seen
    } | {"seq": follower.next_seq, "gaps": follower.gaps, "restarts": follower.restarts}


def vllm_hashes(tokens: list[int]) -> list[Hash]:
    """vLLM's block hashes for `tokens` as it publishes them, from vLLM's own functions
    (sha256_cbor, a block size of the chunk size, PYTHONHASHSEED=SEED, no extra keys)."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils

    previous = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = SEED
    try:
        kv_cache_utils.init_none_hash(sha256_cbor)
        parent = kv_cache_utils.NONE_HASH
    finally:
        if previous is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = previous
    out = []
    for start in range(0, len(tokens), CS):
        parent = kv_cache_utils.hash_block_tokens(
            sha256_cbor, parent, tokens[start : start + CS], None
        )
        out.append(kv_cache_utils.maybe_convert_block_hash(parent))
    return out


def stored_events(follower: Follower, place: tuple[str, str]) -> list[BlockStored]:
    return [e for _, e in follower.stored if (e.medium, e.locality) == place]


Block = tuple[Hash | None, list[int], Any]  # parent, tokens, extra keys


def per_block(events: list[BlockStored]) -> dict[Hash, Block]:
    """Each stored block's parent, tokens and extra keys, read as a router reads an event that
    covers several blocks (a chain from `parent_block_hash`, `block_size` tokens each)."""
    out: dict[Hash, Block] = {}
    for e in events:
        assert e.block_size == CS
        assert e.extra_keys is not None and len(e.extra_keys) == len(e.block_hashes)
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            out[h] = (parent, e.token_ids[i * CS : (i + 1) * CS], e.extra_keys[i])
            parent = h
    return out


def test_a_follower_rebuilds_what_the_server_holds(
    server_factory: Callable[..., ServerProcess],
    notifying_redis: redis.Redis,
    tmp_path: Path,
    ipc_pair: tuple[str, str],
) -> None:
    r = notifying_redis
    port = r.connection_pool.connection_kwargs["port"]
    pub, rep = ipc_pair
    args: tuple[Any, ...] = (
        "--chunk-size", str(CS), "--l1-size", "128KiB",
        "--hash-algorithm", "sha256_cbor", "--hash-seed", SEED,
        "--l2", f"disk://{tmp_path}/l2?size=64MiB",
        "--l2", f"redis://127.0.0.1:{port}/0?prefix={PREFIX}&ttl={TTL_S}",
        "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep,
        "--kv-events-topic", "kvtier/",
    )  # fmt: skip
    server = server_factory(*args)
    early = Follower(pub, rep, "kvtier/")
    late: Follower | None = None
    try:
        early.replay(0)  # what came before the subscription took
        # stores: 5 prompts of 8 chunks into a 32-chunk L1, written through to disk and Redis
        store(server, 0, salt="tenant-salt")
        for i in range(1, 5):
            store(server, i)
        assert converges(early, server, r), differences(early, server, r)
        seen = view(early)
        assert len(seen[DISK]) == 5 * CHUNKS
        assert 0 < len(seen[CPU]) < 5 * CHUNKS  # the L1 evicted; the disk tier kept them all
        assert len({h for e in stored_events(early, CPU) for h in e.block_hashes}) == 5 * CHUNKS

        # every chunk became complete in Redis before it expired
        shared = {h for e in stored_events(early, SHARED) for h in e.block_hashes}
        assert len(shared) == 5 * CHUNKS

        # the hashes are vLLM's; tokens, parent, block size and extra keys as vLLM fills them
        blocks = per_block(stored_events(early, CPU))
        tokens = prompt(1)
        parent: Hash | None = None
        for i, h in enumerate(vllm_hashes(tokens)):
            assert blocks[h] == (parent, tokens[i * CS : (i + 1) * CS], None), i
            parent = h
        salted = [b for b in blocks.values() if b[2] is not None]
        assert salted == [(None, prompt(0)[:CS], ("tenant-salt",))]

        # the shared store's TTL runs out: the server's expiry events reach the follower
        assert wait_for(lambda: not list(r.scan_iter(f"{PREFIX}:*")), timeout=20)
        assert converges(early, server, r), differences(early, server, r)
        assert view(early)[SHARED] == set()

        # a subscriber that joins late rebuilds the same view from the replay buffer
        late = Follower(pub, rep, "kvtier/")
        assert late.replay(0) >= 1
        assert converges(late, server, r), differences(late, server, r)
        assert view(late) == view(early)

        # a clear empties every place
        assert server.admin_url is not None
        reply = httpx.post(server.admin_url + "/clear", headers=changes(server), json={})
        assert reply.status_code == 200
        assert converges(early, server, r), differences(early, server, r)
        assert view(early) == {CPU: set(), DISK: set(), SHARED: set()}

        # a restart: the disk tier's chunks survive, and the stream says so
        store(server, 5)
        store(server, 6)
        assert converges(early, server, r), differences(early, server, r)
        assert server.stop() == 0
        server = server_factory(*args)
        store(server, 7)  # the follower learns of the restart from the next batch
        assert converges(early, server, r), differences(early, server, r)
        assert early.restarts == 1
        assert len(view(early)[DISK]) == 3 * CHUNKS
        assert len(view(early)[CPU]) == CHUNKS
        assert set(vllm_hashes(prompt(5)) + vllm_hashes(prompt(6))) <= view(early)[DISK]
    finally:
        early.close()
        if late is not None:
            late.close()


# -- subscribers that stall, and one that misses batches -----------------------------------------

_STALLED_SUBSCRIBER = """
import sys, time, zmq
sub = zmq.Context().socket(zmq.SUB)
sub.setsockopt(zmq.RCVHWM, 1)
sub.setsockopt(zmq.RCVBUF, 4096)
sub.connect(sys.argv[1])
sub.setsockopt(zmq.SUBSCRIBE, b"")
print("subscribed", flush=True)
time.sleep(3600)  # stalled on purpose (SIGSTOPped or killed): never reads again
"""


def test_a_stalled_subscriber_holds_nothing_up_and_one_that_misses_batches_replays_them(
    server_factory: Callable[..., ServerProcess], ipc_pair: tuple[str, str]
) -> None:
    pub, rep = ipc_pair
    server = server_factory(
        "--chunk-size", str(CS), "--l1-size", "64MiB",
        "--hash-algorithm", "sha256_cbor", "--hash-seed", SEED,
        "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep,
        "--kv-events-topic", "kvtier/", "--kv-events-buffer", "10000",
    )  # fmt: skip
    assert server.admin_url is not None

    def in_l1() -> set[Hash]:
        reply = httpx.get(f"{server.admin_url}/chunks?tier=l1&limit=100000", timeout=10)
        assert reply.status_code == 200, reply.text
        return {external(c["chunk_hash"]) for c in reply.json()["chunks"]}

    def caught_up() -> bool:
        follower.poll(0.1)
        return follower.hashes(*CPU) == in_l1()

    # a subscriber that stops reading for good (paused: its socket fills, then the server's
    # queue for it), and one killed while subscribed
    stalled = [
        subprocess.Popen([sys.executable, "-c", _STALLED_SUBSCRIBER, pub], stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    follower = Follower(pub, rep, "kvtier/")
    try:
        for proc in stalled:
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"subscribed"
        stalled[0].send_signal(signal.SIGSTOP)
        stalled[1].kill()
        follower.replay(0)
        for i in range(12):  # stores and their events go on
            store(server, i)
        assert wait_for(caught_up, timeout=20), (len(follower.hashes(*CPU)), len(in_l1()))
        assert follower.gaps == 0

        # a follower away while batches are published sees the gap in the live stream when it
        # is back, and replays what it missed
        follower.disconnect()
        for i in range(12, 24):
            store(server, i)
        follower.reconnect()
        more = iter(range(24, 64))

        def live_again() -> bool:  # one more store, until its batch comes in live
            store(server, next(more))
            return follower.poll(0.2) > 0

        assert wait_for(live_again, timeout=30)
        assert follower.gaps >= 1 and follower.replays >= 2
        assert wait_for(caught_up, timeout=20), (len(follower.hashes(*CPU)), len(in_l1()))
        missed = set(vllm_hashes(prompt(12)) + vllm_hashes(prompt(23)))
        assert missed <= follower.hashes(*CPU)
        health = httpx.get(f"{server.admin_url}/health", timeout=10).json()
        assert health == {"status": "ok"}, health
    finally:
        for proc in stalled:
            proc.kill()
            proc.wait()
        follower.close()


# -- a router consuming the events: Dynamo's standalone KV indexer ------------------------------

DYNAMO_HINT = (
    "Dynamo's KV indexer runs from its own venv: `make install-test` makes it "
    "({venv}/dynamo: python -m venv, then pip install ai-dynamo-runtime==1.6.1), or point "
    "KVTIER_DYNAMO_PYTHON at a python that can run `python -m dynamo.indexer`"
)


def dynamo_python() -> str:
    """The python of the venv Dynamo's runtime is installed in; fails saying how to get it."""
    venv = Path(__file__).resolve().parents[2] / ".venv"
    python = os.environ.get("KVTIER_DYNAMO_PYTHON") or str(venv / "dynamo" / "bin" / "python")
    probe = (
        subprocess.run(
            [python, "-c", "import dynamo.llm"], capture_output=True, text=True, timeout=120
        )
        if Path(python).exists()
        else None
    )
    if probe is None or probe.returncode != 0:
        pytest.fail(DYNAMO_HINT.format(venv=venv), pytrace=False)
    return python


def indexer_query(port: int, tokens: list[int]) -> dict[str, int]:
    """Dynamo's answer to "which worker holds the longest prefix of these tokens": tokens
    matched per worker id."""
    reply = httpx.post(
        f"http://127.0.0.1:{port}/query", json={"token_ids": tokens, "model_name": "m"}, timeout=10
    )
    assert reply.status_code == 200, reply.text
    return {w: info["longest_matched"] for w, info in reply.json()["instances"].items()}


def test_dynamos_kv_indexer_routes_on_kvtiers_events(
    server_factory: Callable[..., ServerProcess],
) -> None:
    python = dynamo_python()
    ports = [free_port(), free_port()]
    args = ("--chunk-size", str(CS), "--hash-algorithm", "sha256_cbor", "--hash-seed", SEED)
    servers = [server_factory(*args, "--kv-events-endpoint", f"tcp://*:{port}") for port in ports]
    http = free_port()
    workers = ",".join(f"{i + 1}=tcp://127.0.0.1:{port}" for i, port in enumerate(ports))
    indexer = subprocess.Popen(
        [python, "-m", "dynamo.indexer", "--port", str(http), "--block-size", str(CS),
         "--workers", workers, "--model-name", "m", "--threads", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert wait_for(lambda: _healthy(http)), "Dynamo's indexer did not start"
        # Dynamo's listener connects when it starts: store until it has seen the first server
        assert wait_for(lambda: _stored_and_seen(servers[0], 1, http, "1"), timeout=30)
        store(servers[1], 2)
        assert wait_for(lambda: indexer_query(http, prompt(2)).get("2") == CHUNKS * CS)
        # each prompt routes to the server that holds it; a shared prefix counts as far as it goes
        assert best(indexer_query(http, prompt(1))) == "1"
        assert best(indexer_query(http, prompt(2))) == "2"
        half = prompt(1)[: 3 * CS] + prompt(3)[3 * CS :]
        assert indexer_query(http, half).get("1") == 3 * CS
        assert not any(indexer_query(http, prompt(3)).values())
        # a clear reaches the router: the prompt routes nowhere any more
        assert servers[0].admin_url is not None
        httpx.post(servers[0].admin_url + "/clear", headers=changes(servers[0]), json={})
        assert wait_for(lambda: not indexer_query(http, prompt(1)).get("1"))
    finally:
        indexer.kill()
        indexer.wait()


def best(matched: dict[str, int]) -> str:
    """The worker a prefix-aware router sends the request to: the longest match."""
    return max(matched.items(), key=lambda item: item[1])[0]


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _stored_and_seen(server: ServerProcess, i: int, port: int, worker: str) -> bool:
    """Store prompt `i` (again: a store of stored chunks publishes nothing new, so each try
    uses a fresh request id's session) and say whether the indexer has it."""
    store(server, i)
    if indexer_query(port, prompt(i)).get(worker) == CHUNKS * CS:
        return True
    # the listener was not connected yet: clear and store again, so the events go out anew
    assert server.admin_url is not None
    httpx.post(server.admin_url + "/clear", headers=changes(server), json={})
    return False


# -- vLLM 0.33 reads the same bytes ----------------------------------------------------------------

_DECODE_033 = """
import sys, msgspec, vllm
from vllm.distributed.kv_events import KVEventBatch
assert vllm.__version__ == "0.33.0", vllm.__version__
payloads = msgspec.msgpack.decode(open(sys.argv[1], "rb").read())
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
print(msgspec.json.encode([msgspec.to_builtins(decoder.decode(p)) for p in payloads]).decode())
"""


def test_vllm_033_decodes_the_batches_as_032_does(
    tmp_path: Path, ipc_pair: tuple[str, str]
) -> None:
    import msgspec
    from testkit.vllm033 import FOLDER, HOW, env
    from vllm.distributed.kv_events import KVEventBatch

    from kvtier.keys import ChunkKey, compose
    from kvtier.server.observe.chunk_notes import ChunkNotes
    from kvtier.server.observe.events import EventPublisher, Place
    from kvtier.storage.observers import Removal

    if not (FOLDER / "vllm" / "__init__.py").exists():
        pytest.fail(HOW, pytrace=False)
    pub, rep = ipc_pair
    notes = ChunkNotes(16)
    publisher = EventPublisher(
        pub, replay_endpoint=rep, topic="kvtier/", buffer_batches=16, chunk_size=CS,
        places={"disk": Place("STORAGE", "LOCAL")}, notes=notes,
    )  # fmt: skip
    chain = [ChunkKey(compose("", "m"), compose("", "s"), 1, bytes([i]) * 32) for i in range(3)]
    notes.note(chain, None, b"".join(t.to_bytes(4, "little") for t in prompt(9)[: 3 * CS]), CS)
    follower = Follower(pub, rep, "kvtier/")
    try:
        publisher.start()
        publisher.stored(chain, "l1")
        publisher.stored(chain[:2], "disk")
        publisher.removed(chain[:1], "l1", Removal.EVICTED)
        publisher.cleared("redis", None, None)
        assert publisher.flush()
        assert follower.replay(0) >= 1
        payloads = follower.payloads
    finally:
        follower.close()
        publisher.close()
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    with_032 = [msgspec.to_builtins(decoder.decode(p)) for p in payloads]
    assert any(e.get("type") == "BlockRemoved" for b in with_032 for e in b[1])
    (tmp_path / "payloads").write_bytes(msgspec.msgpack.encode(payloads))
    out = subprocess.run(
        [sys.executable, "-c", _DECODE_033, str(tmp_path / "payloads")],
        env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    # both through JSON, where a tuple and a list are one thing
    with_033 = msgspec.json.decode(out.stdout.strip().splitlines()[-1])
    assert with_033 == msgspec.json.decode(msgspec.json.encode(with_032))

"""A hybrid model's KV events, fed to Dynamo's KV indexer: a prefix a router scores is one
kvtier's lookup then serves.

A kvtier chunk holds every KV cache group's piece (full attention, sliding window, MLA, indexer,
Mamba state), so each chunk is one block in the events, announced once every group's piece is
stored. For a model with a Mamba / linear-attention group only a chunk at whose end vLLM kept
the recurrent state is a point a lookup resumes after (the connector stores the others with
`resumable` False); those others are never announced, so a router never counts a prefix whose
Mamba state is missing. The stores here are the connector's: one long prefill step (only its
last chunk has a state), steps of two chunks, steps of one chunk. The engine registered its KV
cache groups, so each chunk is announced once per group, labelled as vLLM labels its own
(`group_idx`, `kv_cache_spec_kind`)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable

import numpy as np
from testkit.kv import CS, SHAPE, kv_for
from testkit.servers import ServerProcess, free_port
from testkit.waiting import wait_for

from kvtier.client import Client
from kvtier.protocol import KVGroup

from .test_kv_events import SEED, dynamo_python, indexer_query

CHUNKS = 8
GROUPS = [KVGroup(0, "mamba"), KVGroup(1, "full_attention")]


def prompt(i: int, n: int = CHUNKS) -> list[int]:
    return [(i * 100_003 + t * 7919) % 150_000 for t in range(n * CS)]


def store(
    server: ServerProcess, i: int, flags: list[bool], tokens: list[int] | None = None
) -> None:
    tokens = prompt(i) if tokens is None else tokens
    with Client(server.address) as c:
        # the groups a Qwen3-Next-like engine registers: each chunk is announced per group
        c.register(model="m", chunk_shape=SHAPE, dtype="float16", kv_groups=GROUPS)
        n = len(tokens) // CS
        rid = f"r{i}-{uuid.uuid4().hex[:6]}"
        assert c.store(rid, tokens, kv_for(i, n), model="m", resumable=flags) == n * CS


def served(server: ServerProcess, tokens: list[int]) -> int:
    """Tokens kvtier's lookup serves for `tokens` (its pins released right after)."""
    with Client(server.address) as c:
        rid = f"q-{uuid.uuid4().hex[:8]}"
        hit = c.lookup(rid, np.asarray(tokens, dtype=np.uint32), model="m")
        c.end_session(rid)
        return hit


def _healthy(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_dynamo_never_scores_a_hybrid_prefix_kvtier_would_not_serve(
    server_factory: Callable[..., ServerProcess],
) -> None:
    python = dynamo_python()
    port, http = free_port(), free_port()
    server = server_factory(
        "--chunk-size", str(CS), "--hash-algorithm", "sha256_cbor", "--hash-seed", SEED,
        "--kv-events-endpoint", f"tcp://*:{port}",
    )  # fmt: skip
    indexer = subprocess.Popen(
        [python, "-m", "dynamo.indexer", "--port", str(http), "--block-size", str(CS),
         "--workers", f"1=tcp://127.0.0.1:{port}", "--model-name", "m", "--threads", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert wait_for(lambda: _healthy(http)), "Dynamo's indexer did not start"

        def seen() -> bool:  # the listener connects when it starts: store until it has one
            store(server, 0, [True] * CHUNKS)
            if indexer_query(http, prompt(0)).get("1") == CHUNKS * CS:
                return True
            assert server.admin_url is not None
            import httpx
            from testkit.admin import changes

            httpx.post(server.admin_url + "/clear", headers=changes(server), json={})
            return False

        assert wait_for(seen, timeout=30)
        one_step = [False] * (CHUNKS - 1) + [True]  # one long prefill step: a state at its end
        two_steps = [i % 2 == 1 for i in range(CHUNKS)]  # steps of two chunks
        store(server, 1, one_step)
        store(server, 2, two_steps)
        store(server, 3, [True] * CHUNKS)  # steps of one chunk: every chunk a resume point
        # the events go out in order: once the last store is seen, the others were handled
        assert wait_for(lambda: indexer_query(http, prompt(3)).get("1") == CHUNKS * CS)
        queries = {
            "one step": prompt(1),
            "one step, 3 chunks shared": prompt(1)[: 3 * CS] + prompt(9)[3 * CS :],
            "two steps": prompt(2),
            "two steps, 3 chunks shared": prompt(2)[: 3 * CS] + prompt(9)[3 * CS :],
            "one-chunk steps": prompt(3),
            "one-chunk steps, 5 chunks shared": prompt(3)[: 5 * CS] + prompt(9)[5 * CS :],
            "unknown": prompt(9),
        }
        scores = {
            name: (indexer_query(http, q).get("1", 0), served(server, q))
            for name, q in queries.items()
        }
        for name, (scored, hit) in scores.items():
            assert scored <= hit, f"{name}: Dynamo scores {scored} tokens, kvtier serves {hit}"
        # what kvtier serves: the chunks up to the last resume point
        assert scores["one step, 3 chunks shared"] == (0, 0)  # no Mamba state before chunk 8
        assert scores["two steps, 3 chunks shared"][1] == 2 * CS
        assert scores["one-chunk steps, 5 chunks shared"] == (5 * CS, 5 * CS)
        assert scores["one step"][1] == scores["two steps"][1] == CHUNKS * CS
        # a later store with a state at every chunk's end makes the prompt a prefix everywhere
        store(server, 1, [True] * CHUNKS)
        assert wait_for(lambda: indexer_query(http, prompt(1)).get("1") == CHUNKS * CS)
        shared = queries["one step, 3 chunks shared"]
        assert indexer_query(http, shared).get("1") == served(server, shared) == 3 * CS
    finally:
        indexer.kill()
        indexer.wait()


def test_a_registered_engines_events_carry_vllms_group_labels(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Decoded with vLLM's own classes: each stored chunk chain of a model whose engine named
    its KV cache groups comes once per group, with `group_idx`, the kind and the window."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    tag = uuid.uuid4().hex[:8]
    endpoint = f"ipc:///tmp/kvtier-groups-{tag}.pub"
    server = server_factory("--chunk-size", str(CS), "--kv-events-endpoint", endpoint)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    groups = [KVGroup(0, "sliding_window", 1024), KVGroup(1, "full_attention")]
    labels: list[tuple[int | None, str | None, int | None]] = []
    try:

        def heard() -> bool:  # the subscriber joins when it joins: store until it hears
            with Client(server.address) as c:
                c.register(model="g", chunk_shape=SHAPE, dtype="float16", kv_groups=groups)
                rid = f"r-{uuid.uuid4().hex[:6]}"
                tokens = [(t * 31 + len(labels)) % 50_000 for t in range(2 * CS)]
                c.store(rid, tokens, kv_for(7, 2), model="g")
            while sub.poll(500):
                _, _, payload = sub.recv_multipart()
                for e in decoder.decode(payload).events:
                    if isinstance(e, BlockStored):
                        labels.append(
                            (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
                        )
            return bool(labels)

        assert wait_for(heard, timeout=30)
        assert labels[:2] == [(0, "sliding_window", 1024), (1, "full_attention", None)]
    finally:
        sub.close(linger=0)
        ctx.term()


def test_malformed_kv_groups_are_refused_with_a_typed_error(server: ServerProcess) -> None:
    from kvtier.errors import InvalidArgumentError

    bad = {
        "repeated index": [KVGroup(0, "mamba"), KVGroup(0, "full_attention")],
        "too many": [KVGroup(i, "full_attention") for i in range(65)],
        "long kind": [KVGroup(0, "x" * 65)],
        "negative window": [KVGroup(0, "sliding_window", -1)],
    }
    with Client(server.address) as c:
        for what, groups in bad.items():
            try:
                c.register(model="bad", chunk_shape=SHAPE, dtype="float16", kv_groups=groups)
            except InvalidArgumentError as exc:
                assert "kv_groups" in str(exc), (what, exc)
            else:
                raise AssertionError(f"{what}: accepted")
        c.register(model="bad", chunk_shape=SHAPE, dtype="float16", kv_groups=GROUPS)

"""The soak's honest clients (`benchmarks.soak`): processes that loop over verified lookups,
stores and retrieves of a fixed set of prompts whose KV bytes are a pure function of the prompt
(`expected`), so every byte any client retrieves is checked against what it must be."""

from __future__ import annotations

import contextlib
import os
import random
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np

from benchmarks.soak_attacks import HONEST_TOKEN

CS = 16
SHAPE = (8, 2, CS, 4, 8)  # 16 KiB per chunk in float16
CHUNK_BYTES = 2 * int(np.prod(SHAPE))
NUM_PROMPTS = 96


def expected(n: int) -> np.ndarray:
    """The KV bytes of prompt n: a pure function of n, so any process can check any retrieve."""
    chunks = 1 + n % 4
    raw = np.random.default_rng(n).bytes(chunks * CHUNK_BYTES)
    return np.frombuffer(raw, dtype=np.float16).reshape(chunks, *SHAPE).copy()


def tokens_of(n: int) -> list[int]:
    return list(range(n * 10_000, n * 10_000 + (1 + n % 4) * CS))


def worker(address: str, wid: int, seed: int, out: Any, stop: Any, shared_rids: bool) -> None:
    """One honest client process: verified lookups, retrieves and stores until `stop` is set,
    reporting its counters and each operation's latency. With `shared_rids` its request ids
    come from a small pool that another such client draws from too."""
    from kvtier.client import Client
    from kvtier.errors import KVTierError

    rng = random.Random(seed)
    cache = {n: expected(n) for n in range(NUM_PROMPTS)}
    c: Any = None
    counts: Counter[str] = Counter()
    latencies: list[float] = []
    last_report = 0.0
    while not stop.is_set():
        if time.monotonic() - last_report > 0.5:
            out.put((wid, os.getpid(), dict(counts), latencies))
            latencies = []
            last_report = time.monotonic()
        t0 = time.perf_counter()
        try:
            if c is None:
                c = Client(address, timeout=5, connect_timeout=2, token=HONEST_TOKEN)
                c.register(model="soak", chunk_shape=SHAPE, dtype="float16")
            _one_op(c, rng, cache, counts, shared_rids)
        except KVTierError as exc:
            counts[f"error:{type(exc).__name__}"] += 1
            time.sleep(0.05)
        latencies.append(time.perf_counter() - t0)
    out.put((wid, os.getpid(), dict(counts), latencies))
    if c is not None:
        c.close()


def _one_op(
    c: Any,
    rng: random.Random,
    cache: dict[int, np.ndarray],
    counts: Counter[str],
    shared_rids: bool = False,
) -> None:
    n = rng.randrange(NUM_PROMPTS)
    kv, tokens = cache[n], tokens_of(n)
    rid = f"shared-{rng.randrange(4)}" if shared_rids else uuid.uuid4().hex
    counts["ops"] += 1
    # A third of the copies go through the slot API with a pause between being granted the
    # slots and touching them, so a SIGSTOP often lands while a client holds slots.
    slow = rng.random() < 0.33
    try:
        if rng.random() < 0.35:
            epoch = c.server.server_id
            if slow:
                stored = _slow_store(c, rid, tokens, kv, rng)
            else:
                stored = c.store(rid, tokens, kv, model="soak")
            counts["stores"] += 1
            counts["acked_chunks"] += stored // CS
            if stored:
                hit = c.lookup(rid + "-check", tokens, model="soak")
                c.end_session(rid + "-check")
                if c.server.server_id == epoch and hit < stored:
                    counts["acked_lost"] += (stored - hit) // CS
            return
        hit = c.lookup(rid, tokens, model="soak")
        counts["lookups"] += 1
        if not hit:
            return
        out = np.zeros_like(kv)
        if slow:
            got = _slow_retrieve(c, rid, tokens, out, hit, rng, kv, counts)
        else:
            got = c.retrieve(rid, tokens, out, model="soak", end=hit)
        counts["retrieves"] += 1
        k = got // CS
        a, b = out[:k].view(np.uint8), kv[:k].view(np.uint8)
        counts["bytes_verified"] += a.size
        counts["wrong_bytes"] += int(np.count_nonzero(a != b))
    finally:
        with contextlib.suppress(Exception):
            c.end_session(rid)


def _slow_store(c: Any, rid: str, tokens: list[int], kv: np.ndarray, rng: random.Random) -> int:
    rows = kv.reshape(kv.shape[0], -1).view(np.uint8)
    end = kv.shape[0] * CS
    with c.store_slots(
        rid, tokens, model="soak", end=end, chunk_shape=SHAPE, dtype="float16"
    ) as slots:
        time.sleep(rng.uniform(0, 0.03))
        for i, view in slots.targets():
            view[:] = rows[i]
    return int(slots.stored_tokens)


def _slow_retrieve(
    c: Any,
    rid: str,
    tokens: list[int],
    out: np.ndarray,
    hit: int,
    rng: random.Random,
    kv: np.ndarray,
    counts: Counter[str],
) -> int:
    """Copy out through retrieve_slots after a pause. When done() says LEASE_EXPIRED the copy is
    discarded, as an engine must; it is still compared, to count wrong bytes in what kvtier
    refused to vouch for (the quarantine should make that 0 as well)."""
    from kvtier.errors import LeaseExpiredError

    rows = out.reshape(out.shape[0], -1).view(np.uint8)
    got = c.retrieve_slots(rid, tokens, model="soak", end=hit, chunk_shape=SHAPE, dtype="float16")
    try:
        time.sleep(rng.uniform(0, 0.03))
        for i, view in enumerate(got.views):
            rows[i] = view
    finally:
        try:
            got.done()
        except LeaseExpiredError:
            k = got.num_chunks
            a, b = out[:k].view(np.uint8), kv[:k].view(np.uint8)
            counts["discarded_bytes"] += a.size
            counts["discarded_wrong_bytes"] += int(np.count_nonzero(a != b))
            raise
    return int(got.num_chunks * CS)

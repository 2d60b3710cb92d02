"""The Mooncake Store tier against the Redis tier, the Redis Cluster tier and memcpy, in one run:
put and get GB/s of 4 MiB chunks, and a 32k-token prompt looked up from each.

Everything runs on this machine over loopback TCP: a `mooncake_master`, a `kvtier serve` that
gives the pool its DRAM (1 GiB segment) and so holds every object, the tier under test in this
process with no segment of its own (each transfer crosses processes, as Redis's do), the shared
Redis at 127.0.0.1:6379 and a 3-master Redis Cluster started for the run. The tier's buffers are
one registered mapping, as the server's arena is, so Mooncake moves payloads in place.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np
from testkit.mooncake_pool import held_pool, pooled_tier
from testkit.redis_cluster import start_cluster

from benchmarks.bench_tiers import _l2_lookup
from benchmarks.common import Buffers, drop_redis_keys, on_threads, table
from kvtier.keys import ObjectKey
from kvtier.storage.tiers import L2Tier, open_tier
from kvtier.storage.tiers.format import digest
from kvtier.storage.tiers.mooncake import MooncakeTier
from kvtier.storage.tiers.mooncake_io import address_of

CHUNK = 4 << 20
CLIENTS = 4  # client threads, each with its own batches
BATCH = 8  # chunks per put_many / get_many_into
PER_CLIENT = 32  # chunks each client moves per run (4 x 32 x 4 MiB = 512 MiB)
REPEAT = 3
LAYOUT = "float16[32,2,256,1,128]"
#: Mooncake's published Transfer Engine figures (its README): 40 GB moved at up to 87 GB/s over
#: 4 x 200 Gbps RoCE NICs and 190 GB/s over 8 x 400 Gbps, 2.4x and 4.6x its TCP figures there
PUBLISHED = ((4, 200, 87.0), (8, 400, 190.0))


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def _keys(client: int, run: int) -> list[ObjectKey]:
    """Fresh names per run: a put on a name Mooncake holds keeps the object (no transfer)."""
    return [
        ObjectKey("bench", "", 1, 0, (run << 64 | client << 32 | i).to_bytes(32, "big"))
        for i in range(PER_CLIENT)
    ]


def _threads(fn: Callable[[int], None], n: int) -> float:
    """GB/s of `fn(0..n-1)` on n threads, each moving PER_CLIENT chunks; re-raises a failure."""
    return n * PER_CLIENT * CHUNK / on_threads(fn, n) / 1e9


class RawClient:
    """Mooncake's client alone on the same buffers and pool: payload only, no header, no
    digest, no master probe (`batch_put_from` / `batch_get_into`), what the tier adds to."""

    name = "mooncake-raw"

    def __init__(self, tier: MooncakeTier, prefix: str) -> None:
        self._store = tier._store
        self._prefix = prefix

    def _names(self, keys: Sequence[ObjectKey]) -> list[str]:
        return [f"{self._prefix}/{k.to_str()}" for k in keys]

    def put_many(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> int:
        codes = self._store.batch_put_from(
            self._names([k for k, _, _ in items]),
            [address_of(d) for _, d, _ in items],
            [len(d) for _, d, _ in items],
        )
        return sum(1 for rc in codes if rc == 0)

    def get_many_into(self, items: Sequence[tuple[ObjectKey, memoryview, str]]) -> list[bool]:
        codes = self._store.batch_get_into(
            self._names([k for k, _, _ in items]),
            [address_of(o) for _, o, _ in items],
            [len(o) for _, o, _ in items],
        )
        return [rc == len(o) for rc, (_, o, _) in zip(codes, items, strict=True)]

    def clear(self) -> int:
        return int(self._store.remove_by_regex(f"^{self._prefix}/", force=True))


def _one_run(tier: L2Tier | RawClient, buf: Buffers, run: int) -> tuple[float, float]:
    """(put GB/s, get GB/s) of CLIENTS threads moving PER_CLIENT chunks each in batches of
    BATCH, under names new to this run (cleared after); every get is checked for hits and one
    chunk for its bytes."""
    keys = [_keys(c, run) for c in range(CLIENTS)]

    def put(c: int) -> None:
        for i in range(0, PER_CLIENT, BATCH):
            items = [(k, buf.chunk, LAYOUT) for k in keys[c][i : i + BATCH]]
            assert tier.put_many(items) == len(items), f"{tier.name} refused a put"

    def get(c: int) -> None:
        for i in range(0, PER_CLIENT, BATCH):
            items = [(k, buf.outs[c][j], LAYOUT) for j, k in enumerate(keys[c][i : i + BATCH])]
            assert all(tier.get_many_into(items)), f"{tier.name} missed a chunk it holds"

    try:
        put_gbs = _threads(put, CLIENTS)
        for row in buf.outs:
            for out in row:
                out[:8] = bytes(8)  # so the check below sees bytes this run read
        get_gbs = _threads(get, CLIENTS)
        assert buf.outs[CLIENTS - 1][BATCH - 1] == buf.chunk
    finally:
        tier.clear()
    return put_gbs, get_gbs


Rates = dict[str, dict[str, list[float]]]


def _rates(cases: Sequence[tuple[str, L2Tier | RawClient]], buf: Buffers) -> Rates:
    """{case: {"put"/"get": GB/s of each run}}: REPEAT rounds, each running every case once in
    turn, so a change of the machine's load falls on all of them alike."""
    rates: Rates = {name: {"put": [], "get": []} for name, _ in cases}
    for run in range(REPEAT):
        for name, tier in cases:
            put_gbs, get_gbs = _one_run(tier, buf, run)
            rates[name]["put"].append(put_gbs)
            rates[name]["get"].append(get_gbs)
    return rates


def _memcpy(buf: Buffers) -> dict[str, float]:
    """The same volume copied chunk by chunk between the same buffers, one thread and CLIENTS."""
    src = np.frombuffer(buf.chunk, dtype=np.uint8)
    outs = [[np.frombuffer(o, dtype=np.uint8) for o in row] for row in buf.outs]

    def copy(c: int) -> None:
        for i in range(PER_CLIENT):
            np.copyto(outs[c][i % BATCH], src)

    return {
        "one thread": max(_threads(copy, 1) for _ in range(REPEAT)),
        f"{CLIENTS} threads": max(_threads(copy, CLIENTS) for _ in range(REPEAT)),
    }


def _digest_rate(buf: Buffers) -> float:
    """GB/s of the xxh3-128 digest every tier checks on a read, one thread."""
    best = float("inf")
    for _ in range(REPEAT):
        t0 = time.perf_counter()
        for _ in range(16):
            digest(buf.chunk)
        best = min(best, time.perf_counter() - t0)
    return 16 * CHUNK / best / 1e9


def _lookups(urls: Sequence[tuple[str, str]]) -> list[list[object]]:
    """Best of REPEAT lookups of a 32k-token prompt from each tier, alternated."""
    best = {name: float("inf") for name, _ in urls}
    for _ in range(REPEAT):
        for name, url in urls:
            best[name] = min(best[name], _l2_lookup(url)[0])
    return [[name, f"{best[name] * 1e3:.1f}"] for name, _ in urls]


def run() -> str:
    load_before = _uptime()
    buf = Buffers(os.urandom(CHUNK), CLIENTS, BATCH)
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    cluster = start_cluster(masters=3, replicas=0)
    try:
        with held_pool() as master:  # Mooncake's default lease: no test shortcuts
            pooled = pooled_tier(master, buf.view, prefix=prefix, timeout="10")
            tiers: list[tuple[str, L2Tier]] = [
                ("Mooncake (TCP)", pooled),
                ("Redis", open_tier(f"redis://127.0.0.1:6379/0?prefix={prefix}&timeout=10")),
                (
                    "Redis Cluster, 3 masters",
                    open_tier(f"{cluster.url}?prefix={prefix}&timeout=10"),
                ),
            ]
            _one_run(pooled, buf, REPEAT)  # warm-up, not reported: the first writes fault in pages
            try:
                rates = _rates([("Mooncake, its client alone", RawClient(pooled, prefix + "-raw")),
                                *tiers], buf)  # fmt: skip
                staged = pooled.stats().extra["staged"]
            finally:
                for _, tier in tiers:
                    tier.close()
            copies = _memcpy(buf)
            digest_gbs = _digest_rate(buf)
            lookups = _lookups(
                [
                    ("Mooncake (TCP)", master.url(segment="0", prefix=prefix + "-l")),
                    ("Redis", f"redis://127.0.0.1:6379/0?prefix={prefix}-l"),
                    ("Redis Cluster, 3 masters", f"{cluster.url}?prefix={prefix}-l"),
                ]
            )
    finally:
        cluster.stop()
        drop_redis_keys(prefix)
    load_after = _uptime()
    best = {name: {verb: max(r[verb]) for verb in r} for name, r in rates.items()}
    base = best["Redis"]

    def each(r: list[float]) -> str:
        return ", ".join(f"{x:.2f}" for x in r)

    rows: list[list[object]] = [
        [name, f"{best[name]['put']:.2f}", f"{best[name]['get']:.2f}",
         f"{best[name]['put'] / base['put']:.2f}", f"{best[name]['get'] / base['get']:.2f}",
         each(r["put"]), each(r["get"])]
        for name, r in rates.items()
    ]  # fmt: skip
    rows += [
        [f"memcpy, {how}", f"{gbs:.2f}", f"{gbs:.2f}", "", "", "", ""]
        for how, gbs in copies.items()
    ]
    mooncake = best["Mooncake (TCP)"]
    raw = best["Mooncake, its client alone"]
    readers = min(CLIENTS, len(os.sched_getaffinity(0)))  # digest threads that can run at once
    spread = max(max(r) / min(r) for case in rates.values() for r in case.values())
    projection = [
        [
            f"{nics} x {gbps} Gbps RoCE",
            f"{total:.0f}",
            f"{total / nics:.1f}",
            f"{min(total / nics, copies['one thread']):.1f}",
            f"{min(total / nics, digest_gbs * readers):.1f}",
        ]
        for nics, gbps, total in PUBLISHED
    ]
    return "\n".join(
        [
            "## Mooncake Store tier",
            "",
            f"Put and get of 4 MiB chunks ({CLIENTS} client threads, {CLIENTS * PER_CLIENT} "
            f"chunks per run, batches of {BATCH}, {REPEAT} rounds, each running every case once in "
            "turn) through each tier, and "
            "memcpy of the same volume between the same buffers, all in this run. The Mooncake "
            "pool is a `mooncake_master` and a `kvtier serve` giving it a 1 GiB segment; the "
            "tier under test gives none, so every transfer crosses processes over loopback TCP "
            "(`protocol=tcp`), as the Redis tiers' do. Its buffers are registered: payloads "
            f"copied through the staging buffer in the run: {staged}. Every get is checked "
            '(all hits, the digest of each, one chunk\'s bytes). "Its client alone" is '
            "Mooncake's `batch_put_from` / `batch_get_into` on the same buffers and pool, "
            "payload only (no header, no digest, no master probe before a read): the tier ran "
            f"at {mooncake['put'] / raw['put']:.2f} of it on puts and "
            f"{mooncake['get'] / raw['get']:.2f} on gets. memcpy is numpy's `copyto` of "
            "each chunk, on one thread and on 4. One untimed pass through the tier came first: "
            "the first writes into the pool's segment fault its pages in.",
            "",
            f"Load (`uptime`) before: `{load_before}`; after: `{load_after}`. This machine has "
            f"{len(os.sched_getaffinity(0))} cores shared with other work: absolute figures "
            "move with the load; the ratios were measured side by side. The largest spread "
            f"between the runs of one case was {spread:.1f}x: differences smaller than that "
            "are not resolved by this run.",
            "",
            table(
                [
                    "case",
                    "put GB/s (best)",
                    "get GB/s (best)",
                    "put / Redis",
                    "get / Redis",
                    "put GB/s, each run",
                    "get GB/s, each run",
                ],
                rows,
            ),
            "",
            "A 32k-token prompt (128 chunks of 256 KiB) stored by one server and looked up on a "
            "fresh one (empty L1) on the same tier, as in the L2 tiers section (both servers "
            f"give the Mooncake pool no segment; the pool's holder keeps the objects); best of "
            f"{REPEAT} alternated runs:",
            "",
            table(["tier", "lookup of a 32k-token prompt from L2 (ms)"], lookups),
            "",
            "**Projection, not a measurement: what RDMA would change.** Not measurable here "
            "(no RDMA NIC). Mooncake publishes Transfer Engine figures of 87 GB/s over "
            "4 x 200 Gbps RoCE and 190 GB/s over 8 x 400 Gbps (2.4x and 4.6x TCP on the same "
            "networks). One kvtier moving bytes straight between its registered arena and the "
            "pool would then be held by what stays on its side: the NIC's share per node, a "
            f"memory copy on the engine's side of the arena ({copies['one thread']:.1f} GB/s "
            "per thread here) and, on reads, the digest check "
            f"({digest_gbs:.1f} GB/s per thread here, {readers} at once on these cores). Over TCP "
            f"here the tier moved {mooncake['put']:.2f} GB/s put and {mooncake['get']:.2f} "
            "GB/s get.",
            "",
            table(
                [
                    "network (published)",
                    "GB/s, all NICs",
                    "GB/s per NIC",
                    "per NIC, capped by one memcpy thread here",
                    f"per NIC, capped by {readers} digest threads here",
                ],
                projection,
            ),
            "",
        ]
    )


if __name__ == "__main__":
    print(run())

"""L2 tier throughput: DiskTier vs plain file I/O, RedisTier vs plain redis-py SET/GET, and
batched vs unbatched Redis verbs. Figures are ratios against baselines measured in this run."""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable

import redis

from benchmarks.common import table
from kvtier.keys import ObjectKey
from kvtier.storage.tiers.disk import DiskTier
from kvtier.storage.tiers.redis import RedisTier

CHUNK = 4 << 20
COUNT = 64
SMALL = 64 << 10
LAYOUT = "float16[32,2,256,4,128]"  # 16 MiB as a real layout; only the string matters here
REPEAT = 7
BATCH = 16


def _keys(n: int, tag: int = 0) -> list[ObjectKey]:
    return [ObjectKey("bench", "", 1, 0, (tag << 32 | i).to_bytes(32, "big")) for i in range(n)]


Timed = tuple[Callable[[], None], Callable[[], None] | None]


def _race(*cases: Timed) -> list[float]:
    """Fastest of REPEAT runs of each (fn, setup) case, the cases interleaved run by run so a
    load change on this shared machine hits baseline and tier alike."""
    best = [float("inf")] * len(cases)
    for _ in range(REPEAT):
        for i, (fn, setup) in enumerate(cases):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _row(case: str, nbytes: int, base: float, ours: float, goal: float | None) -> list[object]:
    ratio = base / ours
    verdict = "-" if goal is None else ("met" if ratio >= goal else "not met")
    shown = "(info)" if goal is None else f">= {goal:.2f}"
    return [case, _gbps(nbytes, base), _gbps(nbytes, ours), f"{ratio:.2f}", shown, verdict]


def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}"


def _bench_disk(chunks: list[bytes], outs: list[memoryview]) -> list[list[object]]:
    root = tempfile.mkdtemp(prefix="kvtier-bench-", dir="/tmp")
    try:
        plain = os.path.join(root, "plain")
        os.makedirs(plain)
        tier = DiskTier(os.path.join(root, "tier"), 0)
        keys = _keys(len(chunks))
        paths = [os.path.join(plain, f"{i:04d}") for i in range(len(chunks))]

        def plain_write() -> None:
            for path, data in zip(paths, chunks, strict=True):
                with open(path, "wb") as f:
                    f.write(data)

        def plain_clear() -> None:
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

        def plain_read() -> None:
            for path, out in zip(paths, outs, strict=True):
                with open(path, "rb", buffering=0) as f:
                    f.readinto(out)

        def tier_write() -> None:
            for k, data in zip(keys, chunks, strict=True):
                tier.put(k, data, LAYOUT)

        def tier_write_many() -> None:
            assert tier.put_many([(k, data, LAYOUT) for k, data in zip(keys, chunks, strict=True)])

        def tier_write_other() -> None:  # same keys, other bytes: a real replacement
            for k, data in zip(keys, reversed(chunks), strict=True):
                tier.put(k, data, LAYOUT)

        def tier_read_many() -> None:
            assert all(
                tier.get_many_into([(k, out, LAYOUT) for k, out in zip(keys, outs, strict=True)])
            )

        def tier_clear() -> None:
            tier.clear()

        def tier_read() -> None:
            for k, out in zip(keys, outs, strict=True):
                assert tier.get_into(k, out, LAYOUT)

        total = CHUNK * len(chunks)
        # new objects: both sides start each run from an empty folder
        base_w, tier_w, tier_wm = _race(
            (plain_write, plain_clear), (tier_write, tier_clear), (tier_write_many, tier_clear)
        )
        base_r, tier_r, tier_rm = _race(
            (plain_read, None), (tier_read, None), (tier_read_many, None)
        )
        # rewrites: plain truncates and rewrites the same files in place
        base_rw, tier_same, tier_other = _race(
            (plain_write, None), (tier_write, None), (tier_write_other, None)
        )
        return [
            _row(
                "disk write, batch (`put_many`, what the write-through uses: the next object"
                " hashed while this one is written)",
                total,
                base_w,
                tier_wm,
                0.8,
            ),
            _row("disk write, one `put` per object (new objects)", total, base_w, tier_w, None),
            _row(
                "disk read, batch (`get_many_into`, the prefetch path: each object read whole"
                " while a second thread hashes the one before)",
                total,
                base_r,
                tier_rm,
                0.8,
            ),
            _row(
                "disk read, one `get_into` per object (digest of each 512 KiB block as it lands)",
                total,
                base_r,
                tier_r,
                None,
            ),
            _row("disk rewrite, same bytes (skipped after check)", total, base_rw, tier_same, None),
            _row("disk rewrite, other bytes (swap + unlink)", total, base_rw, tier_other, None),
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _bench_redis(chunks: list[bytes], outs: list[memoryview]) -> list[list[object]]:
    prefix = f"kvtier-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    client = redis.Redis()
    tier = RedisTier(prefix=prefix)
    keys = _keys(len(chunks))
    plain_names = [f"{prefix}:plain:{i}" for i in range(len(chunks))]
    total = CHUNK * len(chunks)
    try:

        def plain_set() -> None:
            for name, data in zip(plain_names, chunks, strict=True):
                client.set(name, data)

        def plain_get() -> None:
            for name in plain_names:
                client.get(name)

        def tier_put() -> None:
            for k, data in zip(keys, chunks, strict=True):
                tier.put(k, data, LAYOUT)

        def tier_get() -> None:
            for k, out in zip(keys, outs, strict=True):
                assert tier.get_into(k, out, LAYOUT)

        base_s, tier_s = _race((plain_set, None), (tier_put, None))
        base_g, tier_g = _race((plain_get, None), (tier_get, None))
        rows = [
            _row("redis put", total, base_s, tier_s, 0.9),
            _row("redis get", total, base_g, tier_g, 0.9),
        ]
        client.delete(*plain_names)
        rows += _bench_batching(tier, chunks, outs, "4 MiB")
        small = [c[:SMALL] for c in chunks] * 4
        small_outs = [memoryview(bytearray(SMALL)) for _ in small]
        rows += _bench_batching(tier, small, small_outs, "64 KiB", tag=1)
        return rows
    finally:
        tier.clear()
        tier.close()
        client.close()


def _bench_batching(
    tier: RedisTier, chunks: list[bytes], outs: list[memoryview], label: str, tag: int = 0
) -> list[list[object]]:
    keys = _keys(len(chunks), tag)
    total = sum(len(c) for c in chunks)
    groups = [range(i, min(i + BATCH, len(chunks))) for i in range(0, len(chunks), BATCH)]

    def one_put() -> None:
        for k, data in zip(keys, chunks, strict=True):
            tier.put(k, data, LAYOUT)

    def many_put() -> None:
        for g in groups:
            assert tier.put_many([(keys[i], chunks[i], LAYOUT) for i in g]) == len(g)

    def one_get() -> None:
        for k, out in zip(keys, outs, strict=True):
            assert tier.get_into(k, out, LAYOUT)

    def many_get() -> None:
        for g in groups:
            assert all(tier.get_many_into([(keys[i], outs[i], LAYOUT) for i in g]))

    base_p, ours_p = _race((one_put, None), (many_put, None))
    base_g, ours_g = _race((one_get, None), (many_get, None))
    return [
        _row(f"redis put_many ({label}, batch {BATCH}) vs put", total, base_p, ours_p, 1.5),
        _row(f"redis get_many ({label}, batch {BATCH}) vs get", total, base_g, ours_g, 1.5),
    ]


LOOKUP_TOKENS = 32768
LOOKUP_SHAPE = (2, 2, 256, 2, 64)  # float16: 256 KiB per 256-token chunk, 32 MiB per prompt


def _l2_lookup(tier_url: str) -> tuple[float, float, float]:
    """(L2 lookup s, L1 lookup s, plain read s) for a 32k-token prompt.

    A server stores the prompt's 128 chunks and writes them through to the tier; a fresh server
    on the same tier (empty L1) then answers a lookup by loading all 128 from L2 into L1.
    """
    import numpy as np

    from benchmarks.common import start_server, stop_server
    from kvtier.client import Client

    tokens = np.arange(LOOKUP_TOKENS, dtype="<u4").tobytes()
    n = LOOKUP_TOKENS // 256
    kv = np.random.default_rng(0).standard_normal((n, *LOOKUP_SHAPE)).astype(np.float16)
    args = ("--l1-size", "256MiB", "--l2", tier_url)
    proc, address = start_server(*args)
    try:
        with Client(address) as c:
            c.register(model="l2", chunk_shape=LOOKUP_SHAPE, dtype="float16")
            c.store("w", tokens, kv, model="l2")
    finally:
        stop_server(proc)  # closing flushes the write-through queue
    proc, address = start_server(*args)
    try:
        with Client(address) as c:
            c.register(model="l2", chunk_shape=LOOKUP_SHAPE, dtype="float16")
            t0 = time.perf_counter()
            hit = c.lookup("from-l2", tokens, model="l2")
            l2 = time.perf_counter() - t0
            assert hit == LOOKUP_TOKENS, f"only {hit} tokens came back from {tier_url}"
            t0 = time.perf_counter()
            c.lookup("from-l1", tokens, model="l2")
            l1 = time.perf_counter() - t0
    finally:
        stop_server(proc)
    # baseline: read the same volume as plain files (one per chunk) into page-aligned buffers
    folder = tempfile.mkdtemp(prefix="kvtier-bench-read-")
    try:
        for i in range(n):
            with open(os.path.join(folder, str(i)), "wb") as f:
                f.write(kv[i].tobytes())
        out = memoryview(mmap.mmap(-1, kv[0].nbytes))
        t0 = time.perf_counter()
        for i in range(n):
            with open(os.path.join(folder, str(i)), "rb") as f:
                f.readinto(out)
        plain = time.perf_counter() - t0
    finally:
        shutil.rmtree(folder)
    return l2, l1, plain


def _bench_l2_lookup() -> list[str]:
    folder = tempfile.mkdtemp(prefix="kvtier-bench-l2-")
    prefix = f"kvtier-bench-{uuid.uuid4().hex[:8]}"
    try:
        disk = _l2_lookup(f"disk://{folder}?size=1GiB")
        redis_url = f"redis://127.0.0.1:6379/0?prefix={prefix}"
        red = _l2_lookup(redis_url)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        r = redis.Redis()
        keys = list(r.scan_iter(match=f"{prefix}:*"))
        if keys:
            r.delete(*keys)
    rows = [
        [name, f"{l2 * 1e3:.1f}", f"{l1 * 1e3:.2f}", f"{plain * 1e3:.1f}", f"{l2 / plain:.2f}"]
        for name, (l2, l1, plain) in (("disk", disk), ("redis", red))
    ]
    return [
        "### Lookup served from L2",
        "",
        f"A {LOOKUP_TOKENS}-token prompt (128 chunks of 256 KiB, 32 MiB) stored by one server and",
        "looked up on a freshly started one with the same tier: the lookup checks every chunk,",
        "loads all 128 into L1 (digests checked) and pins them. For comparison the same lookup",
        "once the chunks are in L1, and plain reads of the same bytes from 128 files.",
        "",
        table(
            [
                "tier",
                "lookup from L2 ms",
                "lookup from L1 ms",
                "plain file reads ms",
                "L2 lookup / plain reads",
            ],
            rows,
        ),
        "",
    ]


def run() -> str:
    chunks = [os.urandom(CHUNK) for _ in range(COUNT)]
    outs = [memoryview(mmap.mmap(-1, CHUNK)) for _ in range(COUNT)]  # page-aligned, like the L1
    rows = _bench_disk(chunks, outs) + _bench_redis(chunks, outs)
    lookup = _bench_l2_lookup()
    return "\n".join(
        [
            "## L2 tiers",
            "",
            f"{COUNT} chunks of {CHUNK >> 20} MiB (64 KiB rows: {4 * COUNT} chunks), best of "
            f"{REPEAT} runs, baseline and tier runs interleaved. Baselines: plain file "
            "write/readinto of the same bytes into the same page-aligned buffers in the same /tmp "
            "folder (new objects: both sides start each run from an empty folder; rewrites: "
            "plain rewrites its files in place), and plain redis-py SET/GET (hiredis) of the same "
            "bytes on the local Redis. The tiers also compute and check an xxh3-128 digest, "
            "write a header and rename atomically. Disk figures are page-cache speeds.",
            "",
            "The tier's Redis GET/SET beat plain redis-py because they bypass its packing and "
            "reply parsing, which copy a 4 MiB value several times. Batching cannot reach 1.5x "
            "for 4 MiB values: a pipeline saves one round trip (~0.05 ms on loopback) per value, "
            "while moving 4 MiB through the socket and Redis takes ~1-2 ms, so the bound is "
            "about 1.05x; batching pays off for small values (64 KiB rows).",
            "",
            table(["case", "baseline GB/s", "tier GB/s", "ratio", "goal", "result"], rows),
            "",
            *lookup,
        ]
    )


if __name__ == "__main__":
    print(run())

"""Copy speed of store and retrieve, against a multi-threaded memcpy of the same bytes (issue 11).

LMCache 0.5.6's workload: chunks of shape (32, 2, 256, 8, 128) float16 (32 MiB each). kvtier's
client splits large copies over `copy_threads()` threads (numpy releases the GIL while copying);
the baseline is the same split copy between two private arrays, measured in the same run, with
the same number of threads, and with one thread for context. 16 chunks (512 MiB) rather than
LMCache's 64 (2 GiB): the machine is shared, and the ratio does not depend on the count.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.common import start_server, stop_server, table

CHUNK_SHAPE = (32, 2, 256, 8, 128)
NUM_CHUNKS = 16
ROUNDS = 3
LMCACHE_STORE_GBPS = 11.5  # LMCache's client with torch's copy threads, on the machine
LMCACHE_RETRIEVE_GBPS = 11.8


def _memcpy(dst: np.ndarray, src: np.ndarray, threads: int) -> float:
    """Best GB/s of the split copy of every chunk of `src` into `dst`."""
    from kvtier.copying import copy_pairs

    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        copy_pairs([(dst[i], src[i]) for i in range(len(src))], threads=threads)
        best = min(best, time.perf_counter() - t0)
    return src.nbytes / best / 1e9


def run() -> str:
    from kvtier.client import Client
    from kvtier.copying import copy_threads

    threads = copy_threads()
    kv = np.random.default_rng(0).standard_normal((NUM_CHUNKS, *CHUNK_SHAPE)).astype(np.float16)
    out = np.empty_like(kv)
    rows_in = kv.reshape(NUM_CHUNKS, -1).view(np.uint8)
    rows_out = out.reshape(NUM_CHUNKS, -1).view(np.uint8)
    memcpy_n = _memcpy(rows_out, rows_in, threads)
    memcpy_1 = _memcpy(rows_out, rows_in, 1)
    # measured again after kvtier's rounds (below), the best of both counts: a busy moment
    # during the baseline must not flatter kvtier
    proc, address = start_server("--l1-size", "1GiB")
    try:
        with Client(address, timeout=120) as c:
            c.register(model="copy", chunk_shape=CHUNK_SHAPE, dtype="float16")
            best_store = best_retrieve = float("inf")
            for r in range(ROUNDS):
                tokens = np.arange(r * 10**6, r * 10**6 + NUM_CHUNKS * c.chunk_size, dtype="<u4")
                t0 = time.perf_counter()
                c.store(f"s{r}", tokens, kv, model="copy")
                t1 = time.perf_counter()
                got = c.retrieve(f"s{r}", tokens, out, model="copy")
                t2 = time.perf_counter()
                assert got == NUM_CHUNKS * c.chunk_size and np.array_equal(out, kv)
                c.end_session(f"s{r}")
                best_store, best_retrieve = min(best_store, t1 - t0), min(best_retrieve, t2 - t1)
    finally:
        stop_server(proc)
    memcpy_n = max(memcpy_n, _memcpy(rows_out, rows_in, threads))
    memcpy_1 = max(memcpy_1, _memcpy(rows_out, rows_in, 1))
    store, retrieve = kv.nbytes / best_store / 1e9, kv.nbytes / best_retrieve / 1e9
    lines = [
        "## Copy speed: store and retrieve against memcpy",
        "",
        f"{NUM_CHUNKS} chunks of {CHUNK_SHAPE} float16 ({kv.nbytes >> 20} MiB), best of {ROUNDS};"
        f" the client splits copies over {threads} threads (one per CPU, at most 8). A store",
        "includes its Reserve and Commit round trips, a retrieve its Retrieve and RetrieveDone.",
        "",
        table(
            ["path", "GB/s", f"ratio to memcpy ({threads} threads)"],
            [
                [f"memcpy, {threads} threads (baseline)", f"{memcpy_n:.2f}", "1.00"],
                ["memcpy, 1 thread", f"{memcpy_1:.2f}", f"{memcpy_1 / memcpy_n:.2f}"],
                ["kvtier store", f"{store:.2f}", f"{store / memcpy_n:.2f}"],
                ["kvtier retrieve", f"{retrieve:.2f}", f"{retrieve / memcpy_n:.2f}"],
            ],
        ),
        "",
        f"- LMCache's client reached {LMCACHE_STORE_GBPS} / {LMCACHE_RETRIEVE_GBPS} GB/s on a"
        " bigger machine; here the bound is this machine's memcpy, so the goal reads as the"
        f" ratio: store {store / memcpy_n:.2f}, retrieve {retrieve / memcpy_n:.2f} of the"
        " multi-threaded memcpy of the same bytes",
        "",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())

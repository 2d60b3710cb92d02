"""The SGLang HiCache backend: batch_set_v1 / batch_get_v1 of 64-token pages, as ratios
against a plain copy of the same bytes in the same run.

The pages live in a host-pool stand-in with real buffers (the one the tests use), shaped like
one TP rank of a Llama-8B-class model at TP 8: 32 layers, 1 KV head of 128, bfloat16, so a page
is 1 MiB. The baseline does the copy the backend cannot avoid: the same page pieces, found the
same way (`get_page_buffer_meta`), gathered into one preallocated buffer with the same memmove
calls, in this process, with no kvtier in between (and scattered back for the get). kvtier runs
as its own `kvtier serve` process with a 96 MiB L1, so later rounds evict earlier ones (the steady
state of a busy server); the backend is built by SGLang's real backend factory.
"""

from __future__ import annotations

import ctypes
import mmap
import time
import uuid
from typing import Any

import numpy as np

from benchmarks.common import start_server, stop_server, table

PAGE = 64
LAYERS, HEADS, HEAD_DIM = 32, 1, 128
BATCH = 32  # pages per call (SGLang sends up to 128)
ROUNDS = 7


def _plain_copy(pool: Any, indices: Any, dst: np.ndarray, nbytes: int) -> tuple[float, float]:
    """(gather seconds, scatter seconds) per page for the same pieces, without kvtier: the
    faster of one memmove per piece on this thread and the same pieces through
    kvtier.copying.copy_addresses (the native helper's threads and streaming stores, where
    built), which the backend copies with."""
    from kvtier.client.copying import copy_addresses

    ptrs, sizes = pool.get_page_buffer_meta(indices)
    per_page = len(ptrs) // BATCH
    base = dst.ctypes.data
    gather: list[tuple[int, int, int]] = []
    for page in range(BATCH):
        at = base + page * nbytes
        for ptr, size in zip(ptrs[page * per_page : (page + 1) * per_page], sizes, strict=False):
            gather.append((at, int(ptr), int(size)))
            at += size
    scatter = [(ptr, at, size) for at, ptr, size in gather]
    t0 = time.perf_counter()
    for at, ptr, size in gather:
        ctypes.memmove(at, ptr, size)
    t1 = time.perf_counter()
    for ptr, at, size in scatter:
        ctypes.memmove(ptr, at, size)
    t2 = time.perf_counter()
    copy_addresses(gather)
    t3 = time.perf_counter()
    copy_addresses(scatter)
    t4 = time.perf_counter()
    return min(t1 - t0, t3 - t2) / BATCH, min(t2 - t1, t4 - t3) / BATCH


def _measure(address: str, layout: str, transfer: str) -> dict[str, float]:
    from testkit.sglang_pool import HostPoolStandIn, build_backend

    pool = HostPoolStandIn(
        layout=layout,
        page_size=PAGE,
        num_pages=2 * BATCH,
        layer_num=LAYERS,
        head_num=HEADS,
        head_dim=HEAD_DIM,
    )
    pool.fill_random(1)
    nbytes = pool.page_bytes(0).__len__()
    src, dst = pool.indices(list(range(BATCH))), pool.indices(list(range(BATCH, 2 * BATCH)))
    # the arena's pages are 4 KiB (tmpfs): so are the baseline's (numpy's own arrays would ask
    # for transparent huge pages, which copy faster here)
    buffer = np.frombuffer(mmap.mmap(-1, BATCH * nbytes), np.uint8)
    backend = build_backend(address, pool, model_name="bench", transfer=transfer)
    best = {"set": float("inf"), "get": float("inf"), "exists": float("inf")}
    best |= {"copy_out": float("inf"), "copy_in": float("inf")}
    try:
        for _ in range(ROUNDS):
            out_s, in_s = _plain_copy(pool, src, buffer, nbytes)
            best["copy_out"] = min(best["copy_out"], out_s)
            best["copy_in"] = min(best["copy_in"], in_s)
            keys = [uuid.uuid4().hex * 2 for _ in range(BATCH)]  # new pages every round
            t0 = time.perf_counter()
            assert all(backend.batch_set_v1(keys, src))
            t1 = time.perf_counter()
            assert backend.batch_exists(keys) == BATCH
            t2 = time.perf_counter()
            assert all(backend.batch_get_v1(keys, dst))
            t3 = time.perf_counter()
            best["set"] = min(best["set"], (t1 - t0) / BATCH)
            best["exists"] = min(best["exists"], t2 - t1)
            best["get"] = min(best["get"], (t3 - t2) / BATCH)
        for page in range(BATCH):  # the last round's pages came back byte for byte
            assert pool.page_bytes((BATCH + page) * PAGE) == pool.page_bytes(page * PAGE)
    finally:
        backend.close()
    best["nbytes"] = nbytes
    return best


def run() -> str:
    from testkit.sglang_cpu import import_sglang_storage

    from kvtier.client.native import copy_library

    import_sglang_storage()
    proc, address = start_server("--chunk-size", str(PAGE), "--l1-size", "96MiB")
    try:
        results = {
            (layout, transfer): _measure(address, layout, transfer)
            for layout in ("page_first", "layer_first")
            for transfer in ("auto", "inline")
        }
    finally:
        stop_server(proc)
    rows = []
    for (layout, transfer), r in results.items():
        mib = r["nbytes"] / 2**20
        pieces = 2 if layout == "page_first" else 2 * LAYERS
        rows.append(
            [
                f"{layout} ({pieces} pieces/page), {'shm' if transfer == 'auto' else 'inline'}",
                f"{mib / r['set'] / 1024:.2f}",
                f"{r['copy_out'] / r['set']:.2f}",
                f"{mib / r['get'] / 1024:.2f}",
                f"{r['copy_in'] / r['get']:.2f}",
                f"{r['exists'] * 1e6:.0f}",
                f"{mib / r['copy_out'] / 1024:.2f} / {mib / r['copy_in'] / 1024:.2f}",
            ]
        )
    page_mib = next(iter(results.values()))["nbytes"] / 2**20
    lib = copy_library()
    helper = "ctypes.memmove per piece" if lib is None else f"native helper, {lib.variant}"
    return "\n".join(
        [
            "## SGLang HiCache backend (`batch_set_v1` / `batch_get_v1`)",
            "",
            f"Pages of {PAGE} tokens, {page_mib:g} MiB each ({LAYERS} layers, {HEADS} KV head of "
            f"{HEAD_DIM}, bfloat16), {BATCH} pages per call, best of {ROUNDS} rounds; kvtier "
            "serve in its own process with a 96 MiB L1 (later rounds evict earlier ones), the "
            "backend built by SGLang 0.5.23's backend factory. "
            "Baseline: the same page pieces gathered into (and scattered back from) one "
            "buffer (4 KiB pages, as the arena's) in this process, no kvtier: the faster of one "
            "memmove per piece and the same pieces through kvtier.copying.copy_addresses, the "
            f"backend's own copy ({helper}). A ratio of 1.00 means kvtier costs nothing beyond "
            "that copy.",
            "",
            table(
                [
                    "layout, transfer",
                    "set GiB/s",
                    "set vs copy",
                    "get GiB/s",
                    "get vs copy",
                    f"batch_exists of {BATCH} (us)",
                    "plain copy out / in GiB/s",
                ],
                rows,
            ),
            "",
        ]
    )

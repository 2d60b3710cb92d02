"""vLLM connector: layer-wise loads and saves against whole-request ones, measured in this run.

vLLM's real Scheduler with the connector's worker side on CPU tensors (testkit/vllm_harness.py)
against a real `kvtier serve`: a 16-layer model's prompt of 2k tokens is stored, then a fresh
request for it loads the 2k cached tokens and computes the rest. The fake forward pass runs, in
each layer, a fixed amount of matrix work (the layer's compute), calibrated against the layer's
share of a whole-request load, so the table shows how a load's copy time overlaps compute when
the two are about even, and when there is no compute to hide behind.

Needs vLLM (the CPU build: see docs/install.md); run it with that environment's python.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import start_server, stop_server, table

LAYERS, HIDDEN, HEADS = 16, 512, 4  # heads of 128: 4 KiB of float32 K+V per token and layer
BLOCK, CHUNK, CACHED, TAIL = 32, 256, 2048, 96
REPEAT = 5


def run() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return (
            "## vLLM layer-wise copies\n\nNot run: vLLM is not installed in this environment. "
            "Install the CPU build (docs/install.md) and run "
            "`python -m benchmarks.run --only vllm_layerwise` with it.\n"
        )
    from testkit.tiny_models import write_tiny_llama

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_llama(
            Path(tmp), layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=HEADS
        )
        proc, address = start_server("--l1-size", "512MiB", "--chunk-size", str(CHUNK))
        try:
            return _measure(model, address)
        finally:
            stop_server(proc)


def _harness(model: Path, address: str, layerwise: bool, work: Any = None) -> Any:
    from testkit.vllm_harness import COPY_MODES, Harness

    mode = "layerwise" if layerwise else "whole"
    h = Harness.build(
        model,
        address=address,
        extra=COPY_MODES[mode],
        num_blocks=2 * (CACHED + TAIL) // BLOCK + 8,
        enable_prefix_caching=False,  # every request loads from kvtier, none from vLLM's cache
    )
    h.layer_work = work
    for view in h.caches[0].values():  # fault its pages in, as a running engine's are
        view.fill_(1)
    return h


class Work:
    """The layer's compute: `units` products of (128 x 512) by (512 x 512), timed."""

    def __init__(self, units: int) -> None:
        import torch

        self.units = units
        self.a, self.b = torch.randn(128, 512), torch.randn(512, 512)
        self.seconds = 0.0

    def __call__(self) -> None:
        import torch

        t0 = time.perf_counter()
        for _ in range(self.units):
            torch.mm(self.a, self.b)
        self.seconds += time.perf_counter() - t0


def _step(h: Any, rid: str) -> float:
    """Seconds of the step that runs `rid` (steps before it, waiting for blocks, not counted);
    for a request without a load, until its saves are done too."""
    for _ in range(20):
        t0 = time.perf_counter()
        out = h.step()
        if rid in out.num_scheduled_tokens:
            if not out.kv_connector_metadata.loads:
                assert h.workers[0].worker_side.wait_idle(30)
            return time.perf_counter() - t0
    raise AssertionError(f"{rid} was not scheduled")


def _compare(
    model: Path, address: str, units: int, prompts: list[list[int]], fresh: bool = False
) -> list[Any]:
    """Per mode (whole, layer-wise): (median step seconds, overlap totals, compute seconds per
    step), the two modes' requests interleaved so that the machine's load hits both alike.
    `fresh`: the layer-wise engine gets other tokens (the whole-request one stored these)."""
    works = [Work(units), Work(units)]
    hs = [_harness(model, address, bool(m), works[m] if units else None) for m in (0, 1)]
    try:
        times: list[list[float]] = [[], []]
        for h in hs:
            h.workers[0].worker_side.overlap.take()
        for i, prompt in enumerate(prompts):
            for mode, h in enumerate(hs):
                rid = f"r{i}m{mode}"
                if fresh and mode:
                    prompt = [(t - 3 + 250) % 500 + 3 for t in prompt]
                h.add(rid, prompt, max_tokens=1)
                times[mode].append(_step(h, rid))
                h.run_until_done([rid])
        return [
            (
                statistics.median(times[mode]),
                hs[mode].workers[0].worker_side.overlap.take(),
                works[mode].seconds / len(prompts),
            )
            for mode in (0, 1)
        ]
    finally:
        for h in hs:
            h.close()


def _one_thread(fn: Any) -> Any:
    """`fn()` with torch on one thread: the other core is left to the copy thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _hidden(totals: dict[str, float], kind: str) -> float:
    from kvtier.integrations.vllm.layerwise import hidden_fraction

    return hidden_fraction(totals[f"{kind}_copy_s"], totals[f"{kind}_exposed_s"])


def _row(label: str, kind: str, got: list[Any]) -> list[str]:
    (w_s, w, w_work), (l_s, lw, _) = got
    copy_ms = w[f"{kind}_copy_s"] / max(1.0, w[f"{kind}s"]) * 1e3
    return [label, f"{w_work * 1e3:.0f}", f"{copy_ms:.0f}", f"{w_s * 1e3:.0f}", f"{l_s * 1e3:.0f}",
            f"{w_s / l_s:.2f}", f"{_hidden(w, kind):.2f}", f"{_hidden(lw, kind):.2f}"]  # fmt: skip


def _measure(model: Path, address: str) -> str:
    import torch

    load0 = os.getloadavg()[0]
    prompt = [(i * 31) % 500 + 3 for i in range(CACHED + TAIL)]
    store = _harness(model, address, False)
    store.add("store", prompt, max_tokens=1)
    store.run_until_done(["store"])
    store.flush()
    store.close()

    # calibrate the layer's compute to about the layer's share of a whole-request load
    (_, whole, _), _ = _compare(model, address, 0, [prompt] * 2)
    per_layer = whole["load_copy_s"] / max(1.0, whole["loads"]) / LAYERS
    probe = Work(20)
    laps = []
    for _ in range(5):
        probe.seconds = 0.0
        probe()
        laps.append(probe.seconds / 20)
    units = max(1, round(per_layer / statistics.median(laps)))
    threads = torch.get_num_threads()

    fresh = [[(s * 7919 + j * 31) % 500 + 3 for j in range(CACHED)] for s in range(1, REPEAT + 1)]
    rows = [
        _row(f"load {CACHED} tokens, the fake forward only", "load",
             _compare(model, address, 0, [prompt] * REPEAT)),
        _row(f"load {CACHED} tokens, + matrix work", "load",
             _compare(model, address, units, [prompt] * REPEAT)),
        _row(f"load {CACHED} tokens, + matrix work on 1 torch thread", "load",
             _one_thread(lambda: _compare(model, address, units, [prompt] * REPEAT))),
        _row(f"prefill {CACHED} tokens, save them, + matrix work", "save",
             _compare(model, address, units, fresh, fresh=True)),
    ]  # fmt: skip
    mib = CACHED * LAYERS * HEADS * 256 * 4 / 2**20
    return "\n".join(
        [
            "## vLLM layer-wise copies",
            "",
            f"vLLM's Scheduler with the connector's worker side (CPU tensors), a real `kvtier "
            f"serve`: a {LAYERS}-layer model ({HEADS} KV heads of 128, float32: {mib:.0f} MiB "
            f"of KV for {CACHED} tokens), a request whose first {CACHED} tokens kvtier holds "
            f"and whose last {TAIL} it computes. The fake forward pass writes the computed "
            "tokens' KV layer by layer (Python and small torch ops); the rows with matrix work "
            "add, in each layer, a fixed matrix product on torch's threads (calibrated to about "
            "a layer's share of the copy; the compute column is what it took per step). Step "
            f"time: the median of {REPEAT} fresh requests, the two modes' requests "
            "interleaved, the caches' pages faulted in first; the prefill row's step ends when "
            "its saves are done (its fake forward writes the 2k tokens' KV: slow). Hidden: the "
            "share of copy time the forward pass did not wait for (the connector's "
            f"`load_hidden` / `save_hidden` stats). torch threads: {threads}, CPUs: "
            f"{os.cpu_count()}, load average (1 min) at the start and end: {load0:.1f}, "
            f"{os.getloadavg()[0]:.1f}: other jobs on the machine take cores too, and the step "
            "times move with them.",
            "",
            table(
                [
                    "step",
                    "compute ms",
                    "copy ms",
                    "whole-request step ms",
                    "layer-wise step ms",
                    "speedup",
                    "hidden (whole)",
                    "hidden (layer-wise)",
                ],
                rows,
            ),
        ]
    )

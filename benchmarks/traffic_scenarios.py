"""The traffic benchmark's scenarios and their runs: chat, shared documents, no reuse, two
replicas and a restart, each measured on each arm's vLLM server (`measure`), with vLLM's own
benchmark client or `benchmarks.chat_driver` as the load."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from benchmarks.chat_driver import ChatLoad, Turn, chat
from benchmarks.common import percentile
from benchmarks.traffic_model import write_model
from benchmarks.traffic_scale import Scale
from benchmarks.traffic_servers import (
    ALONE,
    CHUNK,
    VLLM,
    extra_arms,
    kvtier_arm,
    kvtier_server,
    sidecars,
    start_vllm,
    stop_vllm,
    vllm_counters,
    vllm_servers,
    wait_vllm,
)  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]


# -- measurements ----------------------------------------------------------------------------------


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


def _brief(run: Run) -> str:
    return (
        f"{run.requests} requests, TTFT p50 {1000 * pct(run.ttfts, 50):.0f} ms, "
        f"{run.rps:.2f} req/s, kvtier hits {run.counters.get('external_hits', 0):.0f} tokens"
    )


def _ms(values: Sequence[float]) -> str:
    return ", ".join(f"{1000 * v:.0f}" for v in values) + " ms"

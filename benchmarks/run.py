"""Runs every benchmark module and writes their markdown sections to one results file.

Each `benchmarks/bench_*.py` exposes `run() -> str`, returning a markdown section that starts
with a `## ` heading and reports ratios against a baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

MODULES = [
    "benchmarks.bench_hashing",
    "benchmarks.bench_session",
    "benchmarks.bench_misses",
    "benchmarks.bench_admin_chunks",
    "benchmarks.bench_policy",
    "benchmarks.bench_serve",
    "benchmarks.bench_concurrency",
    "benchmarks.bench_lookup",
    "benchmarks.bench_copy",
    "benchmarks.bench_tiers",
    "benchmarks.bench_events",
    "benchmarks.bench_cluster",
    "benchmarks.bench_mooncake",
    "benchmarks.bench_codecs",
    "benchmarks.bench_transformers",
    "benchmarks.bench_sglang",
    "benchmarks.bench_vllm",
    "benchmarks.bench_vllm_layerwise",
    "benchmarks.bench_hybrid",
    "benchmarks.bench_dsa",
    "benchmarks.bench_trace_vllm",
    "benchmarks.bench_traffic",
    "benchmarks.bench_pd",
]


def _header() -> str:
    return "\n".join(
        [
            "# kvtier benchmarks",
            "",
            "Written by `make bench` (`python -m benchmarks.run`). Every figure that matters is a",
            "ratio against a baseline measured in the same run on the same machine, because the",
            "machines this runs on are shared and noisy; absolute times are context only.",
            "",
            f"- written: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; each section ends"
            " with the time it was measured (`--only` reruns some and keeps the others)",
            f"- machine: {platform.machine()}, {_cpu_count()} cores,"
            f" Python {platform.python_version()}, numpy {np.__version__}",
            "",
        ]
    )


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _cpu_ticks() -> tuple[int, int]:
    """(steal, total) CPU ticks since boot, from /proc/stat (zeros where it does not exist)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def _steal_note(before: tuple[int, int], after: tuple[int, int]) -> str:
    """How much CPU the hypervisor took during a module: high steal means noisy figures."""
    total = after[1] - before[1]
    if total <= 0:
        return ""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    steal = 100 * (after[0] - before[0]) / total
    return f"\n_CPU steal during this section: {steal:.0f}%; measured {when}._\n"


def _split(text: str) -> list[str]:
    """A results file cut at its `## ` headings: [header, section, section, ...]."""
    parts: list[list[str]] = [[]]
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            parts.append([])
        parts[-1].append(line)
    return ["".join(p) for p in parts]


def _merge(old: str, new: list[str]) -> list[str]:
    """An `--only` run replaces its own sections in the results file and keeps the others."""
    fresh = {s.splitlines()[0]: s for s in new[1:]}
    merged = [new[0]]
    for section in _split(old)[1:]:
        heading = section.splitlines()[0]
        merged.append(fresh.pop(heading, section).rstrip("\n") + "\n")
    merged.extend(fresh.values())
    return merged


def _chosen(only: list[str] | None) -> list[str]:
    """The modules `--only` names: a module by its exact name (`vllm` is `bench_vllm`, not
    `bench_trace_vllm`), else every module whose name ends with the given suffix."""
    if not only:
        return list(MODULES)
    short = {m.removeprefix("benchmarks.bench_"): m for m in MODULES}
    return [
        m for m in MODULES if any(short.get(s) == m if s in short else m.endswith(s) for s in only)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--only", nargs="*", help="module name suffixes to run (e.g. hashing)")
    args = parser.parse_args(argv)
    sections = [_header()]
    failed = 0
    chosen = _chosen(args.only)
    console = Console(soft_wrap=True, highlight=False)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    # a bar on a terminal (a whole run takes tens of minutes); plain lines when piped
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("benchmarks", total=len(chosen))
        for i, name in enumerate(chosen, 1):
            progress.update(task, description=f"benchmarks: {name.removeprefix('benchmarks.')}")
            console.print(f"== {name} ({i}/{len(chosen)})", markup=False)
            ticks = _cpu_ticks()
            try:
                module = importlib.import_module(name)
                section = module.run() + _steal_note(ticks, _cpu_ticks())
            except ModuleNotFoundError as exc:
                if exc.name == name:
                    progress.advance(task)
                    continue  # not written yet
                raise
            except Exception:  # one broken benchmark must not hide the others' results
                failed += 1
                section = f"## {name}\n\nFAILED:\n\n```\n{traceback.format_exc()}```\n"
            console.print(section, markup=False)
            sections.append(section)
            progress.advance(task)
    if args.only and args.output.exists():
        sections = _merge(args.output.read_text(), sections)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(sections))
    print(f"wrote {args.output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

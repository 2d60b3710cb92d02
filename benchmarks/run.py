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

MODULES = [
    "benchmarks.bench_hashing",
    "benchmarks.bench_session",
    "benchmarks.bench_serve",
    "benchmarks.bench_tiers",
    "benchmarks.bench_transformers",
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
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            f"- machine: {platform.machine()}, {_cpu_count()} cores,"
            f" Python {platform.python_version()}, numpy {np.__version__}",
            "",
        ]
    )


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--only", nargs="*", help="module name suffixes to run (e.g. hashing)")
    args = parser.parse_args(argv)
    sections = [_header()]
    failed = 0
    for name in MODULES:
        if args.only and not any(name.endswith(s) for s in args.only):
            continue
        print(f"== {name}", flush=True)
        try:
            module = importlib.import_module(name)
            section = module.run()
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # not written yet
            raise
        except Exception:  # one broken benchmark must not hide the others' results
            failed += 1
            section = f"## {name}\n\nFAILED:\n\n```\n{traceback.format_exc()}```\n"
        print(section, flush=True)
        sections.append(section)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(sections))
    print(f"wrote {args.output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

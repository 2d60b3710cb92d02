"""`kvtier demo --quick` as a user runs it: its own server, a real model, a table and a plot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_kvtier_demo_quick_prints_a_table_and_writes_a_plot(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "demo", "--quick", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "TTFT" in out and "hit" in out.lower()
    plot = Path(out.split("plot: ")[-1].split()[0])
    assert plot.is_file() and plot.parent == tmp_path
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

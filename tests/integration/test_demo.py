"""`kvtier demo --quick` as a user runs it: its own server, a real model, a table and a plot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvtier.integrations.demo import DemoStep, StepSummary, summarize


def test_kvtier_demo_quick_prints_medians_and_writes_a_plot(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "demo", "--quick", "--repeats", "3",
         "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "200", **__import__("os").environ},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "TTFT" in out and "median (min-max) of 3 runs" in out
    rows = [line for line in out.splitlines() if re.search(r"(turn \d|Q\d)", line)]
    assert len(rows) == 3 + 2, out  # QUICK: 3 chat turns, 2 questions
    for line in rows:
        hit = int(line.split("│")[4].strip())
        speedup = line.split("│")[8].strip()
        # A speedup only where the cache was hit; a miss shows no ratio (it would be noise).
        assert (speedup == "- (miss)") == (hit == 0), line
    assert "turn 1" in out and "- (miss)" in out  # the first turn is always cold
    plot = Path(out.split("plot: ")[-1].split()[0])
    assert plot.is_file() and plot.parent == tmp_path
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_takes_medians_and_hides_speedup_of_misses() -> None:
    runs = [
        [DemoStep("chat", "turn 1", 100, 0, 0.010, 0.004),
         DemoStep("chat", "turn 2", 200, 96, 0.020, 0.010)],
        [DemoStep("chat", "turn 1", 100, 0, 0.012, 0.011),
         DemoStep("chat", "turn 2", 200, 96, 0.030, 0.012)],
        [DemoStep("chat", "turn 1", 100, 0, 0.011, 0.010),
         DemoStep("chat", "turn 2", 200, 96, 0.022, 0.011)],
    ]  # fmt: skip
    rows = summarize(runs)
    assert rows[0].baseline == (0.011, 0.010, 0.012) and rows[0].speedup is None
    assert rows[1].kvtier == (0.011, 0.010, 0.012)
    assert rows[1].speedup == 0.022 / 0.011
    assert isinstance(rows[1], StepSummary)

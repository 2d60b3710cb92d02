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
        env={**__import__("os").environ, "COLUMNS": "200"},  # wide: no wrapped titles
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "TTFT" in out and "median (min-max) of 3 runs" in out
    rows = [ln for ln in out.splitlines() if "│" in ln and re.search(r"(turn \d|Q\d)", ln)]
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


def test_kvtier_demo_reports_progress_and_fits_80_columns(tmp_path: Path) -> None:
    """Piped (no terminal, so no live bar), the demo prints a line per prompt as it goes, and
    its table fits an 80-column terminal without cutting a cell."""
    import os

    result = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "demo", "--quick", "--repeats", "2",
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    text = [ln for ln in lines if str(tmp_path) not in ln]  # a long path cannot wrap
    assert max(len(line) for line in text) <= 80, [ln for ln in text if len(ln) > 80]
    assert "…" not in result.stdout
    progress = [ln for ln in lines if re.match(r"\[\d+/10\] run [12]/2 ", ln)]
    assert [ln.split("/")[0] for ln in progress] == [f"[{i}" for i in range(1, 11)], progress
    table = lines.index(next(ln for ln in lines if "scenario" in ln and "speedup" in ln))
    assert table > lines.index(progress[-1])  # progress first, then the table
    for name in ("step", "prompt", "hit %", "full", "kvtier"):
        assert name in lines[table]
    # Each row is two whole lines: the medians, then the min-max ranges (no value cut in two).
    cells = [[c.strip() for c in ln.split("│")[6:8]] for ln in lines if ln.startswith("│")]
    assert len(cells) == 2 * 5, cells
    for medians, ranges in zip(cells[::2], cells[1::2], strict=True):
        assert all(re.fullmatch(r"\d+\.\d ms", c) for c in medians), medians
        assert all(re.fullmatch(r"[\d.]+-[\d.]+", c) for c in ranges), ranges
    # --quick says why its speedups are small
    assert "a speedup near or under 1x is expected here" in " ".join(" ".join(lines).split())


def test_the_demos_default_output_folder_is_ignored_by_git() -> None:
    """`kvtier demo` in the clone writes kvtier-demo/: it must not show as untracked."""
    import inspect

    from kvtier.cli.main import demo

    folder = inspect.signature(demo).parameters["output_dir"].default.default
    repo = Path(__file__).resolve().parents[2]
    plot = Path(folder) / "kvtier-demo-ttft.png"
    out = subprocess.run(["git", "check-ignore", "-q", str(plot)], cwd=repo, timeout=30)
    assert out.returncode == 0, f"{plot} is not in .gitignore"


def test_without_torch_the_demo_says_which_extra_to_install() -> None:
    hide = "import sys; sys.modules['torch'] = None; "
    imported = subprocess.run(
        [sys.executable, "-c", hide + "import kvtier.integrations.demo"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    last = imported.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: kvtier's demo and transformers integration"), last
    assert "pip install '.[transformers]'" in last and "(torch is missing)" in last
    adapter = subprocess.run(  # the README's transformers example imports this module
        [sys.executable, "-c", hide + "from kvtier.integrations.transformers import KVTierCache"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    last = adapter.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: kvtier.integrations.transformers needs"), last
    assert "pip install '.[transformers]'" in last and "(torch is missing)" in last
    cli = subprocess.run(
        [sys.executable, "-c", hide + "from kvtier.cli import main; main(['demo', '--quick'])"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 1
    lines = cli.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier demo: "), lines
    assert "pip install '.[transformers]'" in lines[0] and "kvtier[" not in lines[0]

"""Every ```python block of README.md runs as written against a live server.

The server is started as the README says (`kvtier serve --address ipc:///tmp/kvtier.sock`),
with no L2 so nothing leaks between runs. Each block runs in its own interpreter, as a reader
pasting it would. A block preceded by `<!-- readme-test: skip: <reason> -->` is not run (it
needs a real vLLM/SGLang model, a cluster, a GPU); the reason must be given.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ServerProcess, start_server

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
ADDRESS = "ipc:///tmp/kvtier.sock"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip:\s*(?P<reason>[^>]*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, skip reason or None) of every ```python block."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if m.group(1) != "python":
            continue
        previous = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        skip = SKIP.match(previous.strip())
        blocks.append((start + 1, "\n".join(body) + "\n", skip.group("reason") if skip else None))
    return blocks


def shell_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every ```bash block."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if m.group(1) == "bash":
            out.append((start + 1, "\n".join(body) + "\n"))
    return out


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    if Path(ADDRESS.removeprefix("ipc://")).exists():
        probe = subprocess.run(
            [sys.executable, "-c", f"import kvtier; kvtier.Client({ADDRESS!r}, timeout=1).close()"],
            capture_output=True,
            timeout=30,
        )
        if probe.returncode == 0:
            pytest.fail(
                f"a kvtier server already listens on {ADDRESS}; the README test starts its own "
                "there: stop that server (e.g. `make run`) first"
            )
    srv = start_server("--l1-size", "256MiB", address=ADDRESS)
    try:
        yield srv
    finally:
        srv.stop()


def test_readme_has_runnable_blocks() -> None:
    assert len([b for b in BLOCKS if b[2] is None]) >= 3, BLOCKS
    for line, _, reason in BLOCKS:
        assert reason is None or reason.strip(), f"README.md:{line}: a skip needs its reason"


@pytest.mark.parametrize(
    ("line", "code", "skip"), BLOCKS, ids=[f"README.md:{b[0]}" for b in BLOCKS]
)
def test_readme_block_runs_as_written(
    server: ServerProcess, line: int, code: str, skip: str | None
) -> None:
    if skip is not None:
        pytest.skip(f"README.md:{line} is marked readme-test: skip: {skip}")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, (
        f"README.md:{line} failed:\n{result.stdout}\n{result.stderr}\n"
        f"server log:\n{server.output[-3000:]}"
    )

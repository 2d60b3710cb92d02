"""The README's code blocks, read the way a reader sees them: the README tests run the Python
blocks and check every shell command, and the packaging and deployment tests check the README's
install and deploy lines."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
#: The documents whose blocks are tested: the README and the guides it links to in docs/.
DOCUMENTS = (README, *(README.parent / "docs" / f"{name}.md" for name in (
    "install", "client", "vllm", "sglang", "operations", "configuration")))  # fmt: skip
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

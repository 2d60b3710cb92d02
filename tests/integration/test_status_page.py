"""The status page in a real headless Chromium, against a real `kvtier serve` process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client import Client

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOT = REPO / "docs" / "status-page.png"
TOKEN = "page-token/with?odd&chars"

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, str]]:
    """(admin URL, ZMQ address) of a `kvtier serve` that requires TOKEN."""
    address = f"ipc:///tmp/kvtier-page-{os.getpid()}-{time.monotonic_ns()}.sock"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "serve",
            "--address",
            address,
            "--l1-size",
            "64MiB",
            "--admin-port",
            "0",
            "--admin-token",
            TOKEN,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    found = threading.Event()
    lines: list[str] = []
    url: list[str] = []

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            match = re.search(r"admin: (http://\S+)", line)
            if match and not found.is_set():
                url.append(match.group(1))
                found.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert found.wait(60), "server printed no 'admin: URL' line:\n" + "".join(lines)
        yield url[0], address
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the status page test drives Debian's Chromium; install it "
            "with `apt-get install -y chromium`"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def store_and_lookup(address: str) -> tuple[int, int]:
    """Store two chunks, then look up a longer prompt; (hit tokens, requested tokens)."""
    with Client(address) as client:
        chunk = client.chunk_size
        tokens = list(range(4 * chunk))
        client.register(model="page-model", chunk_shape=(2, 4, 64), dtype="float16")
        kv = np.ones((2, 2, 4, 64), dtype=np.float16)
        assert client.store("page-writer", tokens[: 2 * chunk], kv, model="page-model") == 2 * chunk
        hit = client.lookup("page-reader", tokens, model="page-model")
        assert hit == 2 * chunk
        return hit, len(tokens)


def text_of(page: Any, element_id: str) -> str:
    return str(page.text_content(f"#{element_id}")).strip()


def as_int(text: str) -> int:
    return int(text.replace(",", ""))


def test_status_page_shows_live_numbers(server: tuple[str, str], browser: Any) -> None:
    from urllib.parse import quote

    url, address = server
    page = browser.new_page(viewport={"width": 1280, "height": 960})
    problems: list[str] = []
    page.on(
        "console",
        lambda m: (
            problems.append(f"console {m.type}: {m.text}")
            if m.type in ("error", "warning")
            else None
        ),
    )
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))

    page.goto(f"{url}/?token={quote(TOKEN, safe='')}")
    page.wait_for_function("document.getElementById('health').textContent === 'healthy'")
    assert text_of(page, "sessions-active") == "0"
    assert text_of(page, "lookup-hit-tokens") == "0"
    assert text_of(page, "l1-used") == "0 B"
    assert text_of(page, "l1-capacity") == "64.0 MiB"
    assert text_of(page, "hit-rate") == "\u2013"  # the placeholder dash: no lookups yet

    hit_tokens, requested_tokens = store_and_lookup(address)

    page.wait_for_function(
        "v => document.getElementById('lookup-hit-tokens').textContent === v",
        arg=f"{hit_tokens:,}",
        timeout=15_000,
    )
    assert as_int(text_of(page, "lookup-requested-tokens")) == requested_tokens
    assert text_of(page, "hit-rate") == f"{100 * hit_tokens / requested_tokens:.1f} %"
    assert text_of(page, "l1-used") != "0 B"
    assert as_int(text_of(page, "sessions-created")) >= 1
    assert text_of(page, "threads") != "none"
    # The chart drew something: some canvas pixel is not transparent.
    assert page.evaluate(
        """() => {
            const c = document.getElementById('hit-rate-chart');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            for (let i = 3; i < d.length; i += 4) if (d[i] !== 0) return true;
            return false;
        }"""
    )
    assert page.locator("#fetch-error").is_hidden()
    assert all(r.startswith(url) or r.startswith("data:") for r in requested), requested
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert problems == []


def test_status_page_without_token_shows_the_refusal(server: tuple[str, str], browser: Any) -> None:
    url, _ = server
    page = browser.new_page()
    response = page.goto(url + "/")
    assert response is not None and response.status == 401
    assert "Bearer" in page.content()

"""The status page in a real headless Chromium, against a real `kvtier serve` process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.client import Client
from tests.conftest import start_server

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
    srv = start_server("--l1-size", "64MiB", "--admin-token", TOKEN)
    try:
        assert srv.admin_url is not None
        yield srv.admin_url, srv.address
    finally:
        srv.stop()


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


def wait_for_text(page: Any, element_id: str, expected: str) -> None:
    page.wait_for_function(
        "([id, v]) => document.getElementById(id).textContent === v",
        arg=[element_id, expected],
        timeout=15_000,
    )


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

    with Client(address) as client:
        chunk = client.chunk_size
        tokens = list(range(4 * chunk))
        client.register(model="page-model", chunk_shape=(2, 4, 64), dtype="float16")
        kv = np.ones((2, 2, 4, 64), dtype=np.float16)
        assert client.store("page-writer", tokens[: 2 * chunk], kv, model="page-model") == 2 * chunk
        assert client.lookup("page-reader-1", tokens, model="page-model") == 2 * chunk
        wait_for_text(page, "lookup-hit-tokens", f"{2 * chunk:,}")
        assert as_int(text_of(page, "lookup-requested-tokens")) == 4 * chunk
        assert text_of(page, "hit-rate") == "50.0 %"
        assert text_of(page, "l1-used") != "0 B"
        assert text_of(page, "sessions-active") == "2"
        assert text_of(page, "clients-connected") == "1"
        assert text_of(page, "threads") != "none"

        # A second round moves every number again: 2 full hits out of 2 more chunks.
        assert client.lookup("page-reader-2", tokens[: 2 * chunk], model="page-model") == 2 * chunk
        wait_for_text(page, "lookup-hit-tokens", f"{4 * chunk:,}")
        assert as_int(text_of(page, "lookup-requested-tokens")) == 6 * chunk
        assert text_of(page, "hit-rate") == "66.7 %"
        assert text_of(page, "sessions-active") == "3"
        wait_for_text(page, "hit-rate-recent", "100.0 %")

    # The chart plotted the series: some pixels carry its colour (#2f6fde), not only the grid.
    blue_pixels = page.evaluate(
        """() => {
            const c = document.getElementById('hit-rate-chart');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0;
            for (let i = 0; i < d.length; i += 4) {
                const near = Math.abs(d[i] - 47) < 24 && Math.abs(d[i + 1] - 111) < 24
                    && Math.abs(d[i + 2] - 222) < 24 && d[i + 3] > 200;
                if (near) n += 1;
            }
            return n;
        }"""
    )
    assert blue_pixels > 0
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

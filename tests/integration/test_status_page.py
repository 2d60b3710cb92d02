"""The status page in a real headless Chromium, against a real `kvtier serve` process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit.servers import start_server

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
# The operations guide's picture is refreshed only on request (KVTIER_UPDATE_SCREENSHOT=1), so a
# test run leaves the work tree as it found it.
SCREENSHOT = REPO / "docs" / "status-page.png"
TOKEN = "page-token/with?odd&chars"  # typed into the page's sign-in, never put in a URL

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


def watch(page: Any, problems: list[str], requested: list[str]) -> None:
    """Collect console errors, failed requests and every URL the page asks for."""
    page.on(
        "console",
        lambda m: (
            problems.append(f"console {m.type}: {m.text}")
            if m.type in ("error", "warning") and "401" not in m.text
            else None
        ),
    )
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    page.on("request", lambda r: requested.append(r.url))


def blue_pixels(page: Any) -> int:
    """Pixels of the chart in the series colour (#2f6fde), not only the grid."""
    return int(
        page.evaluate(
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
    )


def test_status_page_shows_live_numbers(server: tuple[str, str], browser: Any) -> None:
    url, address = server
    context = browser.new_context(viewport={"width": 1280, "height": 1400})
    page = context.new_page()
    problems: list[str] = []
    requested: list[str] = []
    watch(page, problems, requested)

    # No token in the URL: the page asks for it, while /health (never behind a token) shows.
    page.goto(url + "/")
    page.wait_for_selector("#login:not(.hidden)")
    page.wait_for_function("document.getElementById('health').textContent === 'healthy'")
    page.fill("#login-token", "wrong")
    page.click("#login-submit")
    wait_for_text(page, "login-error", "wrong token")
    page.fill("#login-token", TOKEN)
    page.click("#login-submit")
    page.wait_for_selector("#login", state="hidden")
    wait_for_text(page, "l1-capacity", "64.0 MiB")
    assert text_of(page, "sessions-active") == "0"
    assert text_of(page, "lookup-hit-tokens") == "0"
    assert text_of(page, "l1-used") == "0 B"
    assert text_of(page, "hit-rate") == "\u2013"  # the placeholder dash: no lookups yet
    config = text_of(page, "config")
    assert "l1_size" in config and "***" in config and TOKEN not in page.content()

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
        assert text_of(page, "stored-bytes") == "2.0 KiB"
        assert text_of(page, "sessions-active") == "2"
        assert text_of(page, "clients-connected") == "1"
        assert client.client_id[:8] in text_of(page, "clients")
        assert client.client_id not in page.content()
        assert "page-model rank 0/1 float16" in text_of(page, "clients")
        assert text_of(page, "threads") != "none"
        assert "page-model" in text_of(page, "models") and "50.0 %" in text_of(page, "models")
        latency = text_of(page, "latency")
        assert "lookup" in latency and "store" in latency and "Reserve" not in latency
        misses = text_of(page, "misses")  # chunks 2 and 3 of the lookup: never stored
        assert "never_stored" in misses and f"{2 * chunk:,}" in misses and "100.0 %" in misses

        # A second round moves every number again: 2 full hits out of 2 more chunks.
        assert client.lookup("page-reader-2", tokens[: 2 * chunk], model="page-model") == 2 * chunk
        wait_for_text(page, "lookup-hit-tokens", f"{4 * chunk:,}")
        assert as_int(text_of(page, "lookup-requested-tokens")) == 6 * chunk
        assert text_of(page, "hit-rate") == "66.7 %"
        assert text_of(page, "sessions-active") == "3"

    assert blue_pixels(page) > 0
    assert page.locator("#fetch-error").is_hidden()
    shot = page.screenshot(full_page=True)
    assert shot.startswith(b"\x89PNG")
    if os.environ.get("KVTIER_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.write_bytes(shot)

    # A reload keeps the history (the server holds it) and the sign-in (an HttpOnly cookie).
    page.reload()
    wait_for_text(page, "lookup-hit-tokens", f"{4 * chunk:,}")
    assert page.locator("#login").is_hidden()
    page.wait_for_function("document.getElementById('history-span').textContent !== '\u2013'")
    assert blue_pixels(page) > 0
    assert page.evaluate("document.cookie") == "", "the cookie is HttpOnly: no script reads it"
    assert all(r.startswith(url) or r.startswith("data:") for r in requested), requested
    assert not [r for r in requested if "token" in r.lower()], "no token in any URL"
    assert problems == []
    context.close()


def test_status_page_shows_degraded_health(browser: Any) -> None:
    from testkit.servers import free_port

    dead = f"redis://127.0.0.1:{free_port()}/0?connect_timeout=0.2&cooldown=0.5"
    srv = start_server("--l1-size", "64MiB", "--l2", dead)
    try:
        assert srv.admin_url is not None
        page = browser.new_page()
        page.goto(srv.admin_url + "/")  # loopback without --admin-token: reads are open
        page.wait_for_function(
            "document.getElementById('health').textContent === 'degraded'", timeout=20_000
        )
        assert "L2 tier redis is failing" in text_of(page, "health-reasons")
        page.wait_for_function(
            "document.getElementById('l2-tiers').textContent.includes('failing')"
        )
        page.close()
    finally:
        srv.stop()


def test_a_long_model_name_wraps_inside_the_models_card(
    server: tuple[str, str], browser: Any
) -> None:
    """vLLM names a model `vllm:<path>:<weights fingerprint>:<dtype>:b<block>`: a hundred
    characters and more without a space. The Models card keeps to its column."""
    url, address = server
    context = browser.new_context(viewport={"width": 1280, "height": 1400})
    page = context.new_page()
    page.goto(url + "/")
    page.wait_for_selector("#login:not(.hidden)")
    page.fill("#login-token", TOKEN)
    page.click("#login-submit")
    page.wait_for_selector("#login", state="hidden")
    model = (
        "vllm:/models/meta-llama/Llama-3.1-8B-Instruct:" + "0123456789abcdef" * 4 + ":bfloat16:b32"
    )
    with Client(address) as client:
        client.register(model=model, chunk_shape=(2, 4, 64), dtype="float16")
        client.lookup("long-name", list(range(client.chunk_size)), model=model)
        page.wait_for_function(
            "m => document.getElementById('models').textContent.includes(m)", arg=model
        )
    sizes = page.evaluate(
        """() => {
        const card = document.getElementById('models').closest('section');
        const cell = document.querySelector('#models td');
        return {card: card.getBoundingClientRect().width, scroll: card.scrollWidth,
                client: card.clientWidth, cell: cell.getBoundingClientRect().right,
                right: card.getBoundingClientRect().right};
    }"""
    )
    assert sizes["scroll"] <= sizes["client"], sizes  # nothing sticks out of the card
    assert sizes["cell"] <= sizes["right"], sizes
    assert sizes["card"] < 640, sizes  # still one column of the grid, not stretched
    context.close()

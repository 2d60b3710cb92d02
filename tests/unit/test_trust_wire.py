"""The pure parts of the wire's defences: redaction, credential lookup, Host names, bounds."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvtier import protocol as p
from kvtier.config import ConfigError, ServerConfig
from kvtier.errors import NoSpaceError, UnauthorizedError
from kvtier.redaction import MAX_REDACTED_CHARS, redact
from kvtier.server.auth import Authenticator, Credential
from kvtier.server.fencing import ProcessWatches
from kvtier.server.observe.admin_access import is_loopback_name
from kvtier.server.transport import frame_limit


@pytest.mark.parametrize(
    "text",
    [
        "a" * 40_000,  # the letters the old pattern's scheme part backtracked over
        "a://b:" * 7_000,
        "redis://:" + "x" * 40_000,  # a password with no "@"
        "token=" * 7_000,
        "x:" * 20_000 + "@",
    ],
)
def test_redaction_is_fast_on_hostile_text(text: str) -> None:
    """40 KB of letters took the old regex 11 s."""
    t0 = time.monotonic()
    out = redact(text)
    assert time.monotonic() - t0 < 1.0
    assert len(out) <= MAX_REDACTED_CHARS + 64


def test_redaction_is_linear_when_asked_for_long_texts() -> None:
    t0 = time.monotonic()
    redact("a" * 2_000_000 + "://u:" + "p" * 2_000_000 + "@h", limit=10**8)
    assert time.monotonic() - t0 < 5.0  # quadratic would be hours


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://:p@ss@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://user:a:b@c@h/0", "redis://user:***@h/0"),
        ("redis://:a/b@c@h:1/0", "redis://:***@h:1/0"),  # a raw "/" too
        ("rediss://u:pw@10.0.0.1:6380 down", "rediss://u:***@10.0.0.1:6380 down"),
        ("'redis://:pw@h', 'redis://:pw2@g'", "'redis://:***@h', 'redis://:***@g'"),
        ("redis://h/0?password=p@w&ttl=3", "redis://h/0?password=***&ttl=3"),
        ("x TOKEN=abc&Secret=d PASSWD=e", "x TOKEN=***&Secret=*** PASSWD=***"),
        ("disk:///var/lib/kvtier@x?size=1GiB", "disk:///var/lib/kvtier@x?size=1GiB"),
        ("redis://user@h:1/0", "redis://user@h:1/0"),
    ],
)
def test_redaction_hides_every_password_character(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_a_cut_text_never_shows_part_of_a_password() -> None:
    """Cut before its "@", a URL would show the start of its password: the cut word goes."""
    text = "failed: " + "x " * 2040 + "redis://:" + "s3cret" * 10 + "@host/0"
    out = redact(text)
    assert "s3cret" not in out and "more characters not shown" in out
    assert "s3cret" not in redact("redis://:" + "s3cret" * 1000 + "@h")


def test_a_credential_check_costs_the_same_however_many_credentials() -> None:
    """A 200 MB token was compared with each credential in turn (49.9 s with 64)."""
    tokens = {f"token-{i:04d}-0123456789abcdef": Credential(f"t{i}") for i in range(4096)}
    auth = Authenticator(tokens)
    assert auth.authenticate("token-4095-0123456789abcdef").tenant == "t4095"
    t0 = time.monotonic()
    for given in ("x" * (50 << 20), "token-0000-0123456789abcdeF", ""):
        with pytest.raises(UnauthorizedError):
            auth.authenticate(given)
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("localhost:8080", True),
        ("127.0.0.1:1", True),
        ("127.5.5.5", True),
        ("[::1]", True),
        ("[::1]:80", True),
        ("evil.example", False),
        ("evil.example:80", False),
        ("localhost.evil.example", False),
        ("[::1]x", False),
        ("10.0.0.1", False),
        ("[::2]", False),
        ("localhost:ab", False),
    ],
)
def test_loopback_host_names(host: str, loopback: bool) -> None:
    assert is_loopback_name(host) is loopback


def test_a_short_admin_token_is_refused_off_loopback_only() -> None:
    with pytest.raises(ConfigError, match="--admin-token: 1 characters"):
        ServerConfig(admin_host="0.0.0.0", admin_token="x")
    ServerConfig(admin_host="127.0.0.1", admin_token="x")  # loopback: the operator's call
    ServerConfig(admin_host="0.0.0.0", admin_token="x" * 16)


def test_the_frame_bound_follows_the_request_bounds_never_the_l1() -> None:
    header = frame_limit(256 << 20, 1 << 20)  # headers are the biggest frames
    assert 4 << 20 < header < 16 << 20
    assert frame_limit(1 << 20, 1 << 20) == 1 << 20
    # short requests: the bound is a piece of inline KV, or the most chunk names
    assert p.INLINE_FRAME_BYTES <= frame_limit(256 << 20, 1 << 10) < 8 << 20


def test_one_pidfd_per_process_and_none_past_the_bound() -> None:
    watches = ProcessWatches(limit=1)
    a = watches.watch(os.getpid())
    b = watches.watch(os.getpid())
    assert a is b and a is not None and len(watches) == 1
    # a live process to watch, killed below: its sleep is no synchronization
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(NoSpaceError, match="max-watched-processes"):
            watches.watch(child.pid)
    finally:
        child.kill()
        child.wait()
    a.release()  # (mypy: a is b and not None, asserted above)
    assert b is not None
    b.release()
    assert len(watches) == 0


def test_out_of_descriptors_is_a_typed_refusal() -> None:
    """EMFILE at pidfd_open refuses the watch with NO_SPACE; the process goes on."""
    script = (
        "import os, resource\n"
        "from kvtier.errors import NoSpaceError\n"
        "from kvtier.server.fencing import ProcessWatches\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "fds = []\n"
        "try:\n"
        "    while True: fds.append(os.open('/dev/null', os.O_RDONLY))\n"
        "except OSError: pass\n"
        "try:\n"
        "    ProcessWatches(limit=100).watch(os.getppid())\n"
        "    print('watched')\n"
        "except NoSpaceError as exc:\n"
        "    print('refused', exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused") and "descriptor" in out.stdout

"""server/auth.py: tokens file, credentials, loopback detection and redaction."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.errors import UnauthorizedError
from kvtier.redaction import redact
from kvtier.server.auth import ANONYMOUS, Authenticator, is_local_address


def test_tokens_file_maps_tokens_to_tenants_and_salts(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# comment\n\naaaaaaaaaaaaaaaa alpha\nbbbbbbbbbbbbbbbb beta s1 s2  # note\n")
    auth = Authenticator.from_file(str(path))
    assert auth.required
    alpha = auth.authenticate("aaaaaaaaaaaaaaaa")
    assert alpha.tenant == "alpha" and alpha.salts is None
    alpha.check_salt("anything")
    beta = auth.authenticate("bbbbbbbbbbbbbbbb")
    assert beta.salts == {"s1", "s2"}
    beta.check_salt("s2")
    with pytest.raises(UnauthorizedError, match="not allowed"):
        beta.check_salt("s3")
    with pytest.raises(UnauthorizedError, match="not known"):
        auth.authenticate("c" * 16)
    with pytest.raises(UnauthorizedError, match="requires a credential"):
        auth.authenticate("")


@pytest.mark.parametrize("text", ["short alpha\n", "aaaaaaaaaaaaaaaa\n", "# nothing\n"])
def test_a_bad_tokens_file_is_refused_naming_the_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ValueError, match="tokens"):
        Authenticator.from_file(str(path))


def test_without_a_file_everyone_is_the_anonymous_tenant() -> None:
    auth = Authenticator.from_file(None)
    assert not auth.required and auth.authenticate("whatever") is ANONYMOUS


@pytest.mark.parametrize(
    ("address", "local"),
    [
        ("ipc:///tmp/x.sock", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.1.2.3:5555", False),
    ],
)
def test_loopback_detection(address: str, local: bool) -> None:
    assert is_local_address(address) is local


def test_redact_hides_url_passwords_and_secret_parameters() -> None:
    assert redact("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("failed: rediss://user:pw@10.0.0.1:6380 down") == (
        "failed: rediss://user:***@10.0.0.1:6380 down"
    )
    assert redact("redis://h/0?password=pw&ttl=3") == "redis://h/0?password=***&ttl=3"
    assert redact("disk:///var/lib/kvtier?size=1GiB") == "disk:///var/lib/kvtier?size=1GiB"

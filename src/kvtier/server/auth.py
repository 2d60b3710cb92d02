"""Who may talk to the data port, and in whose name: credentials checked at the handshake.

A tokens file lists one credential a line: `TOKEN TENANT [SALT ...]`. A client names its token
in Hello; the connection then acts for TENANT: its sessions, layouts and chunk names live in
that tenant's namespace (two tokens with the same TENANT share them: the scheduler and workers
of one engine), and it may use only the listed cache salts (none listed: any). Without a tokens
file every client is the anonymous tenant "", which the server allows only on ipc:// and
loopback tcp, where the operating system already decides who can connect.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import UnauthorizedError

__all__ = [
    "ANONYMOUS",
    "Authenticator",
    "Credential",
    "is_local_address",
]


@dataclass(frozen=True, slots=True)
class Credential:
    """What one token allows: acting for `tenant`, under `salts` (None: any salt)."""

    tenant: str
    salts: frozenset[str] | None = None

    def check_salt(self, cache_salt: str) -> None:
        if self.salts is not None and cache_salt not in self.salts:
            raise UnauthorizedError(
                f"cache_salt {cache_salt[:64]!r} is not allowed for tenant {self.tenant!r} "
                "(see its line in --auth-tokens-file)"
            )


ANONYMOUS = Credential("")


#: the longest token a tokens file may hold (a Hello's token is bounded alike, in limits.py)
MAX_TOKEN_CHARS = 1024


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class Authenticator:
    """The credentials a server accepts; empty means authentication is off.

    Credentials are kept by the SHA-256 of their token: a Hello's token (bounded before, to
    MAX_TOKEN_CHARS) is hashed once and looked up, then compared with the stored token by
    `hmac.compare_digest`. Checking costs one hash and one comparison however many credentials
    there are (a loop over all of them took 49.9 s for a 200 MB token and 64 credentials), and
    the lookup's timing depends only on digests, which tell nothing about a token.
    """

    def __init__(self, credentials: dict[str, Credential] | None = None) -> None:
        self._credentials: dict[bytes, tuple[bytes, Credential]] = {}
        for token, credential in (credentials or {}).items():
            raw = token.encode("utf-8", "surrogatepass")
            self._credentials[_digest(raw)] = (raw, credential)

    @property
    def required(self) -> bool:
        return bool(self._credentials)

    @classmethod
    def from_file(cls, path: str | None) -> Authenticator:
        """Read a tokens file (see the module doc); ValueError names the line that is wrong."""
        if not path:
            return cls()
        credentials: dict[str, Credential] = {}
        text = Path(path).expanduser().read_text()
        for n, line in enumerate(text.splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) < 2 or not 16 <= len(words[0]) <= MAX_TOKEN_CHARS:
                raise ValueError(
                    f"{path}:{n}: expected 'TOKEN TENANT [SALT ...]' with a token of 16 to "
                    f"{MAX_TOKEN_CHARS} characters"
                )
            token, tenant, *salts = words
            credentials[token] = Credential(tenant, frozenset(salts) if salts else None)
        if not credentials:
            raise ValueError(f"{path}: no credentials in the tokens file")
        return cls(credentials)

    def authenticate(self, token: str) -> Credential:
        """The credential a Hello's token stands for; UnauthorizedError when none."""
        if not self.required:
            return ANONYMOUS
        found: Credential | None = None
        if len(token) <= MAX_TOKEN_CHARS:
            given = token.encode("utf-8", "surrogatepass")
            entry = self._credentials.get(_digest(given))
            if entry is not None and hmac.compare_digest(entry[0], given):
                found = entry[1]
        if found is None:
            raise UnauthorizedError(
                "this server requires a credential: pass Client(..., token=...) with a token "
                "from its --auth-tokens-file" + (" (the one given is not known)" if token else "")
            )
        return found


def is_local_address(address: str) -> bool:
    """True for ipc:// and inproc:// addresses and tcp ones bound to a loopback interface."""
    if not address.startswith("tcp://"):
        return True
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host in ("*", "", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:  # a host name: loopback when every address it names is
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)

"""Who may use the admin API: the token a server generates (kept in a file only its user can
read) and which hosts only this machine reaches."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

from kvtier.config.options import ConfigError

ADMIN_TOKEN_ENV = "KVTIER_ADMIN_TOKEN"

#: the shortest --admin-token accepted where other machines can reach the admin API
MIN_ADMIN_TOKEN_CHARS = 16


def is_loopback_host(host: str) -> bool:
    """True when `host` (a name or address to bind) only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def _runtime_dir() -> Path:
    """A folder only this user can enter: $XDG_RUNTIME_DIR/kvtier or /tmp/kvtier-<uid>."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "kvtier" if base else Path(f"/tmp/kvtier-{os.getuid()}")
    return path


def admin_token_file(port: int, *, create_dir: bool = False) -> Path:
    """Where a server whose admin API listens on `port` keeps its generated token (mode 0600).

    `kvtier clear` and `kvtier status` read it when no --token is given. The folder is refused
    when another user owns it or can enter it (someone could have planted a token there).
    """
    folder = _runtime_dir()
    if create_dir:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.exists():
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ConfigError(
                f"{folder} must be a folder of this user with mode 0700 to hold the admin token "
                "file; remove it, or set --admin-token"
            )
    return folder / f"admin-{port}.token"

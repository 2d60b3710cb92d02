"""The URL options both Redis tiers take, and the check of their values."""

from __future__ import annotations

from kvtier.storage.tiers.codecs import parse_codec
from kvtier.storage.tiers.options import PARSERS

#: URL query options of both Redis tiers -> parser
OPTIONS = {
    "prefix": PARSERS["str"],
    "ttl": PARSERS["optional_int"],
    "connect_timeout": PARSERS["seconds"],
    "timeout": PARSERS["seconds"],
    "cooldown": PARSERS["seconds"],
    "max_connections": PARSERS["int"],
    "codec": parse_codec,
}


def check_options(
    prefix: str, ttl: int | None, connect_timeout: float, timeout: float, cooldown: float
) -> None:
    """Raise ValueError for option values neither Redis tier accepts."""
    if not prefix or "{" in prefix or "}" in prefix:
        raise ValueError(f"prefix must be non-empty and free of braces, got {prefix!r}")
    if ttl is not None and ttl <= 0:
        raise ValueError(f"ttl must be a positive number of seconds or None, got {ttl}")
    if min(connect_timeout, timeout) <= 0 or cooldown < 0:
        raise ValueError(
            f"connect_timeout and timeout must be > 0 and cooldown >= 0, got "
            f"{connect_timeout}, {timeout}, {cooldown}"
        )

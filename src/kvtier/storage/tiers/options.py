"""URL option parsing shared by every L2 tier: one place that knows the option syntax and
turns a bad value into an error naming the option, the value and the URL (password redacted)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import SplitResult, parse_qs, urlsplit

from kvtier.config.sizes import parse_size
from kvtier.redaction import redact

Parser = Callable[[str], Any]


def as_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use 1/0, true/false, yes/no, on/off)")


def as_seconds(text: str) -> float:
    return float(text)


def as_optional_int(text: str) -> int | None:
    """An int, or None for an empty value (e.g. `ttl=` for no TTL)."""
    return int(text) if text else None


PARSERS: dict[str, Parser] = {
    "int": int,
    "size": parse_size,
    "seconds": as_seconds,
    "bool": as_bool,
    "str": str,
    "optional_int": as_optional_int,
}


def parse_url(
    url: str, options: Mapping[str, Parser], *, tier: str
) -> tuple[SplitResult, dict[str, Any]]:
    """Split `url` and parse its query with `options` (name -> parser); unknown options and
    bad values raise ValueError naming them. Returns the split URL and the parsed options (only
    those present, last occurrence wins)."""
    parts = urlsplit(url)
    if "#" in url:
        # A raw '#' starts a fragment: in a password it would cut the URL there and make the
        # rest of the password look like the host, which then shows in the tier's errors.
        raise ValueError(
            f"a {tier} tier URL cannot hold a raw '#' ({redact(url)!r}): no tier uses a "
            "fragment; percent-encode a '#' in a password as %23"
        )
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = sorted(set(query) - set(options))
    if unknown:
        raise ValueError(
            f"unknown {tier} tier URL options {unknown} in {redact(url)!r} "
            f"(known: {', '.join(sorted(options))})"
        )
    parsed: dict[str, Any] = {}
    for name, text in query.items():
        try:
            parsed[name] = options[name](text)
        except ValueError as exc:
            raise ValueError(
                f"bad {tier} tier URL option {name}={text!r} in {redact(url)!r}: {exc}"
            ) from None
    return parts, parsed

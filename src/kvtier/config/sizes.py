"""Byte sizes as people write them ("50GiB", "512MiB") and as the server shows them."""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int, *, require_unit: bool = False) -> int:
    """Bytes in a size such as "50GiB", "512MiB", "1G", "1.5KiB", "4096B" (or "4096").

    Follows coreutils: "K"/"KiB" are powers of 1024, "KB" (a B without the i) powers of 1000.
    With `require_unit` (sizes typed by a person) a bare number is refused: `--l1-size 2` meant
    2 GiB, not 2 bytes.
    """
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if m is None or (not m.group(2) and m.group(3)):
        raise ValueError(f"not a byte size: {text!r} (expected e.g. '50GiB', '512MiB', '4096B')")
    if require_unit and not m.group(2) and not m.group(4):
        raise ValueError(
            f"{text!r} has no unit: write e.g. '{m.group(1)}GiB', '{m.group(1)}MiB' or "
            f"'{m.group(1)}B'"
        )
    number, unit, binary, b_suffix = m.groups()
    power = "kmgtp".index(unit.lower()) + 1 if unit else 0
    base = 1000 if b_suffix and not binary else 1024
    value = float(number) * base**power
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def format_size(num_bytes: int) -> str:
    """The inverse of parse_size for display: 2147483648 -> "2GiB"."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:g}{unit}" if unit != "B" else f"{int(value)}B"
        value /= 1024
    raise AssertionError("unreachable")

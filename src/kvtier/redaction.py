"""Credentials out of everything a person or a log may read: one function for URLs and messages.

Status, logs, error replies and the CLI all show L2 URLs and messages that quote them; each
passes them through `redact`, so a Redis password or a token never leaves the process.
"""

from __future__ import annotations

import re

__all__ = ["redact"]

_URL_PASSWORD = re.compile(r"([a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s]*@", re.IGNORECASE)
_SECRET_QUERY = re.compile(r"((?:password|passwd|token|secret)=)[^&\s]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` (a URL, or a message that quotes one) with URL passwords (`redis://:pw@host`)
    and secret query parameters replaced by `***`."""
    return _SECRET_QUERY.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))

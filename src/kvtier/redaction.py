"""Credentials out of everything a person or a log may read: one function for URLs and messages.

Status, logs, error replies and the CLI all show L2 URLs and messages that quote them; each
passes them through `redact`, so a Redis password or a token never leaves the process.

Messages can quote what a client sent, so `redact` must cost time in proportion to its input and
its input must be bounded: it first cuts the text to `MAX_REDACTED_CHARS`, then scans it once with
`str.find` (no regular expression: the earlier pattern backtracked, and 40 KB of letters took the
server 11 s, holding the GIL).
"""

from __future__ import annotations

__all__ = ["MAX_REDACTED_CHARS", "redact"]

#: the longest text `redact` returns unshortened; a longer one is cut, its last word dropped
MAX_REDACTED_CHARS = 4096

_MASK = "***"
#: query parameters whose value is a secret (matched without regard to ASCII case)
_SECRET_KEYS = ("password=", "passwd=", "token=", "secret=")
#: ASCII upper to lower only: keeps every index of the text (str.lower may not, e.g. for "İ")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_WHITESPACE = frozenset(" \t\n\r\f\v")


def _word_end(text: str, start: int) -> int:
    """The index of the first whitespace at or after `start` (len(text) if none)."""
    end = start
    n = len(text)
    while end < n and text[end] not in _WHITESPACE:
        end += 1
    return end


def _redact_url_passwords(text: str) -> str:
    """`scheme://user:PASSWORD@host` -> `scheme://user:***@host`, where PASSWORD may hold any
    character but whitespace, `@` included (as urllib, and so redis-py, read it) and even `/`
    (which urllib would not): the userinfo ends at the last `@` of the word. So a `:` before an
    `@` in a path or query hides what lies between (`redis://h:6379/0?x=a@b` shows as
    `redis://h:***@b`), and several URLs in one word lose everything between the first `user:`
    and the last `@`: too much hidden, never too little. One pass: every character is
    looked at a bounded number of times."""
    out: list[str] = []
    pos = 0
    while True:
        sep = text.find("://", pos)
        if sep < 0:
            break
        start = sep + 3
        end = _word_end(text, start)
        at = text.rfind("@", start, end)
        colon = text.find(":", start, at) if at >= 0 else -1
        if colon >= 0:
            out.append(text[pos : colon + 1])
            out.append(_MASK)
            pos = at  # the "@host..." rest is copied by the next round
        else:
            out.append(text[pos:end])
            pos = end
    out.append(text[pos:])
    return "".join(out)


def _redact_secret_queries(text: str) -> str:
    """`password=VALUE` (and passwd, token, secret; any ASCII case) -> `password=***`, the value
    ending at `&` or whitespace."""
    folded = text.translate(_ASCII_LOWER)
    spans: list[tuple[int, int]] = []  # (value start, value end), in order, disjoint
    for key in _SECRET_KEYS:
        i = folded.find(key)
        while i >= 0:
            start = i + len(key)
            end = start
            while end < len(text) and text[end] != "&" and text[end] not in _WHITESPACE:
                end += 1
            spans.append((start, end))
            i = folded.find(key, end)
    if not spans:
        return text
    spans.sort()
    out: list[str] = []
    pos = 0
    for start, end in spans:
        if start < pos:  # inside a value already masked ("token=password=x")
            continue
        out.append(text[pos:start])
        out.append(_MASK)
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _shorten(text: str, limit: int) -> str:
    """`text` cut to `limit` characters; the cut word is dropped whole, since a URL cut before
    its `@` would show part of its password."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    last_space = max(head.rfind(c) for c in _WHITESPACE)
    head = head[: last_space + 1] if last_space >= 0 else ""
    return f"{head}[... {len(text) - len(head)} more characters not shown]"


def redact(text: str, *, limit: int = MAX_REDACTED_CHARS) -> str:
    """`text` (a URL, or a message that quotes one) with URL passwords (`redis://:pw@host`)
    and secret query parameters replaced by `***`, cut to about `limit` characters."""
    return _redact_secret_queries(_redact_url_passwords(_shorten(text, limit)))

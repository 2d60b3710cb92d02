"""How both Redis tiers clear: the keys of a pattern found by SCAN and UNLINKed (never FLUSHDB)."""

from __future__ import annotations

import re

import redis

_CLEAR_BATCH = 512


def glob_escape(text: str) -> str:
    """`text` with SCAN MATCH's special characters escaped."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def scan_unlink(client: redis.Redis, pattern: str, *, one_by_one: bool) -> int:
    """UNLINK the keys of `client`'s server matching `pattern`, found by SCAN (never FLUSHDB).

    `one_by_one` sends one UNLINK per key (pipelined): a cluster refuses multi-key commands
    across slots.
    """
    removed = 0
    batch: list[bytes] = []

    def flush() -> int:
        if not one_by_one:
            return int(client.unlink(*batch))
        pipe = client.pipeline(transaction=False)
        for name in batch:
            pipe.unlink(name)
        return sum(int(n) for n in pipe.execute())

    for name in client.scan_iter(match=pattern, count=1000):
        batch.append(name)
        if len(batch) >= _CLEAR_BATCH:
            removed += flush()
            batch.clear()
    if batch:
        removed += flush()
    return removed

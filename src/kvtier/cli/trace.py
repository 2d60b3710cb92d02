"""Mooncake-format request traces: reading them, and the tokens each block of one stands for.

A trace is JSON lines, one request a line: `timestamp` (ms), `input_length` and
`output_length` (tokens) and `hash_ids`, the prompt's blocks of `BLOCK_TOKENS` tokens as prefix
hashes (remapped to small integers): equal ids at the same position are the same prefix, so a
block's tokens can be derived from its id alone. `block_tokens(id)` does, deterministically, so a
replayed prompt is named by the server exactly as the chain of ids says: equal chains give equal
chunk names, and different ids different ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

__all__ = ["BLOCK_TOKENS", "TraceError", "TraceRequest", "block_tokens", "prompt_tokens", "read"]

#: Tokens per block of a Mooncake trace (and per chunk of a replaying server).
BLOCK_TOKENS = 512

_POSITIONS = np.arange(BLOCK_TOKENS - 2, dtype=np.uint32)


class TraceError(ValueError):
    """A trace file that cannot be read: the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    timestamp: float  # ms from the trace's start
    input_length: int  # prompt tokens
    output_length: int
    hash_ids: tuple[int, ...]  # the prompt's blocks, head first


def read(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests (None: all) of the trace at `path`; TraceError naming the line
    of anything that is not a request."""
    requests: list[TraceRequest] = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if line.strip():
                    requests.append(_request(line, f"{path}:{number}"))
    except OSError as exc:
        raise TraceError(f"cannot read the trace {path}: {exc.strerror or exc}") from None
    return requests


def _request(line: str, where: str) -> TraceRequest:
    try:
        raw = json.loads(line)
    except ValueError as exc:
        raise TraceError(f"{where}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    ids = raw.get("hash_ids")
    length = raw.get("input_length")
    if not isinstance(ids, list) or not all(type(h) is int and h >= 0 for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
    if type(length) is not int or length < 0:
        raise TraceError(f"{where}: input_length must be a non-negative integer")
    timestamp = raw.get("timestamp", 0)
    output = raw.get("output_length", 0)
    if not isinstance(timestamp, int | float) or type(output) is not int:
        raise TraceError(f"{where}: timestamp and output_length must be numbers")
    return TraceRequest(float(timestamp), length, output, tuple(ids))


def block_tokens(hash_id: int) -> npt.NDArray[np.uint32]:
    """The `BLOCK_TOKENS` tokens block `hash_id` stands for: the id's low and high 32 bits, then
    0, 1, 2, ... (distinct ids, distinct blocks)."""
    head = np.array([hash_id & 0xFFFFFFFF, (hash_id >> 32) & 0xFFFFFFFF], dtype=np.uint32)
    return np.concatenate([head, _POSITIONS])


def prompt_tokens(hash_ids: tuple[int, ...] | list[int]) -> npt.NDArray[np.uint32]:
    """The whole prompt of these blocks: `len(hash_ids) * BLOCK_TOKENS` tokens."""
    if not hash_ids:
        return np.empty(0, dtype=np.uint32)
    return np.concatenate([block_tokens(h) for h in hash_ids])

"""KV data the tests store and check: the `server` fixture's chunk size and a small chunk
shape, deterministic KV bytes (so separate processes can check each other's data), prompts, and
a client in a process of its own."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any, TypedDict

import numpy as np

from kvtier.client import Client

CS = 16  # the `server` fixture's chunk size
SHAPE = (2, 2, CS, 4, 8)  # layers, K/V, tokens, heads, head_dim: 2 KiB per chunk in float16


class SlotArgs(TypedDict):
    """The keywords `Client.store_slots` / `retrieve_slots` need beside the range, as one dict a
    test can pass as `**common` (typed, so the overloads still check)."""

    model: str
    chunk_shape: tuple[int, ...]
    dtype: str


class SlotRangeArgs(SlotArgs):
    """`SlotArgs` and the range's end."""

    end: int


def kv_for(seed: int, num_chunks: int = 1, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """Deterministic KV bytes, so separate processes can check each other's data."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((num_chunks, *shape)).astype(np.float16)


def prompt(n: int, num_chunks: int = 1) -> list[int]:
    """Tokens of the n-th distinct prompt."""
    return list(range(n * 100_000, n * 100_000 + num_chunks * CS))


def store_in_process(address: str, tokens: list[int], seed: int, queue: Any) -> None:
    """Store kv_for(seed) under `tokens`; put the stored token count on `queue`."""
    with Client(address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        queue.put(c.store("writer", tokens, kv_for(seed, len(tokens) // CS), model="m"))


def retrieve_in_process(address: str, tokens: list[int], seed: int, queue: Any) -> None:
    """Look up and retrieve `tokens`; put (hit, retrieved, bytes equal kv_for(seed)) on `queue`."""
    with Client(address) as c:
        c.register(model="m", chunk_shape=SHAPE, dtype="float16")
        hit = c.lookup("reader", tokens, model="m")
        expected = kv_for(seed, len(tokens) // CS)[: hit // CS]
        out = np.zeros_like(expected)
        got = c.retrieve("reader", tokens, out, model="m") if hit else 0
        queue.put((hit, got, bool(np.array_equal(out, expected))))


def in_process(target: Callable[..., None], *args: Any) -> Any:
    """Run `target(*args, queue)` in a fresh (spawned) process and return what it put."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get(timeout=60)
    proc.join(30)
    return result

"""Helpers shared by the trust tests (issue 10): real servers, real client processes."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from kvtier import protocol as p
from kvtier.client import Client

from ..conftest import ServerProcess

CS = 16
SHAPE = (8, 2, CS, 4, 8)  # 16 KiB per chunk in float16: a 64 KiB L1 holds four
SPAWN = mp.get_context("spawn")


def kv_for(seed: int, num_chunks: int = 1, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """Deterministic KV bytes, so separate processes can check each other's data."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((num_chunks, *shape)).astype(np.float16)


def prompt(n: int, num_chunks: int = 1) -> list[int]:
    """Tokens of the n-th distinct prompt."""
    return list(range(n * 100_000, n * 100_000 + num_chunks * CS))


def status(server: ServerProcess, token: str | None = None) -> dict[str, Any]:
    assert server.admin_url is not None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    reply = httpx.get(server.admin_url + "/status", timeout=5, headers=headers)
    return reply.json()  # type: ignore[no-any-return]


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def reserve(c: Client, request_id: str, tokens: list[int], *, salt: str = "") -> p.ReserveReply:
    """Store step 1 by hand, so a test can hold a staging slot as long as it likes."""
    n = len(tokens) // CS
    raw = np.asarray(tokens, dtype="<u4").tobytes()
    reply, _ = c._call(
        p.Reserve(request_id, raw, "m", 1, 0, 0, n * CS, list(SHAPE), "float16", n, salt)
    )
    assert isinstance(reply, p.ReserveReply)
    return reply


def retrieve_lease(c: Client, request_id: str, tokens: list[int]) -> p.RetrieveReply:
    """Retrieve step 1 by hand: offsets and a lease, copied out whenever the test says."""
    n = len(tokens) // CS
    raw = np.asarray(tokens, dtype="<u4").tobytes()
    reply, _ = c._call(p.Retrieve(request_id, raw, "m", 1, 0, 0, n * CS, list(SHAPE), "float16", n))
    assert isinstance(reply, p.RetrieveReply)
    return reply


def register(c: Client) -> Client:
    c.register(model="m", chunk_shape=SHAPE, dtype="float16")
    return c


def verify(c: Client, n: int, seed: int, request_id: str = "verify") -> int:
    """Retrieve prompt n and compare with kv_for(seed): chunks retrieved, or -1 on wrong bytes."""
    expected = kv_for(seed)
    out = np.zeros_like(expected)
    got = c.retrieve(request_id, prompt(n), out, model="m")
    if got and not np.array_equal(out, expected):
        return -1
    return got // CS

"""What the trust tests share: a chunk shape big enough that a 64 KiB L1 holds four chunks,
client processes started by spawn, and the store and retrieve steps done by hand so a test can
hold a staging slot or a lease as long as it likes."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

from kvtier import protocol as p
from kvtier.client import Client
from testkit import kv
from testkit.kv import CS, prompt

SHAPE = (8, 2, CS, 4, 8)  # 16 KiB per chunk in float16: a 64 KiB L1 holds four
SPAWN = mp.get_context("spawn")


def kv_for(seed: int, num_chunks: int = 1, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """testkit.kv.kv_for, in this module's SHAPE unless told otherwise."""
    return kv.kv_for(seed, num_chunks, shape)


def reserve(c: Client, request_id: str, tokens: list[int], *, salt: str = "") -> p.ReserveReply:
    """Store step 1 by hand, so a test can hold a staging slot as long as it likes."""
    n = len(tokens) // CS
    raw = np.asarray(tokens, dtype="<u4").tobytes()
    reply, _ = c.connection.call(
        p.Reserve(request_id, raw, "m", 1, 0, 0, n * CS, list(SHAPE), "float16", n, salt)
    )
    assert isinstance(reply, p.ReserveReply)
    return reply


def retrieve_lease(c: Client, request_id: str, tokens: list[int]) -> p.RetrieveReply:
    """Retrieve step 1 by hand: offsets and a lease, copied out whenever the test says."""
    n = len(tokens) // CS
    raw = np.asarray(tokens, dtype="<u4").tobytes()
    reply, _ = c.connection.call(
        p.Retrieve(request_id, raw, "m", 1, 0, 0, n * CS, list(SHAPE), "float16", n)
    )
    assert isinstance(reply, p.RetrieveReply)
    return reply


def register(c: Client) -> Client:
    """Register model "m" in this module's SHAPE."""
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

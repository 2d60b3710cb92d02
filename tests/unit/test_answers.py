"""The offload rule: which requests a handler thread takes, the others staying on the
transport thread."""

from __future__ import annotations

import pytest

from kvtier import protocol as p
from kvtier.server.answers import offloaded


def tokens(n: int) -> bytes:
    return bytes(4 * n)


@pytest.mark.parametrize("chunk_size", [16, 256])
def test_a_prompt_is_offloaded_from_256_chunks_on(chunk_size: int) -> None:
    short, long = tokens(255 * chunk_size + chunk_size - 1), tokens(256 * chunk_size)
    for make in (
        lambda t: p.Lookup("r", t, "m"),
        lambda t: p.Reserve("r", t, "m", 1, 0, 0, 0, [1], "uint8", 0),
        lambda t: p.Retrieve("r", t, "m", 1, 0, 0, 0, [1], "uint8", 0),
    ):
        assert not offloaded(make(short), chunk_size)
        assert offloaded(make(long), chunk_size)


def test_a_16k_token_lookup_stays_on_the_transport_thread() -> None:
    """Its work (~0.2 ms) is shorter than the two thread hand-offs it would cost."""
    assert not offloaded(p.Lookup("r", tokens(16384), "m"), 256)


def test_inline_bytes_are_always_offloaded() -> None:
    inline = p.StoreInline("r", tokens(16), "m", 1, 0, 0, 16, [1], "uint8", 1)
    assert offloaded(inline, 256)
    retrieve = p.Retrieve("r", tokens(16), "m", 1, 0, 0, 16, [1], "uint8", 1, inline=True)
    assert offloaded(retrieve, 256)
    assert offloaded(p.StoreKeysInline([b"n"], "m", 1, 0, [1], "uint8", 1), 256)
    assert not offloaded(p.Heartbeat(), 256)

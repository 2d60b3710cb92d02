"""Extra keys against a real server: the same tokens under two extra keys (a LoRA adapter,
multimodal inputs) are two chunks, for token-addressed and named chunks, on both byte paths;
composed names keep tenants and salts apart whatever strings a client sends."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from testkit.kv import CS, prompt
from testkit.servers import ServerProcess
from testkit.trust import SHAPE, kv_for

from kvtier.client import Client
from kvtier.errors import InvalidArgumentError, UnknownSessionError

ADAPTER_A = b"a" * 32
ADAPTER_B = b"b" * 32


def register(c: Client) -> None:
    c.register(model="m", chunk_shape=SHAPE, dtype="float16")


@pytest.mark.parametrize("inline", [False, True], ids=["arena", "inline"])
def test_chunks_stored_under_one_extra_key_are_found_under_that_key_alone(
    server_factory: Callable[..., ServerProcess], inline: bool
) -> None:
    server = server_factory("--l1-size", "4MiB", "--chunk-size", str(CS))
    tokens = prompt(1, 2)
    kv_a, kv_b = kv_for(1, 2), kv_for(2, 2)
    with Client(server.address, transfer="inline" if inline else "shm") as c:
        register(c)
        assert c.store("w", tokens, kv_a, model="m", extra_key=ADAPTER_A) == 2 * CS
        assert c.lookup("r0", tokens, model="m") == 0  # the base model never sees them
        assert c.lookup("r1", tokens, model="m", extra_key=ADAPTER_B) == 0
        assert c.lookup("r2", tokens, model="m", extra_key=ADAPTER_A) == 2 * CS
        # the same tokens under another key are another chunk: stored, not "already there"
        assert c.store("w2", tokens, kv_b, model="m", extra_key=ADAPTER_B) == 2 * CS
        for key, expected in ((ADAPTER_A, kv_a), (ADAPTER_B, kv_b)):
            out = np.zeros_like(expected)
            got = c.retrieve("r3", tokens, out, model="m", extra_key=key)
            assert got == 2 * CS and np.array_equal(out, expected)
        out = np.zeros_like(kv_a)
        assert c.retrieve("r4", tokens, out, model="m") == 0


def test_named_chunks_are_separated_by_extra_key(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory("--l1-size", "4MiB", "--chunk-size", str(CS))
    names = [b"page-0", b"page-1"]
    kv = kv_for(3, 2)
    with Client(server.address) as c:
        register(c)
        assert c.put_keys(names, kv, model="m", extra_key=ADAPTER_A) == 2
        assert c.exists_keys(names, model="m") == 0
        assert c.exists_keys(names, model="m", extra_key=ADAPTER_A) == 2
        out = np.zeros_like(kv)
        assert c.get_keys(names, out, model="m", extra_key=ADAPTER_B) == 0
        assert c.get_keys(names, out, model="m", extra_key=ADAPTER_A) == 2
        assert np.array_equal(out, kv)


def test_an_extra_key_longer_than_the_bound_is_refused(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory("--l1-size", "4MiB", "--chunk-size", str(CS))
    with Client(server.address) as c, pytest.raises(InvalidArgumentError, match="extra_key"):
        c.lookup("r", prompt(1), model="m", extra_key=b"x" * 257)


def test_a_separator_in_a_salt_or_model_reaches_no_other_namespace(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Names are composed, not joined: a salt or model that spells another's joined name
    (the old `salt\\0name` form) finds nothing of it."""
    server = server_factory("--l1-size", "4MiB", "--chunk-size", str(CS))
    tokens = prompt(4)
    with Client(server.address) as c:
        register(c)
        c.register(model="B\0m", chunk_shape=SHAPE, dtype="float16")
        assert c.store("w", tokens, kv_for(4), model="m", cache_salt="B") == CS
        assert c.lookup("victim", tokens, model="m", cache_salt="B") == CS  # pinned by B
        assert c.lookup("r", tokens, model="B\0m", cache_salt="") == 0
        assert c.lookup("r", tokens, model="m", cache_salt="B\0") == 0
        # a request id that spells salt B's session id does not reach B's session
        for call in (c.release, c.end_session):
            with pytest.raises(UnknownSessionError):
                call("B\0victim")
        c.end_session("victim", cache_salt="B")  # B's own session is still there

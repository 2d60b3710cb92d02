"""The route table: one route per request type, and the offload rule (which requests a handler
thread takes, the others staying on the transport thread)."""

from __future__ import annotations

from collections import Counter

import pytest

from kvtier import protocol as p
from kvtier.errors import InternalError
from kvtier.server.observe.operations import OPERATIONS
from kvtier.server.routes import ROUTES, route_of


def tokens(n: int) -> bytes:
    return bytes(4 * n)


def test_every_request_type_has_exactly_one_route() -> None:
    routed = Counter(route.request for route in ROUTES)
    assert set(routed) == set(p.Request.__args__)  # type: ignore[attr-defined]
    assert all(count == 1 for count in routed.values()), routed
    for route in ROUTES:
        assert route.connected == (route.request is not p.Hello)


def test_every_route_has_its_metrics_labels_and_no_label_lacks_a_route() -> None:
    assert {route.request.__name__ for route in ROUTES} == set(OPERATIONS)


def test_a_type_without_a_route_is_an_internal_error() -> None:
    with pytest.raises(InternalError, match="no handler for Ok"):
        route_of(p.Ok())


def test_only_requests_that_hand_out_arena_slots_need_a_watched_client() -> None:
    def watched(req: p.Request) -> bool:
        return route_of(req).watched(req)

    range_args = ("r", tokens(16), "m", 1, 0, 0, 16, [1], "uint8", 1)
    key_args = ([b"n"], "m", 1, 0, [1], "uint8", 1)
    assert watched(p.Reserve(*range_args)) and watched(p.ReserveKeys(*key_args))
    assert watched(p.Retrieve(*range_args)) and watched(p.RetrieveKeys(*key_args))
    assert not watched(p.Retrieve(*range_args, inline=True))
    assert not watched(p.RetrieveKeys(*key_args, inline=True))
    assert not watched(p.StoreInline(*range_args)) and not watched(p.StoreKeysInline(*key_args))
    assert not watched(p.Lookup("r", tokens(16), "m")) and not watched(p.Heartbeat())


def offloaded(req: p.Request, chunk_size: int) -> bool:
    return route_of(req).offloaded(req, chunk_size)


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


def test_key_addressed_requests_are_offloaded_from_256_names_on() -> None:
    few, many = [b"n"] * 255, [b"n"] * 256
    for make in (
        lambda names: p.ExistsKeys(names, "m"),
        lambda names: p.ReserveKeys(names, "m", 1, 0, [1], "uint8", 1),
        lambda names: p.RetrieveKeys(names, "m", 1, 0, [1], "uint8", 1),
    ):
        assert not offloaded(make(few), 16)
        assert offloaded(make(many), 16)
    assert offloaded(p.RetrieveKeys([b"n"], "m", 1, 0, [1], "uint8", 1, inline=True), 16)

"""server.naming: a request's chunk names are those of its own hashes, whatever the cache held."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.hashing import TokenHasher
from kvtier.keys import ChunkKey, with_extra_key
from kvtier.server.naming import chunk_keys
from kvtier.session import Session

CS = 4
prompts = st.lists(st.lists(st.integers(0, 5), max_size=24), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None)
@given(prompts, st.data())
def test_cached_chunk_keys_are_always_the_names_of_the_given_hashes(
    sequence: list[list[int]], data: st.DataObject
) -> None:
    """Prompts that share prefixes, shrink, grow or diverge, named in any order on one session
    (as concurrent requests of one id do): each call's keys are built from its own hashes."""
    hasher = TokenHasher(CS)
    session = Session("r", hasher)
    for tokens in sequence:
        extra_key = data.draw(st.sampled_from([b"", b"lora-a"]))
        hashes = hasher.compute_chunk_hashes(tokens)
        end = data.draw(st.integers(0, len(hashes)))
        got = chunk_keys(session, hashes[:end], "m", "s", 1, extra_key=extra_key)
        assert got == [ChunkKey("m", "s", 1, with_extra_key(h, extra_key)) for h in hashes[:end]]

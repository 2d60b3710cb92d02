"""The cache policies (`storage/admission.py`) and the L1 that follows them: what each admits,
and that no policy ever evicts a pinned or held chunk (property-based, on a real `L1Store`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import NoSpaceError
from kvtier.keys import ChunkKey
from kvtier.storage.admission import POLICIES, make_policy
from kvtier.storage.l1 import Held, L1Store

PAGE = 4096


def key(n: int) -> ChunkKey:
    return ChunkKey("m", "", 1, n.to_bytes(8, "little") + b"\x01" * 24)


def test_lru_admits_everything_and_the_doorkeeper_a_name_two_requests_saw() -> None:
    lru, door = make_policy("lru"), make_policy("doorkeeper")
    door.set_capacity(16)
    chain = [key(i) for i in range(4)]
    assert all(lru.admits(k) for k in chain)
    door.observe(chain, "r1")
    assert not any(door.admits(k) for k in chain)  # one request's sighting only
    door.observe(chain, "r1")  # the same request again: still one
    assert not door.would_admit(chain[0])
    door.observe(chain[:2], "r2")
    assert [door.would_admit(k) for k in chain] == [True, True, False, False]
    assert door.stats().declined == 4 and door.stats().admitted == 0


def test_an_unknown_policy_name_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown cache policy 'bogus'; choose one of adaptive"):
        make_policy("bogus")


def _store(l1: L1Store, keys: list[ChunkKey], owner: str) -> list[ChunkKey]:
    """Reserve and commit what fits of `keys`; the ones stored."""
    done = []
    for k in keys:
        try:
            if l1.reserve(k, 0, PAGE, owner=owner, lease_s=60.0) is None:
                continue
        except NoSpaceError:
            break
        l1.commit(k, 0, owner=owner)
        done.append(k)
    return done


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "lookup", "pin", "unpin", "acquire", "release"]),
        st.integers(0, 40),  # first name of a chain
        st.integers(1, 8),  # its length
        st.integers(0, 3),  # a holder / request
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)), steps=ops)
def test_no_policy_evicts_a_pinned_or_held_chunk(
    policy: str, steps: list[tuple[str, int, int, int]]
) -> None:
    l1 = L1Store(12 * PAGE, admission=make_policy(policy))
    pinned: dict[str, list[ChunkKey]] = {}
    held: list[tuple[ChunkKey, Held]] = []
    for op, first, length, who in steps:
        chain = [key(first + i) for i in range(length)]
        holder = f"r{who}"
        if op == "store":
            l1.observe_lookup(chain, holder)
            _store(l1, chain, holder)
        elif op == "lookup":
            l1.observe_lookup(chain, holder)
        elif op == "pin":
            l1.pin(holder, chain, ranks=[0], lease_s=60.0)
            pinned[holder] = l1.pinned_keys(holder)
        elif op == "unpin":
            l1.unpin(holder)
            pinned.pop(holder, None)
        elif op == "acquire":
            present = [k for k in chain if l1.is_complete(k)]
            for k in present[:1]:
                held.append((k, l1.acquire(k)))
        elif held:
            l1.release(held.pop()[1])
        for k in [*(k for k, _ in held), *(k for keys in pinned.values() for k in keys)]:
            assert l1.is_complete(k), f"{policy} evicted {k} while it was pinned or held"
        assert l1.used_bytes <= l1.capacity_bytes

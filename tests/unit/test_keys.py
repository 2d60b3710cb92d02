"""keys.compose: composite names are injective, whatever strings the parts hold."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.keys import compose, decompose

parts = st.lists(st.text(max_size=12), max_size=5)


@given(parts, parts)
def test_two_tuples_compose_to_the_same_name_only_when_equal(a: list[str], b: list[str]) -> None:
    assert (compose(*a) == compose(*b)) == (a == b)


@given(parts)
def test_decompose_inverts_compose(a: list[str]) -> None:
    assert decompose(compose(*a)) == a


def test_a_separator_in_a_part_cannot_reach_another_tuple() -> None:
    # the mistake composition prevents: joining ("victim", "req") with a separator equals the
    # single part "victim\0req" that any client can send
    assert compose("victim", "req") != compose("", "victim\0req")
    assert compose("B", "llama") != compose("", "B\0llama")
    assert compose("a:b", "c") != compose("a", "b:c")


@pytest.mark.parametrize("text", ["x", "3:ab", "1:a:", "²:a", "-1:"])
def test_decompose_refuses_text_compose_did_not_build(text: str) -> None:
    with pytest.raises(ValueError, match="not a composed name"):
        decompose(text)

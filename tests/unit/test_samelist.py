"""samelist.same_items is exactly `==` for lists, whichever path answers."""

from __future__ import annotations

import sys

import pytest

from kvtier.session import samelist
from kvtier.session.samelist import same_items


def _ints(n: int, start: int = 10_000) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 5000, 40_000])
def test_agrees_with_eq(n: int) -> None:
    a = _ints(n)
    shared = list(a)  # the same int objects
    fresh = [int(str(v)) for v in a]  # equal values, other objects
    assert same_items(a, shared) and same_items(a, fresh)
    if n:
        for i in {0, n // 2, n - 1}:
            changed = list(a)
            changed[i] += 1
            assert not same_items(a, changed)
            assert not same_items(changed, a)
    assert not same_items(a, [*a, 1])
    assert not same_items([*a, 1], a)


def test_equal_values_in_different_objects_are_equal_past_the_first_difference() -> None:
    a = _ints(4096)
    b = list(a)
    b[100] = int(str(a[100]))  # pointer arrays differ, values do not
    assert b[100] is not a[100]
    assert same_items(a, b)


def test_the_memcmp_path_is_active_on_cpython() -> None:
    if sys.implementation.name != "cpython":
        pytest.fail("kvtier's session speed figures assume CPython; this is not CPython")
    assert samelist._memcmp is not None, "the layout probe failed: same_items fell back to =="

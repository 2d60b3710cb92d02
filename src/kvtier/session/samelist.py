"""Exact equality of two Python lists, at memcmp speed when they hold the same objects.

`Session.set_tokens` checks, on every step of a growing prompt, that the new token list repeats
the one it kept: `a == b` on two 32k-item lists walks both in a loop of comparisons (about
0.55 ns an item here, most of the step's cost). When the lists hold the same int objects, which
is what a prompt grown by appending gives, their arrays of item pointers are equal byte for
byte, and one memcmp of those arrays settles it about 4x faster. Only "equal" is taken from
memcmp: different pointers may still be equal ints, so any difference falls back to `==`, and
the answer is always exactly `a == b`.

CPython with the GIL only, checked once at import on probe lists (the item array's address
sits right after the PyVarObject header). memcmp is called through `ctypes.PyDLL`, which keeps
the GIL during the call, so no other thread can resize either list meanwhile. Anywhere else
`same_items` is plain `==`.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
from collections.abc import Callable

__all__ = ["same_items"]

_MIN_ITEMS = 1024  # below this, == costs less than the ctypes call
_POINTER = ctypes.sizeof(ctypes.c_void_p)
_ITEMS_OFFSET = 3 * ctypes.sizeof(ctypes.c_ssize_t)  # ob_refcnt, ob_type, ob_size, then ob_item


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    try:
        memcmp = ctypes.PyDLL(None).memcmp
    except (OSError, AttributeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp  # type: ignore[no-any-return]


def _items_address(items: list[int]) -> int:
    return ctypes.c_void_p.from_address(id(items) + _ITEMS_OFFSET).value or 0


def _layout_holds(memcmp: Callable[[int, int, int], int]) -> bool:
    """The probe: item pointers read where we expect them are the items' ids, and memcmp
    tells equal item arrays from different ones."""
    a = list(range(1000, 1000 + _MIN_ITEMS))
    b = list(a)
    c = list(a)
    c[-1] = 1
    if ctypes.c_void_p.from_address(_items_address(a)).value != id(a[0]):
        return False
    if ctypes.c_void_p.from_address(_items_address(a) + _POINTER * 7).value != id(a[7]):
        return False
    size = len(a) * _POINTER
    return (
        memcmp(_items_address(a), _items_address(b), size) == 0
        and memcmp(_items_address(a), _items_address(c), size) != 0
    )


_memcmp = _load_memcmp()
if _memcmp is not None and not _layout_holds(_memcmp):
    _memcmp = None


def same_items(a: list[int], b: list[int]) -> bool:
    """Exactly `a == b` for two lists; fast when they hold the same objects in the same order."""
    n = len(a)
    if n != len(b):
        return False
    fast = _memcmp is not None and n >= _MIN_ITEMS
    if fast and _memcmp(_items_address(a), _items_address(b), n * _POINTER) == 0:  # type: ignore[misc]
        return True
    return a == b

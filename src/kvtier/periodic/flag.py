"""`StateFlag`: a thread state that reads the same as a property and as a method call."""

from __future__ import annotations

from typing import NoReturn, final


@final
class StateFlag:
    """An immutable boolean that reads the same as a property and as a method call.

    LMCache exposes `is_running` / `is_active` as properties (`if t.is_running:`) while kvtier's
    callers call them (`t.is_running()`); returning this object lets both spellings work. It is
    truthy like the bool it carries, equal to and hashing like that bool, and calling it returns it.
    """

    __slots__ = ("_value",)
    _value: bool

    def __init__(self, value: bool) -> None:
        object.__setattr__(self, "_value", bool(value))

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"StateFlag is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"StateFlag is immutable; cannot delete {name!r}")

    def __bool__(self) -> bool:
        return self._value

    def __call__(self) -> bool:
        return self._value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StateFlag):
            return self._value == other._value
        if isinstance(other, int):  # bool is an int; True == 1 holds for bools too
            return self._value == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return repr(self._value)


_TRUE = StateFlag(True)
_FALSE = StateFlag(False)


def as_flag(value: bool) -> StateFlag:
    return _TRUE if value else _FALSE

"""A clock the test moves by hand, for code that takes its time source as an argument."""

from __future__ import annotations


class FakeClock:
    """A clock that moves only when the test moves it (`advance`, or set `now`)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

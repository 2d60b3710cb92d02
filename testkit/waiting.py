"""Waiting on a condition instead of sleeping a guessed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[..., bool], timeout: float = 15.0, interval: float = 0.1) -> bool:
    """True as soon as `predicate()` is, False if it is still false after `timeout` seconds.

    `predicate` is called without arguments; `Callable[...]` lets a test pass a lambda that binds
    a loop variable as a default (`lambda n=n: ...`), which mypy cannot type otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False

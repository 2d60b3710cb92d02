"""What one cycle of a periodic thread reports, and the exception that ends its loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class IrrecoverableException(Exception):
    """Raised by a cycle to end its thread's loop (counted as a failed cycle); the thread can
    be started again."""


@dataclass(frozen=True)
class ThreadRunSummary:
    """The outcome of one cycle; `timestamp` is wall-clock seconds, `duration_ms` real time."""

    success: bool
    message: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    timestamp: float = field(default_factory=time.time)
    duration_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy, for the admin API."""
        return {
            "success": self.success,
            "message": self.message,
            "extra_info": dict(self.extra_info),
            "timestamp": self.timestamp,
            "duration_ms": self.duration_ms,
        }


# A cycle's body: a ThreadRunSummary is recorded as is; any other return counts as success.
ExecuteFn = Callable[[], ThreadRunSummary | object]

"""How much the server depends on a periodic thread, and when a stalled one makes it unhealthy."""

from __future__ import annotations

import enum

# A thread is active while a cycle completed within this many intervals.
ACTIVE_INTERVALS = 3


class ThreadLevel(enum.Enum):
    """How much the server depends on a thread; CRITICAL and HIGH ones decide health."""

    CRITICAL = "critical"
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"


# Levels whose stalled threads make the process unhealthy.
HEALTH_LEVELS = frozenset({ThreadLevel.CRITICAL, ThreadLevel.HIGH})

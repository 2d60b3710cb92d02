"""Background periodic threads (session cleanup, lease reaping, L2 write-through...) and the
process-wide registry the admin API reads to list them and report health.

The public names and semantics follow LMCache's `periodic_thread` module, so people and code that
know that server feel at home: a `PeriodicThread` runs `_execute()` (overridden by a subclass, or
calling the `execute_fn` it was given) on a daemon thread named `kvtier-<name>`: first after
`init_wait` seconds (0: at once), then every `interval` seconds; `wake()` asks for a cycle sooner.
`start()` returns the worker thread. A running or stopped thread cannot start again
(RuntimeError); one whose loop ended by itself, because a cycle raised `IrrecoverableException`,
can (the lineage's contract).
`ThreadLevel` values are the lower-case strings "critical", "high", "medium", "low".

Its parts: `levels` (how much the server depends on a thread), `summary` (what a cycle
reports), `flag` (`StateFlag`), `thread` (`PeriodicThread`) and `registry`
(`PeriodicThreadRegistry`, `create_periodic_thread`).
"""

from kvtier.periodic.flag import StateFlag
from kvtier.periodic.levels import ACTIVE_INTERVALS, HEALTH_LEVELS, ThreadLevel
from kvtier.periodic.registry import PeriodicThreadRegistry, create_periodic_thread
from kvtier.periodic.summary import ExecuteFn, IrrecoverableException, ThreadRunSummary
from kvtier.periodic.thread import PeriodicThread

__all__ = [
    "ACTIVE_INTERVALS",
    "HEALTH_LEVELS",
    "ExecuteFn",
    "IrrecoverableException",
    "PeriodicThread",
    "PeriodicThreadRegistry",
    "StateFlag",
    "ThreadLevel",
    "ThreadRunSummary",
    "create_periodic_thread",
]

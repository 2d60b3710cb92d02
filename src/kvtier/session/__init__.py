"""Per-request state: `Session` (tokens and their chunk hashes) and `SessionManager` (expiry).

The names and public semantics descend from LMCache's multiprocess server. Where it was weak,
this module differs on purpose:

- `set_tokens` with a sequence that diverges inside already-hashed chunks drops the hashes from
  the first differing chunk on (the lineage kept them, so a changed prompt reused stale names);
- range errors are `ValueError`s that name the numbers (the lineage used `assert`);
- expiry counts from the last use, not from creation, so a long request keeps its session;
- `cleanup_expired` costs time in proportion to the sessions that expire and holds the manager's
  lock only for short batches (the lineage scanned every session under its lock).

Its parts: `tokens` (tokens packed as uint32), `samelist` (list equality at memcmp speed),
`state` (`Session`) and `manager` (`SessionManager`).
"""

from kvtier.session.manager import DestroyListener, SessionManager
from kvtier.session.state import Session

__all__ = ["DestroyListener", "Session", "SessionManager"]

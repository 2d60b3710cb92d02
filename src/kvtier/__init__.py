"""kvtier: a KV-cache server for LLM inference engines.

The public surface: the client (`Client`), chunk naming (`TokenHasher`), per-request state
(`Session`, `SessionManager`), background threads (`PeriodicThread` and friends), the server's
configuration (`ServerConfig`), stored names (`ChunkKey`, `ObjectKey`) and the error tree.
torch and transformers are never imported here (see `kvtier.integrations`).
"""

from kvtier._version import __version__
from kvtier.client import Client
from kvtier.config import ServerConfig
from kvtier.errors import ErrorCode, KVTierError
from kvtier.hashing import ChunkHash, TokenHasher
from kvtier.keys import ChunkKey, ObjectKey
from kvtier.periodic import (
    IrrecoverableException,
    PeriodicThread,
    PeriodicThreadRegistry,
    ThreadLevel,
    ThreadRunSummary,
    create_periodic_thread,
)
from kvtier.session import Session, SessionManager

__all__ = [
    "ChunkHash",
    "ChunkKey",
    "Client",
    "ErrorCode",
    "IrrecoverableException",
    "KVTierError",
    "ObjectKey",
    "PeriodicThread",
    "PeriodicThreadRegistry",
    "ServerConfig",
    "Session",
    "SessionManager",
    "ThreadLevel",
    "ThreadRunSummary",
    "TokenHasher",
    "__version__",
    "create_periodic_thread",
]

"""The client library engines use: one `Client` per process, thread-safe.

`connection` holds the connection (socket pool, handshake, heartbeats, the rejoin after a
server restart, the arena mapping); `client` the request API built on it, with `named` its calls
on chunks the caller names and `lookup_handle` the handle of a lookup still loading; `arrays`
views the caller's tokens and arrays as the wire carries them; `ranges` the `ChunkRange` that
names the chunks a store or retrieve moves; `slots` the context managers over the arena slots a
store or retrieve hands out; `copying` the large copies between arrays and the arena.
"""

from kvtier.client.client import Client
from kvtier.client.connection import Transfer
from kvtier.client.lookup_handle import LookupHandle
from kvtier.client.ranges import ChunkRange
from kvtier.client.slots import RetrievedSlots, StoreSlots

__all__ = ["ChunkRange", "Client", "LookupHandle", "RetrievedSlots", "StoreSlots", "Transfer"]

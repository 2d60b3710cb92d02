"""The client library engines use: one `Client` per process, thread-safe.

`client` holds the connection, its rejoin after a server restart and the request API; `slots`
the context managers over arena slots a store or retrieve hands out.
"""

from kvtier.client.client import Client, LookupHandle, Transfer
from kvtier.client.slots import RetrievedSlots, StoreSlots

__all__ = ["Client", "LookupHandle", "RetrievedSlots", "StoreSlots", "Transfer"]

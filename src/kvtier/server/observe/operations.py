"""The labels a request's metrics carry: wire request name -> (what the user did, which step of
it). Dashboards key on these values; each request type has one entry beside its route
(`server/routes.py`)."""

from __future__ import annotations

__all__ = ["OPERATIONS", "UNKNOWN", "operation_of"]

OPERATIONS: dict[str, tuple[str, str]] = {
    # handshake
    "Hello": ("connect", "hello"),
    "Heartbeat": ("heartbeat", "heartbeat"),
    "Register": ("register", "register"),
    "Goodbye": ("disconnect", "goodbye"),
    # lookups
    "Lookup": ("lookup", "lookup"),
    "LookupPoll": ("lookup", "poll"),
    "ExistsKeys": ("exists_keys", "exists_keys"),
    # stores
    "Reserve": ("store", "reserve"),
    "ReserveKeys": ("reserve_keys", "reserve_keys"),
    "Commit": ("store", "commit"),
    "Abort": ("store", "abort"),
    "StoreInline": ("store", "inline"),
    "StoreKeysInline": ("store_keys_inline", "store_keys_inline"),
    # retrieves
    "Retrieve": ("retrieve", "start"),
    "RetrieveKeys": ("retrieve_keys", "retrieve_keys"),
    "RetrieveDone": ("retrieve", "done"),
    # sessions
    "Release": ("release", "release"),
    "EndSession": ("end_session", "end_session"),
    # prefill/decode hand-offs
    "EndHandoff": ("end_handoff", "end_handoff"),
}

#: the operation of a request that could not be decoded
UNKNOWN = "unknown"


def operation_of(request_name: str) -> tuple[str, str]:
    """The (operation, step) labels of a wire request name; "unknown" for a request that could
    not be decoded."""
    return OPERATIONS.get(request_name, (UNKNOWN, UNKNOWN))

"""The API kvtier keeps from its lineage, LMCache 0.5.6's multiprocess server, pinned as data.

`KVTIER` lists every public name of the five classes code written for that server uses
(`Session`, `SessionManager`, `TokenHasher`, `PeriodicThread`, `PeriodicThreadRegistry`) with
its kind and signature, as kvtier has them: a name that goes missing, changes or appears fails
here until this list (and docs/architecture.md, "The compatible API") says so. `SEED` is the
same listing of LMCache 0.5.6 (read from its source, written out here by hand: lmcache is not a
dependency). Every seed name must be in kvtier unchanged unless `DIFFERENCES` names it with the
reason, and every entry there must still be a real difference.

A signature is the parameters' names, kinds and defaults (not annotations), the bound form
(without self / cls). Extensions (names and keyword-only parameters the seed lacks) are fine for
code written for the seed and are listed in `KVTIER` only.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.hashing import TokenHasher
from kvtier.periodic import PeriodicThread, PeriodicThreadRegistry, ThreadRunSummary
from kvtier.session import Session, SessionManager

Surface = dict[str, str]

KVTIER: dict[str, Surface] = {
    "Session": {
        "__init__": "method (request_id, hasher, *, clock=time.time, lookup_ipc_key=None)",
        "append_tokens": "method (token_ids)",
        "chunk_hashes": "property",
        "clock": "attribute",
        "created_at": "attribute",
        "extras": "property",
        "get_hashes": "method (start=0, end=None)",
        "hasher": "attribute",
        "hashes_for": "method (full_token_ids, end=None)",
        "last_access": "attribute",
        "last_prefix_hash": "property",
        "lookup_ipc_key": "attribute",
        "num_chunks_processed": "property",
        "num_tokens": "property",
        "request_id": "attribute",
        "set_tokens": "method (full_token_ids)",
        "token_bytes": "property",
        "token_ids": "property",
        "touch": "method ()",
    },
    "SessionManager": {
        "DEFAULT_CLEANUP_INTERVAL": "attribute = 60.0",
        "DEFAULT_SESSION_TTL": "attribute = 600.0",
        "__init__": (
            "method (hasher, ttl=600.0, cleanup_interval=60.0, *, clock=time.time, registry=None)"
        ),
        "active_count": "method ()",
        "cleanup_expired": "method ()",
        "clock": "attribute",
        "close": "method ()",
        "created_count": "property",
        "destroy_listeners": "attribute",
        "get": "method (request_id)",
        "get_or_create": "method (request_id)",
        "hasher": "attribute",
        "orphaned_count": "property",
        "peek": "method (request_id)",
        "remove": "method (request_id)",
        "removed_count": "property",
        "sessions": "method ()",
        "ttl": "attribute",
    },
    "TokenHasher": {
        "__init__": "method (chunk_size=256, hash_algorithm='blake3', *, seed=None)",
        "chunk_size": "attribute",
        "compute_chunk_hashes": "method (token_ids, full_chunk_only=True, prefix_hash=None)",
        "contract": "method ()",
        "contract_info": "method ()",
        "digest_size": "attribute",
        "extend_chain": "method (hashes, packed)",
        "hash_algorithm": "attribute",
        "hash_to_bytes": "staticmethod (hash_val)",
        "hash_tokens": "method (tokens, prefix_hash=None)",
        "none_hash": "attribute",
        "seed": "attribute",
    },
    "PeriodicThread": {
        "__init__": (
            "method (name, interval, level=ThreadLevel.MEDIUM, init_wait=0.0, *,"
            " execute_fn=None, clock=time.monotonic)"
        ),
        "failed_runs": "property",
        "failure_count": "property",
        "get_status": "method ()",
        "init_wait": "property",
        "interval": "property",
        "is_active": "property",
        "is_running": "property",
        "last_run_time": "property",
        "last_summary": "property",
        "level": "property",
        "name": "property",
        "run_count": "property",
        "start": "method ()",
        "stop": "method (timeout=5.0)",
        "to_dict": "method ()",
        "total_runs": "property",
        "wait_for_runs": "method (count, timeout=None)",
        "wake": "method ()",
    },
    "PeriodicThreadRegistry": {
        "__init__": "method ()",
        "get": "method (name)",
        "get_active_count": "method ()",
        "get_all": "method ()",
        "get_by_level": "method (level)",
        "get_count_by_level": "method (level)",
        "get_instance": "classmethod ()",
        "get_running_count": "method ()",
        "get_summary": "method ()",
        "health": "method ()",
        "is_healthy": "method ()",
        "register": "method (thread)",
        "reset": "callable ()",
        "stop_all": "method (timeout=5.0)",
        "unregister": "method (name)",
        "unregister_all": "method ()",
    },
}

SEED: dict[str, Surface] = {
    "Session": {
        # a dataclass: its generated __init__ takes every field (private ones included)
        "__init__": (
            "method (request_id, hasher, token_ids=[], chunk_hashes=[], last_prefix_hash=None,"
            " num_chunks_processed=0, created_at=time.time(), lookup_ipc_key=None,"
            " prefetch_hit_chunks=-1, prefetch_locked_gids=(), prefetch_group_windows=(),"
            " _prefetch_owners={}, extras={}, _lookup_generation=0,"
            " _failed_retrieve_releases=set(), _lock=threading.Lock())"
        ),
        "begin_lookup": "method (key, group_windows)",
        "chunk_hashes": "attribute",
        "claim_failed_retrieve_release": "method (instance_id, key, lookup_generation)",
        "created_at": "attribute",
        "extras": "attribute",
        "get_hashes": "method (start, end=None)",
        "get_prefetch_owners": "method ()",
        "hasher": "attribute",
        "last_prefix_hash": "attribute",
        "lookup_ipc_key": "attribute",
        "num_chunks_processed": "attribute",
        "prefetch_group_windows": "attribute",
        "prefetch_hit_chunks": "attribute",
        "prefetch_locked_gids": "attribute",
        "prepare_failed_retrieve_release": "method (key)",
        "record_prefetch_result": "method (hit_chunks, locked_gids, l1_owners=None)",
        "request_id": "attribute",
        "set_tokens": "method (full_token_ids)",
        "token_ids": "attribute",
    },
    "SessionManager": {
        "DEFAULT_CLEANUP_INTERVAL": "attribute = 60.0",
        "DEFAULT_SESSION_TTL": "attribute = 600",
        "__init__": "method (hasher, ttl=600, cleanup_interval=60.0)",
        "active_count": "method ()",
        "cleanup_expired": "method ()",
        "close": "method ()",
        "destroy_listeners": "attribute",
        "get": "method (request_id)",
        "get_or_create": "method (request_id)",
        "remove": "method (request_id)",
    },
    "TokenHasher": {
        "__init__": "method (chunk_size=256, hash_algorithm='blake3')",
        "chunk_size": "attribute",
        "compute_chunk_hashes": "method (token_ids, prefix_hash=None, start=0, end=None)",
        "hash_algorithm_name": "attribute",
        "hash_func": "attribute",
        "hash_to_bytes": "staticmethod (hash_val)",
        "hash_tokens": "method (tokens, prefix_hash=None)",
        "none_hash": "attribute",
    },
    "PeriodicThread": {
        "__init__": "method (name, interval, level=ThreadLevel.MEDIUM, init_wait=0.0)",
        "failed_runs": "property",
        "get_status": "method ()",
        "init_wait": "property",
        "interval": "property",
        "is_active": "property",
        "is_running": "property",
        "last_run_time": "property",
        "last_summary": "property",
        "level": "property",
        "name": "property",
        "start": "method ()",
        "stop": "method (timeout=5.0)",
        "stop_requested": "property",
        "total_runs": "property",
        "wake": "method ()",
    },
    "PeriodicThreadRegistry": {
        "__init__": "method ()",
        "get": "method (name)",
        "get_active_count": "method ()",
        "get_all": "method ()",
        "get_by_level": "method (level)",
        "get_count_by_level": "method (level)",
        "get_instance": "classmethod ()",
        "get_running_count": "method ()",
        "get_summary": "method ()",
        "register": "method (thread)",
        "reset": "classmethod ()",
        "unregister": "method (name)",
        "unregister_all": "method ()",
    },
}

# Where kvtier differs from the seed on purpose: (class, name) -> why.
_LOCK_PROTOCOL = (
    "LMCache's L1 read-lock bookkeeping per lookup; kvtier holds a lookup's chunks with"
    " server-side leases (server/leases.py), not on the session"
)
_DERIVED = (
    "a read-only view of state derived from the tokens (hashed incrementally under the"
    " session's lock), so it cannot disagree with them; set_tokens changes it"
)
DIFFERENCES: dict[tuple[str, str], str] = {
    ("Session", "__init__"): (
        "not a dataclass: the derived fields are views, not constructor arguments; kvtier adds"
        " keyword-only clock (expiry counts from the last use) and takes lookup_ipc_key by keyword"
    ),
    ("Session", "token_ids"): _DERIVED,
    ("Session", "chunk_hashes"): _DERIVED,
    ("Session", "last_prefix_hash"): _DERIVED,
    ("Session", "num_chunks_processed"): _DERIVED,
    ("Session", "extras"): (
        "created on first read (one GC-tracked dict less per session); read it and change the"
        " dict it returns, as the seed's code does"
    ),
    ("Session", "get_hashes"): "start defaults to 0 (an extension: the seed's calls still work)",
    ("Session", "begin_lookup"): _LOCK_PROTOCOL,
    ("Session", "record_prefetch_result"): _LOCK_PROTOCOL,
    ("Session", "get_prefetch_owners"): _LOCK_PROTOCOL,
    ("Session", "prepare_failed_retrieve_release"): _LOCK_PROTOCOL,
    ("Session", "claim_failed_retrieve_release"): _LOCK_PROTOCOL,
    ("Session", "prefetch_hit_chunks"): _LOCK_PROTOCOL,
    ("Session", "prefetch_locked_gids"): _LOCK_PROTOCOL,
    ("Session", "prefetch_group_windows"): _LOCK_PROTOCOL,
    ("SessionManager", "DEFAULT_SESSION_TTL"): "a float like every duration in kvtier (same value)",
    ("SessionManager", "__init__"): (
        "ttl default is DEFAULT_SESSION_TTL as a float; keyword-only clock and registry added"
    ),
    ("TokenHasher", "__init__"): (
        "keyword-only seed added (sha256_cbor's first parent comes from PYTHONHASHSEED)"
    ),
    ("TokenHasher", "compute_chunk_hashes"): (
        "kvtier's documented form (docs/client.md): full_chunk_only second; a continuation is"
        " hashed from prefix_hash, so no start/end: pass prefix_hash by keyword"
    ),
    ("TokenHasher", "hash_algorithm_name"): "named hash_algorithm",
    ("TokenHasher", "hash_func"): (
        "no per-chunk callable in vLLM's (prefix, tuple, None) convention: each algorithm hashes"
        " whole chains of packed tokens natively"
    ),
    ("PeriodicThread", "__init__"): (
        "keyword-only execute_fn (no subclass needed) and clock (a fake one in tests) added"
    ),
    ("PeriodicThread", "stop_requested"): (
        "not carried over: no kvtier code needs it; is_running says whether the loop runs"
    ),
    ("PeriodicThreadRegistry", "reset"): (
        "works on the class (the seed's form: drops the shared registry) and on an instance"
        " (empties that registry)"
    ),
}

SEED_CLASSES = tuple(KVTIER)


def _default(value: object) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if inspect.isbuiltin(value) or inspect.isfunction(value):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def _signature(func: Any) -> str:
    parts: list[str] = []
    star = False
    for p in inspect.signature(func).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        prefix = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
        star = star or p.kind is p.VAR_POSITIONAL
        default = "" if p.default is p.empty else "=" + _default(p.default)
        parts.append(prefix + p.name + default)
    return "(" + ", ".join(parts) + ")"


def _kind(cls: type, instance: object, name: str) -> str:
    static = inspect.getattr_static(instance, name)
    if isinstance(static, property):
        return "property"
    if isinstance(static, classmethod):
        return "classmethod " + _signature(getattr(cls, name))
    if isinstance(static, staticmethod):
        return "staticmethod " + _signature(getattr(cls, name))
    if inspect.isfunction(static):
        return "method " + _signature(getattr(instance, name))
    if callable(getattr(cls, name, None)) and not isinstance(static, type):
        return "callable " + _signature(getattr(cls, name))
    if name in vars(cls) and isinstance(static, int | float | str):
        return f"attribute = {static!r}"
    return "attribute"


def surface(cls: type, instance: object) -> Surface:
    """Every public name of `instance` (class and instance attributes) and its kind."""
    names = {n for n in dir(instance) if not n.startswith("_")} | {"__init__"}
    return {name: _kind(cls, instance, name) for name in sorted(names)}


def _run() -> ThreadRunSummary:
    return ThreadRunSummary(success=True)


@pytest.fixture(scope="module")
def surfaces() -> Iterator[dict[str, Surface]]:
    hasher = TokenHasher(4)
    manager = SessionManager(hasher, cleanup_interval=None)
    try:
        yield {
            "Session": surface(Session, Session("r", hasher)),
            "SessionManager": surface(SessionManager, manager),
            "TokenHasher": surface(TokenHasher, hasher),
            "PeriodicThread": surface(
                PeriodicThread, PeriodicThread("api-probe", 1.0, execute_fn=_run)
            ),
            "PeriodicThreadRegistry": surface(PeriodicThreadRegistry, PeriodicThreadRegistry()),
        }
    finally:
        manager.close()


@pytest.mark.parametrize("cls", SEED_CLASSES)
def test_public_names_and_signatures_are_the_pinned_ones(
    surfaces: dict[str, Surface], cls: str
) -> None:
    actual, pinned = surfaces[cls], KVTIER[cls]
    missing = sorted(set(pinned) - set(actual))
    added = sorted(set(actual) - set(pinned))
    changed = {n: (pinned[n], actual[n]) for n in pinned.keys() & actual.keys()}
    changed = {n: pair for n, pair in changed.items() if pair[0] != pair[1]}
    assert not (missing or added or changed), (
        f"{cls}'s public API moved: missing {missing}, new {added},"
        f" changed (pinned, now) {changed}. If on purpose, update KVTIER here, DIFFERENCES where"
        " a seed name is involved, and docs/architecture.md"
    )


@pytest.mark.parametrize("cls", SEED_CLASSES)
def test_every_seed_name_is_kept_or_its_difference_named(
    surfaces: dict[str, Surface], cls: str
) -> None:
    actual = surfaces[cls]
    unnamed = {
        name: (seed, actual.get(name, "missing"))
        for name, seed in SEED[cls].items()
        if actual.get(name) != seed and (cls, name) not in DIFFERENCES
    }
    assert not unnamed, (
        f"{cls} differs from LMCache 0.5.6 without a reason: (seed, kvtier) {unnamed}"
    )


def test_every_named_difference_is_real(surfaces: dict[str, Surface]) -> None:
    stale = [
        (cls, name)
        for cls, name in DIFFERENCES
        if name not in SEED[cls] or surfaces[cls].get(name) == SEED[cls][name]
    ]
    assert not stale, f"DIFFERENCES names entries that are not differences from the seed: {stale}"


def test_the_compatible_api_is_most_of_the_seed() -> None:
    """The guard against explaining everything away: most seed names are kept as they are."""
    kept = sum(
        KVTIER[cls].get(name) == spec for cls in SEED_CLASSES for name, spec in SEED[cls].items()
    )
    total = sum(len(SEED[cls]) for cls in SEED_CLASSES)
    assert kept == total - len(DIFFERENCES) and kept >= total // 2, (kept, total)

"""Bounds on every count and size a request carries, checked before the server does any work.

A request is decoded by msgspec (types only), then its bounds (the `Limits` method its route in
`routes.py` names) refuse any value that would make the server allocate or loop in proportion to
a number the client chose: a world size of 2**31, a range of 2**40 tokens, a chunk shape whose
product exceeds the arena, a megabyte model name. Only then does a handler touch the L1, the
sessions or the tiers. Frames themselves are bounded earlier, by ZMQ (`max_frame_bytes` becomes
the socket's MAXMSGSIZE, so an oversized frame is refused before it is read into memory).

Size alone does not bound work: a lookup asks the tiers about every shard of every chunk, so a
prompt of 4096 chunks at world size 1024 is 4 million tier lookups (seconds of prefetch work and
hundreds of megabytes). `max_lookup_shards` bounds chunks x world size per lookup.

`tenant_bounds` turns the per-tenant shares of the L1 into bytes (see `storage.l1.TenantBounds`).
They apply with a tokens file, where clients act for tenants that need not trust each other.
Without one, every client is the one anonymous tenant: a share would only shrink the server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from kvtier import protocol as p
from kvtier.config import ServerConfig
from kvtier.errors import BadArrayError, InvalidArgumentError, MisalignedRangeError
from kvtier.storage.l1 import UNBOUNDED, TenantBounds

__all__ = ["Limits", "SessionBounds", "tenant_bounds", "tenant_prefetch_jobs"]


def tenant_bounds(config: ServerConfig, capacity: int) -> TenantBounds:
    """The bytes of an L1 of `capacity` one tenant may hold in staging, quarantine and pins;
    none without --auth-tokens-file (one tenant)."""
    if not config.auth_tokens_file:
        return UNBOUNDED
    return TenantBounds(
        staging_bytes=int(config.tenant_staging_share * capacity),
        quarantine_bytes=int(config.tenant_quarantine_share * capacity),
        pinned_bytes=int(config.tenant_pinned_share * capacity),
    )


def tenant_prefetch_jobs(config: ServerConfig) -> int | None:
    """Prefetch jobs one tenant may run at once: its share of --max-prefetch-jobs, at least 1;
    no bound but that one without --auth-tokens-file (one tenant)."""
    if not config.auth_tokens_file:
        return None
    return max(1, int(config.tenant_prefetch_share * config.max_prefetch_jobs))


class SessionBounds(msgspec.Struct, frozen=True, kw_only=True):
    """What the session bounds hold now and have shed, for status and metrics."""

    tokens: int  # tokens held by all sessions together (--max-session-tokens)
    shed: int  # sessions ended early, longest-idle first, to keep within the bounds


#: longest accepted request id, model name, cache salt, client id or token (UTF-8 bytes)
MAX_NAME_BYTES = 1024
#: longest accepted extra key (an engine adapter sends a digest: 32 bytes)
MAX_EXTRA_KEY_BYTES = 256
#: most dimensions a chunk shape may have, and most entries in a Hello's contract_info
MAX_DIMS = 16
MAX_CONTRACT_FIELDS = 32
#: a Hello's fields (UTF-8 bytes): each is checked before any other work on the Hello (the
#: credential check, the contract comparison, the messages that quote them)
MAX_CLIENT_ID_BYTES = 128
MAX_TOKEN_BYTES = 1024  # tokens-file tokens are refused above this too (auth.py)
MAX_CONTRACT_BYTES = 128  # a contract is a hex digest
MAX_HOST_ID_BYTES = 512  # host name (<= 255) + "/" + boot id
MAX_CONTRACT_KEY_BYTES = 64
MAX_CONTRACT_VALUE_BYTES = 256  # a contract_info value: a number, a bool, None or a short text


def _name(field: str, value: str, limit: int = MAX_NAME_BYTES, *, quote: bool = True) -> None:
    """Refuse a text longer than `limit` UTF-8 bytes; the message quotes its start (`quote`
    False for a secret)."""
    # len() first: a str of more than `limit` characters has more than `limit` bytes, and a
    # huge one is refused without being encoded
    if len(value) > limit or len(value.encode("utf-8", "surrogatepass")) > limit:
        shown = f" ({value[:32]!r}...)" if quote else ""
        raise InvalidArgumentError(f"{field} is longer than {limit} bytes{shown}")


def _extra_key(value: bytes) -> None:
    if len(value) > MAX_EXTRA_KEY_BYTES:
        raise InvalidArgumentError(
            f"extra_key is {len(value)} bytes; at most {MAX_EXTRA_KEY_BYTES} (send a digest of "
            "the inputs it stands for)"
        )


def _prefill_speed(value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgumentError(
            f"prefill_tokens_per_s is {value!r}; give the engine's prefill speed in tokens per "
            "second, or 0 when unknown (every cached chunk is then reported)"
        )


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds one server enforces; built from its ServerConfig."""

    chunk_size: int
    max_request_tokens: int
    max_world_size: int
    max_chunk_bytes: int  # a chunk shard larger than this could never fit the arena anyway
    max_lookup_shards: int = 1 << 18  # chunks x world size one lookup may make the tiers check

    @property
    def max_request_chunks(self) -> int:
        return self.max_request_tokens // self.chunk_size

    # -- each request's bounds: its route (`server/routes.py`) names which ---------------------

    def hello(self, req: p.Hello) -> None:
        """Every field of a Hello bounded: it comes before any credential, from anyone."""
        _name("token", req.token, MAX_TOKEN_BYTES, quote=False)
        _name("client_id", req.client_id, MAX_CLIENT_ID_BYTES)
        _name("host_id", req.host_id, MAX_HOST_ID_BYTES)
        if req.contract is not None:
            _name("contract", req.contract, MAX_CONTRACT_BYTES)
        if len(req.contract_info) > MAX_CONTRACT_FIELDS:
            raise InvalidArgumentError(
                f"contract_info has {len(req.contract_info)} entries; at most {MAX_CONTRACT_FIELDS}"
            )
        for key, value in req.contract_info.items():
            _name("a contract_info key", key, MAX_CONTRACT_KEY_BYTES)
            if isinstance(value, str):
                _name(f"contract_info[{key!r}]", value, MAX_CONTRACT_VALUE_BYTES)
            elif not (value is None or isinstance(value, bool | int | float)):
                raise InvalidArgumentError(
                    f"contract_info[{key!r}] must be a number, a bool, null or a text, got "
                    f"{type(value).__name__}"
                )
            elif isinstance(value, int) and not -(2**63) <= value < 2**64:
                raise InvalidArgumentError(f"contract_info[{key!r}] is out of range")
        if not 0 <= req.pid < 2**31:
            raise InvalidArgumentError(f"pid {req.pid} is not a process id")

    def register(self, req: p.Register) -> None:
        _name("model", req.model)
        self._world(req.world_size, req.worker_id)
        self._shape(req.chunk_shape, req.dtype)
        if req.role and req.role not in p.HANDOFF_ROLES:
            raise InvalidArgumentError(
                f"role must be one of {', '.join(p.HANDOFF_ROLES)} or empty, not {req.role[:32]!r}"
            )
        _kv_groups(req.kv_groups)

    def lookup(self, req: p.Lookup) -> None:
        self._strings(req.request_id, req.model, req.cache_salt)
        _extra_key(req.extra_key)
        _prefill_speed(req.prefill_tokens_per_s)
        self._world(req.world_size, 0)
        self._readers(req.readers)
        self._tokens(req.tokens)
        self._lookup_work(len(req.tokens) // 4 // self.chunk_size, req.world_size)

    def poll(self, req: p.LookupPoll) -> None:
        _name("request_id", req.request_id)
        _name("cache_salt", req.cache_salt)

    def exists(self, req: p.ExistsKeys) -> None:
        self._strings("", req.model, req.cache_salt)
        _extra_key(req.extra_key)
        _prefill_speed(req.prefill_tokens_per_s)
        self._world(req.world_size, 0)
        self._lookup_work(len(req.names), req.world_size)

    def store(self, req: p.Reserve | p.StoreInline) -> None:
        self._range_request(req)
        self._resumable(req.resumable, req.num_chunks)

    def retrieve(self, req: p.Retrieve) -> None:
        self._range_request(req)
        self._reader(req.reader)

    def named(self, req: p.KeyRequest) -> None:
        """A request that moves chunks the caller names (ReserveKeys, StoreKeysInline,
        RetrieveKeys)."""
        self._strings(req.request_id, req.model, req.cache_salt)
        _extra_key(req.extra_key)
        self._world(req.world_size, req.worker_id)
        self._shape(req.chunk_shape, req.dtype)

    def end_handoff(self, req: p.EndHandoff) -> None:
        _name("request_id", req.request_id)
        self._strings(req.request_id, req.model, req.cache_salt)
        _extra_key(req.extra_key)
        self._world(req.world_size, 0)
        self._lookup_work(len(req.names), req.world_size)

    def session(self, req: p.Release | p.EndSession) -> None:
        _name("request_id", req.request_id)

    def nothing(self, req: object) -> None:
        """Ids and empty messages: nothing to bound."""

    # -- the bounds of each kind of field -------------------------------------------------------

    def _range_request(self, req: p.RangeRequest) -> None:
        self._strings(req.request_id, req.model, req.cache_salt)
        _extra_key(req.extra_key)
        self._world(req.world_size, req.worker_id)
        self._shape(req.chunk_shape, req.dtype)
        self._tokens(req.tokens)
        self._range(req.start, req.end, req.num_chunks)

    def _strings(self, request_id: str, model: str, cache_salt: str) -> None:
        _name("request_id", request_id)
        _name("model", model)
        _name("cache_salt", cache_salt)

    def _world(self, world_size: int, worker_id: int) -> None:
        if not 1 <= world_size <= self.max_world_size:
            raise InvalidArgumentError(
                f"world_size {world_size} is outside 1..{self.max_world_size} (--max-world-size)"
            )
        if not 0 <= worker_id < world_size:
            raise InvalidArgumentError(
                f"worker_id {worker_id} is outside range(world_size={world_size})"
            )

    def _readers(self, readers: int) -> None:
        if not 0 <= readers <= self.max_world_size:
            raise InvalidArgumentError(
                f"readers {readers} is outside 0..{self.max_world_size} (0: world_size; at most "
                "--max-world-size ranks retrieve under one lookup)"
            )

    def _reader(self, reader: int) -> None:
        if not -1 <= reader < self.max_world_size:
            raise InvalidArgumentError(
                f"reader {reader} is outside -1..{self.max_world_size - 1} (-1: the worker_id; "
                "else the rank's index in range(readers) of the lookup, --max-world-size)"
            )

    @staticmethod
    def _resumable(resumable: list[bool], num_chunks: int) -> None:
        if resumable and len(resumable) != num_chunks:
            raise BadArrayError(
                f"resumable has {len(resumable)} flags for {num_chunks} chunks: one per chunk "
                "of the range, or none (every chunk resumable)"
            )

    def _shape(self, chunk_shape: list[int], dtype: str) -> None:
        _name("dtype", dtype, 32)
        if not 0 < len(chunk_shape) <= MAX_DIMS:
            raise BadArrayError(
                f"chunk shape {chunk_shape[:MAX_DIMS]} must have 1..{MAX_DIMS} dimensions"
            )
        if any(d <= 0 for d in chunk_shape):
            raise BadArrayError(f"chunk shape {chunk_shape} must be positive")
        # The product may be astronomically large; math.prod of <= 16 ints is cheap regardless.
        # Every dtype has at least one byte per element, so more elements than arena bytes
        # can never be stored.
        elements = math.prod(chunk_shape)
        if elements > self.max_chunk_bytes:
            raise BadArrayError(
                f"a chunk of shape {chunk_shape} ({elements} elements) cannot fit the "
                f"{self.max_chunk_bytes}-byte arena (--l1-size)"
            )

    def _lookup_work(self, num_chunks: int, world_size: int) -> None:
        if num_chunks * world_size > self.max_lookup_shards:
            raise InvalidArgumentError(
                f"a lookup of {num_chunks} chunks at world_size {world_size} asks about "
                f"{num_chunks * world_size} shards; at most {self.max_lookup_shards} "
                "(--max-lookup-shards): look up a shorter prefix"
            )

    def _tokens(self, tokens: bytes) -> None:
        if len(tokens) > 4 * self.max_request_tokens:
            raise InvalidArgumentError(
                f"{len(tokens) // 4} tokens in one request; at most {self.max_request_tokens} "
                "(--max-request-tokens)"
            )

    def _range(self, start: int, end: int, num_chunks: int) -> None:
        if not 0 <= start <= end <= self.max_request_tokens:
            raise MisalignedRangeError(
                f"token range [{start}, {end}) must satisfy 0 <= start <= end <= "
                f"{self.max_request_tokens} (--max-request-tokens)"
            )
        if not 0 <= num_chunks <= self.max_request_chunks:
            raise BadArrayError(
                f"{num_chunks} chunks in one request; at most {self.max_request_chunks} "
                "(--max-request-tokens / --chunk-size)"
            )


def _kv_groups(groups: list[p.KVGroup]) -> None:
    if len(groups) > p.MAX_KV_GROUPS:
        raise InvalidArgumentError(
            f"kv_groups names {len(groups)} groups, more than {p.MAX_KV_GROUPS}"
        )
    seen: set[int] = set()
    for g in groups:
        _name("kv_groups kind", g.kind, 64)
        if not 0 <= g.group_idx < p.MAX_KV_GROUPS or g.group_idx in seen:
            raise InvalidArgumentError(
                f"kv_groups: group_idx {g.group_idx} is repeated or outside "
                f"0..{p.MAX_KV_GROUPS - 1}"
            )
        if not 0 <= g.sliding_window < 2**31:
            raise InvalidArgumentError(
                f"kv_groups: sliding_window {g.sliding_window} is out of range"
            )
        seen.add(g.group_idx)

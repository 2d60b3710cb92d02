"""The server's configuration: one dataclass, the single source of truth for every option.

`kvtier serve`'s flags and the `KVTIER_*` environment variables are generated from the fields
below (name, default, help), so an option cannot exist in one place and not the other.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.hashing import HASH_ALGORITHMS
from kvtier.redaction import redact
from kvtier.sizes import format_size, parse_size

__all__ = [
    "ADMIN_TOKEN_ENV",
    "DEFAULT_L2",
    "MIN_ADMIN_TOKEN_CHARS",
    "ConfigError",
    "ServerConfig",
    "admin_token_file",
    "format_size",
    "is_loopback_host",
    "parse_size",
]

#: the smallest L1 the server starts with; a layout whose chunk (all ranks) does not fit in the
#: L1 is refused when a worker registers it, the first moment its size is known
MIN_L1_SIZE = 64 << 10

LOG_LEVELS = ("debug", "info", "warning", "error")

#: L1 cache policies (`--policy`): which stored chunks are kept as cache (storage/admission.py)
CACHE_POLICIES = ("adaptive", "doorkeeper", "lru")


class ConfigError(ValueError):
    """A configuration mistake: the message names the option and shows a valid example."""


ADMIN_TOKEN_ENV = "KVTIER_ADMIN_TOKEN"

#: the shortest --admin-token accepted where other machines can reach the admin API
MIN_ADMIN_TOKEN_CHARS = 16


def is_loopback_host(host: str) -> bool:
    """True when `host` (a name or address to bind) only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def _runtime_dir() -> Path:
    """A folder only this user can enter: $XDG_RUNTIME_DIR/kvtier or /tmp/kvtier-<uid>."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "kvtier" if base else Path(f"/tmp/kvtier-{os.getuid()}")
    return path


def admin_token_file(port: int, *, create_dir: bool = False) -> Path:
    """Where a server whose admin API listens on `port` keeps its generated token (mode 0600).

    `kvtier clear` and `kvtier status` read it when no --token is given. The folder is refused
    when another user owns it or can enter it (someone could have planted a token there).
    """
    folder = _runtime_dir()
    if create_dir:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.exists():
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ConfigError(
                f"{folder} must be a folder of this user with mode 0700 to hold the admin token "
                "file; remove it, or set --admin-token"
            )
    return folder / f"admin-{port}.token"


#: the embedded default L2: a local folder per server (per arena), needing nothing installed
DEFAULT_L2 = "disk://~/.cache/kvtier/{arena}?size=10GiB"


def _opt(default: Any, help: str, *, kind: str = "", example: str = "", metavar: str = "") -> Any:
    """A config field with its CLI help, a valid `example` (shown with a mistake) and metavar;
    `kind` "size" parses byte sizes like 2GiB."""
    metadata = {"help": help, "kind": kind, "example": example, "metavar": metavar}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _hash_help() -> str:
    names = "; ".join(f"{name}: {spec.summary}" for name, spec in HASH_ALGORITHMS.items())
    return f"Chunk hash ({names})"


@dataclass
class ServerConfig:
    """Every knob of `kvtier serve`, with its default."""

    address: list[str] = _opt(
        ["ipc:///tmp/kvtier.sock"],
        "ZMQ address(es) to listen on: ipc:///path or tcp://host:port (repeat for several)",
        example="--address ipc:///tmp/kvtier.sock",
        metavar="URL",
    )
    l1_size: int = _opt(
        1024**3,
        "Byte capacity of the shared-memory L1, with a unit (GiB = 2^30, GB = 10^9)",
        kind="size",
        example="--l1-size 2GiB",
        metavar="SIZE",
    )
    l2: list[str] = _opt(
        [DEFAULT_L2],
        "L2 tier URL(s), consulted in order: disk:///path?size=50GiB, redis://host:6379/0"
        "?prefix=kvtier&ttl=3600 (repeat for several; 'none' for no L2). {arena} stands for "
        "the arena name, so servers on different addresses never share a folder",
        example="--l2 'disk:///var/lib/kvtier?size=50GiB'",
        metavar="URL",
    )
    policy: str = _opt(
        "adaptive",
        "L1 cache policy: adaptive (keep only chunks likely to be read again when L1 is under "
        "pressure, everything when it has room), doorkeeper (keep a chunk once a lookup saw its "
        "name before), lru (keep everything). A chunk L1 does not keep is evicted first, never "
        "announced in KV events and never written to an L2 tier",
        example="--policy adaptive",
        metavar="NAME",
    )
    chunk_size: int = _opt(256, "Tokens per chunk", example="--chunk-size 256", metavar="TOKENS")
    hash_algorithm: str = _opt(
        "blake3", _hash_help(), example="--hash-algorithm blake3", metavar="NAME"
    )
    hash_seed: str | None = _opt(
        None,
        "Hash seed (sha256_cbor needs the engine's PYTHONHASHSEED to match vLLM)",
        example="--hash-seed 0",
        metavar="TEXT",
    )
    arena_name: str | None = _opt(
        None,
        "Shared-memory segment name (default: derived from the first address)",
        example="--arena-name kvtier-main",
        metavar="NAME",
    )
    prefault: bool = _opt(True, "Touch every arena page at start so no store pays first-touch")
    session_ttl: float = _opt(
        600.0,
        "Seconds after its last use that a session expires",
        example="--session-ttl 600",
        metavar="SECONDS",
    )
    session_cleanup_interval: float = _opt(
        10.0,
        "Seconds between session expiry sweeps",
        example="--session-cleanup-interval 10",
        metavar="SECONDS",
    )
    tenant_session_share: float = _opt(
        0.5,
        "With --auth-tokens-file: the fraction of --max-sessions and of --max-session-tokens "
        "that one tenant's sessions may hold; a tenant over its share ends its own longest-idle "
        "sessions, never another tenant's",
        example="--tenant-session-share 0.5",
        metavar="FRACTION",
    )
    pin_lease: float = _opt(
        60.0,
        "Seconds a lookup's pins survive after the client that made the lookup was last seen "
        "(its heartbeats keep them) and the request last used them",
        example="--pin-lease 60",
        metavar="SECONDS",
    )
    staging_lease: float = _opt(
        30.0,
        "Seconds a store may hold uncommitted staging slots",
        example="--staging-lease 30",
        metavar="SECONDS",
    )
    handoff_lease: float = _opt(
        60.0,
        "Seconds a prefill instance's hand-off object stays pinned for its decode instance; "
        "freed when the decoder has read it or this lease lapses",
        example="--handoff-lease 60",
        metavar="SECONDS",
    )
    client_timeout: float = _opt(
        10.0,
        "Seconds without a heartbeat after which a client's leases are reclaimed",
        example="--client-timeout 10",
        metavar="SECONDS",
    )
    reap_interval: float = _opt(
        1.0,
        "Seconds between lease-reclaim sweeps",
        example="--reap-interval 1",
        metavar="SECONDS",
    )
    l2_queue_size: int = _opt(
        1024,
        "Chunks the L2 write-through queue holds",
        example="--l2-queue-size 1024",
        metavar="CHUNKS",
    )
    l2_queue_policy: str = _opt(
        "drop",
        "When the write-through queue is full: drop (and count) or block",
        example="--l2-queue-policy drop",
        metavar="POLICY",
    )
    kv_events_endpoint: str | None = _opt(
        None,
        "ZMQ PUB address on which KV events (vLLM's format: BlockStored, BlockRemoved, "
        "AllBlocksCleared) are published for routers; a '*' host binds, another connects. "
        "They carry prompt tokens and have no credential: bind where only the router reaches",
        example="--kv-events-endpoint 'tcp://*:5557'",
        metavar="URL",
    )
    kv_events_replay_endpoint: str | None = _opt(
        None,
        "ZMQ ROUTER address answering vLLM's replay request (a start sequence number) with "
        "the buffered event batches and vLLM's end marker",
        example="--kv-events-replay-endpoint 'tcp://*:5558'",
        metavar="URL",
    )
    kv_events_topic: str = _opt(
        "",
        "Topic prefix of the KV events: each batch's topic is this prefix followed by its "
        "chunks' model, so a router subscribes per model",
        example="--kv-events-topic kvtier",
        metavar="TEXT",
    )
    kv_events_int_hashes: bool = _opt(
        True,
        "Publish block hashes as vLLM does by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): "
        "the chunk name's last 8 bytes as an unsigned integer; --no-kv-events-int-hashes "
        "publishes the whole name as bytes (vLLM with that variable set to 0)",
    )
    kv_events_buffer: int = _opt(
        10_000,
        "Event batches kept for replay (the oldest are dropped first)",
        example="--kv-events-buffer 10000",
        metavar="BATCHES",
    )
    kv_events_token_chunks: int = _opt(
        65_536,
        "Chunks whose tokens and parent the KV events remember, most recently stored first: a "
        "BlockStored of a chunk past them (a write to L2 long after its store, one that "
        "survived a restart) carries no token_ids",
        example="--kv-events-token-chunks 65536",
        metavar="CHUNKS",
    )
    kv_events_buffer_bytes: int = _opt(
        256 * 1024**2,
        "Bytes of event batches kept for replay, all tenants together; past it the oldest "
        "batch of the tenant holding the most goes first, so one tenant's stores shorten only "
        "its own replay window",
        kind="size",
        example="--kv-events-buffer-bytes 256MiB",
        metavar="SIZE",
    )
    kv_events_max_connections: int = _opt(
        16,
        "Tcp connections each KV events socket (PUB, replay) holds at once; one past it is "
        "shut down as soon as it is accepted",
        example="--kv-events-max-connections 16",
    )
    kv_events_queue_bytes: int = _opt(
        32 * 1024**2,
        "Bytes of event batches (and of a replay) queued for one subscriber that does not read "
        "them; past it its batches are dropped (it sees the sequence gap)",
        kind="size",
        example="--kv-events-queue-bytes 32MiB",
        metavar="SIZE",
    )
    max_prefetch_jobs: int = _opt(
        8,
        "Lookups loading from L2 at once; more are answered from L1 alone (like LMCache)",
        example="--max-prefetch-jobs 8",
        metavar="JOBS",
    )
    miss_memory: int = _opt(
        65536,
        "Chunk names remembered to say why a lookup missed (evicted from which tier, another "
        "salt or model, a lapsed store): about 300 bytes each; a name forgotten counts as "
        "never stored",
        example="--miss-memory 65536",
        metavar="NAMES",
    )
    handler_threads: int = _opt(
        4,
        "Threads that handle requests with long prompts or inline bytes, off the I/O thread",
        example="--handler-threads 4",
        metavar="THREADS",
    )
    admin_host: str = _opt(
        "127.0.0.1",
        "Admin HTTP host; any non-loopback host requires --admin-token",
        example="--admin-host 127.0.0.1",
        metavar="HOST",
    )
    admin_port: int = _opt(
        8080,
        "Admin HTTP port (0 picks a free one; -1 disables the API)",
        example="--admin-port 8080",
        metavar="PORT",
    )
    max_admin_connections: int = _opt(
        64,
        "Connections the admin API holds at once (one past it is closed as soon as it is "
        "accepted; one without a request 10 s after it was accepted is closed too)",
        example="--max-admin-connections 64",
    )
    admin_token: str | None = _opt(
        None,
        "Bearer token every admin endpoint but /health then requires (without it, reads are "
        "open on loopback and changes need the token the server writes to "
        "$XDG_RUNTIME_DIR/kvtier/admin-PORT.token or /tmp/kvtier-UID/admin-PORT.token)",
        example='--admin-token "$(openssl rand -hex 16)"',
        metavar="TOKEN",
    )
    log_level: str = _opt(
        "info",
        "Log level: " + ", ".join(LOG_LEVELS),
        example="--log-level info",
        metavar="LEVEL",
    )
    max_frame_bytes: int = _opt(
        256 * 1024**2,
        "Largest ZMQ frame accepted (a header or one inline chunk); bigger ones are refused "
        "before they are read",
        kind="size",
        example="--max-frame-bytes 256MiB",
        metavar="SIZE",
    )
    max_request_tokens: int = _opt(
        1 << 20,
        "Most tokens one request may carry (prompt length and range end)",
        example="--max-request-tokens 1048576",
    )
    max_world_size: int = _opt(
        1024, "Largest tensor-parallel world size a request may name", example="--max-world-size 64"
    )
    max_sessions: int = _opt(
        65536,
        "Sessions held at once; beyond it the longest-idle ones are ended (and counted)",
        example="--max-sessions 65536",
    )
    max_session_tokens: int = _opt(
        64 << 20,
        "Tokens held by all sessions together; beyond it the longest-idle sessions are ended",
        example="--max-session-tokens 67108864",
    )
    tenant_staging_share: float = _opt(
        0.5,
        "With --auth-tokens-file: the fraction of --l1-size one tenant's staging (reserved, "
        "uncommitted) slots may take; its store past it gets NO_SPACE, other tenants' do not",
        example="--tenant-staging-share 0.5",
        metavar="FRACTION",
    )
    tenant_quarantine_share: float = _opt(
        0.5,
        "With --auth-tokens-file: the fraction of --l1-size one tenant's quarantined slots (of "
        "its clients that went silent while they may still write) plus its staging slots may "
        "take; past it its stores get NO_SPACE until its clients commit, abort or exit",
        example="--tenant-quarantine-share 0.5",
        metavar="FRACTION",
    )
    tenant_pinned_share: float = _opt(
        0.5,
        "With --auth-tokens-file: the fraction of --l1-size one tenant's lookups may hold "
        "pinned; a lookup reports as hit only the leading chunks that fit",
        example="--tenant-pinned-share 0.5",
        metavar="FRACTION",
    )
    tenant_prefetch_share: float = _opt(
        0.5,
        "With --auth-tokens-file: the fraction of --max-prefetch-jobs one tenant's lookups may "
        "run at once (at least one); more of its lookups are answered from L1 alone",
        example="--tenant-prefetch-share 0.5",
        metavar="FRACTION",
    )
    max_lookup_shards: int = _opt(
        1 << 18,
        "Most shards (chunks x world size) one lookup or ExistsKeys may ask the tiers about: "
        "the work a prefetch job does is bounded by it",
        example="--max-lookup-shards 262144",
    )
    auth_tokens_file: str | None = _opt(
        None,
        "File of client credentials, one 'TOKEN TENANT [SALT ...]' per line: a client must "
        "name a TOKEN at its handshake, its sessions are its TENANT's, and it may use only "
        "the listed cache salts (none listed: any). Required for a tcp address off loopback",
        example="--auth-tokens-file /etc/kvtier/tokens",
        metavar="PATH",
    )

    max_clients_per_tenant: int = _opt(
        1024,
        "Client ids one tenant may have connected at once (all anonymous clients are one "
        "tenant); a Hello beyond it is refused with NO_SPACE",
        example="--max-clients-per-tenant 1024",
    )
    max_connections_per_client: int = _opt(
        256,
        "Sockets one client id may say Hello on (a client opens one per thread); a Hello "
        "beyond it is refused with NO_SPACE",
        example="--max-connections-per-client 256",
    )
    max_watched_processes: int = _opt(
        1024,
        "Client processes watched at once (a pidfd each, shared by the process's clients; "
        "never more than a quarter of the descriptor limit); a Hello beyond it is refused "
        "with NO_SPACE",
        example="--max-watched-processes 1024",
    )
    max_registrations_per_client: int = _opt(
        1024,
        "Layouts (model, world size, rank) one client may register; a Register beyond it is "
        "refused with NO_SPACE",
        example="--max-registrations-per-client 1024",
    )
    layout_ttl: float = _opt(
        600.0,
        "Seconds a registered layout is kept once no connected client has registered it and "
        "no request used it; then it is forgotten (a client registers again)",
        example="--layout-ttl 600",
        metavar="SECONDS",
    )
    max_queued_requests: int = _opt(
        64,
        "Requests one connection may have waiting unread (ZMQ RCVHWM; beyond it the server "
        "reads that connection no further until it catches up); 16 times as many replies may "
        "wait for a peer that does not read them (SNDHWM; beyond it they are dropped)",
        example="--max-queued-requests 64",
    )
    max_inflight_bytes: int = _opt(
        1024**3,
        "Bytes of requests received and not yet answered (inline stores waiting for a "
        "handler thread); a request that would pass it is refused with NO_SPACE, and one "
        "request alone is always taken",
        kind="size",
        example="--max-inflight-bytes 1GiB",
        metavar="SIZE",
    )

    def __post_init__(self) -> None:
        raw = self.l1_size
        try:
            self.l1_size = parse_size(raw, require_unit=True)
        except ValueError:
            raise self.error("l1_size", f"{raw!r} is not a byte size with a unit") from None
        if self.l1_size < MIN_L1_SIZE:
            raise self.error(
                "l1_size",
                f"{format_size(self.l1_size)} is below the smallest L1, {format_size(MIN_L1_SIZE)}",
            )
        if self.chunk_size <= 0:
            raise self.error("chunk_size", f"must be a positive number of tokens, got "
                             f"{self.chunk_size}")  # fmt: skip
        if self.handler_threads < 1:
            raise self.error("handler_threads", f"must be at least 1, got "
                             f"{self.handler_threads}")  # fmt: skip
        if self.miss_memory < 1:
            raise self.error("miss_memory", f"must be at least 1, got {self.miss_memory}")
        if self.max_prefetch_jobs < 1:
            raise self.error("max_prefetch_jobs", f"must be at least 1, got "
                             f"{self.max_prefetch_jobs}")  # fmt: skip
        if not self.address:
            raise self.error("address", "at least one address is required")
        for address in self.address:
            if not address.startswith(("ipc://", "tcp://")):
                raise self.error("address", f"{address!r} is not an ipc:// or tcp:// address")
        if self.l2_queue_policy not in ("drop", "block"):
            raise self.error("l2_queue_policy", f"must be drop or block, got "
                             f"{self.l2_queue_policy!r}")  # fmt: skip
        if self.l2_queue_size < 1:
            raise self.error("l2_queue_size", f"must be at least 1, got {self.l2_queue_size}")
        for name in ("kv_events_buffer", "kv_events_token_chunks"):
            if getattr(self, name) < 1:
                raise self.error(name, f"must be at least 1, got {getattr(self, name)}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise self.error(name, f"{endpoint!r} is not a tcp://, ipc:// or inproc:// address")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise self.error(
                "kv_events_replay_endpoint", "replays events, so it needs --kv-events-endpoint"
            )
        if self.log_level.lower() not in LOG_LEVELS:
            raise self.error(
                "log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.policy not in CACHE_POLICIES:
            raise self.error(
                "policy",
                f"unknown cache policy {self.policy!r}; one of {', '.join(CACHE_POLICIES)}",
            )
        spec = HASH_ALGORITHMS.get(self.hash_algorithm)
        if spec is None:
            raise self.error(
                "hash_algorithm",
                f"unknown algorithm {self.hash_algorithm!r}; one of " + ", ".join(HASH_ALGORITHMS),
            )
        if spec.requires_seed and self.hash_seed is None:
            raise self.error(
                "hash_seed",
                f"--hash-algorithm {self.hash_algorithm} reproduces vLLM's block hashes, whose "
                "first parent comes from the engine's PYTHONHASHSEED: pass that value",
            )
        for name in ("session_ttl", "session_cleanup_interval", "pin_lease", "staging_lease",
                     "handoff_lease", "client_timeout", "reap_interval",
                     "layout_ttl"):  # fmt: skip
            value = getattr(self, name)
            if not value > 0:
                raise self.error(name, f"must be a positive number of seconds, got {value}")
        if not 0 < self.tenant_session_share <= 1:
            raise self.error(
                "tenant_session_share", f"must be in (0, 1], got {self.tenant_session_share}"
            )
        raw_frame = self.max_frame_bytes
        try:
            self.max_frame_bytes = parse_size(raw_frame)
        except ValueError:
            raise self.error("max_frame_bytes", f"{raw_frame!r} is not a byte size") from None
        for name in ("max_inflight_bytes", "kv_events_buffer_bytes", "kv_events_queue_bytes"):
            raw = getattr(self, name)
            try:
                setattr(self, name, parse_size(raw))
            except ValueError:
                raise self.error(name, f"{raw!r} is not a byte size") from None
        for name in ("max_frame_bytes", "max_request_tokens", "max_world_size", "max_sessions",
                     "max_session_tokens", "max_clients_per_tenant", "max_connections_per_client",
                     "max_watched_processes", "max_queued_requests",
                     "max_inflight_bytes", "max_lookup_shards", "kv_events_buffer_bytes",
                     "kv_events_max_connections", "kv_events_queue_bytes",
                     "max_admin_connections", "max_registrations_per_client"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise self.error(name, f"must be positive, got {getattr(self, name)}")
        for name in ("tenant_staging_share", "tenant_quarantine_share", "tenant_pinned_share",
                     "tenant_prefetch_share"):  # fmt: skip
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise self.error(name, f"must be a fraction in (0, 1], got {value}")
        if not -1 <= self.admin_port <= 65535:
            raise self.error("admin_port", f"must be in [-1, 65535], got {self.admin_port}")
        if self.admin_token is not None and not self.admin_token:
            raise self.error("admin_token", "must not be empty")
        if (
            self.admin_token is not None
            and len(self.admin_token) < MIN_ADMIN_TOKEN_CHARS
            and not is_loopback_host(self.admin_host)
        ):
            raise self.error(
                "admin_token",
                f"{len(self.admin_token)} characters is too short to guard an admin API other "
                f"machines can reach (--admin-host {self.admin_host}): use at least "
                f"{MIN_ADMIN_TOKEN_CHARS}",
            )

    @classmethod
    def error(cls, name: str, message: str) -> ConfigError:
        """A ConfigError naming the option `name` and a valid example of it."""
        example = cls.field(name).metadata.get("example", "")
        option = "--" + name.replace("_", "-")
        hint = f" (e.g. {example})" if example else ""
        return ConfigError(f"{option}: {message}{hint}")

    @classmethod
    def field(cls, name: str) -> dataclasses.Field[Any]:
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f
        raise KeyError(name)

    def l2_urls(self, arena_name: str) -> list[str]:
        """The L2 tier URLs to open, in order, with {arena} filled in ("none" means no L2)."""
        return [u.replace("{arena}", arena_name) for u in self.l2 if u and u.lower() != "none"]

    def l2_display(self, arena_name: str) -> list[str]:
        """`l2_urls` with credentials redacted, for logs and the status page."""
        return [redact(url) for url in self.l2_urls(arena_name)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe view with credentials redacted (admin token, passwords in L2 URLs)."""
        data = dataclasses.asdict(self)
        if data["admin_token"]:
            data["admin_token"] = "***"
        arena = self.arena_name
        data["l2"] = [redact(url.replace("{arena}", arena) if arena else url) for url in self.l2]
        return data

    @staticmethod
    def env_var(name: str) -> str:
        """The environment variable of option `name` (one rule: KVTIER_ + its upper name)."""
        return "KVTIER_" + name.upper()

    @classmethod
    def options(cls) -> list[dataclasses.Field[Any]]:
        return list(dataclasses.fields(cls))

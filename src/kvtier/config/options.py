"""Every option of `kvtier serve` (`ServerOptions`): its name, default, help and a valid example;
`kvtier serve`'s flags and the `KVTIER_*` environment variables are generated from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvtier.hashing import HASH_ALGORITHMS

#: the smallest L1 the server starts with; a layout whose chunk (all ranks) does not fit in the
#: L1 is refused when a worker registers it, the first moment its size is known
MIN_L1_SIZE = 64 << 10

LOG_LEVELS = ("debug", "info", "warning", "error")

#: L1 cache policies (`--policy`): which stored chunks are kept as cache (storage/admission.py)
CACHE_POLICIES = ("adaptive", "doorkeeper", "lru")


class ConfigError(ValueError):
    """A configuration mistake: the message names the option and shows a valid example."""


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
class ServerOptions:
    """Every knob of `kvtier serve`, with its default (`ServerConfig` checks them)."""

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

    @staticmethod
    def env_var(name: str) -> str:
        """The environment variable of option `name` (one rule: KVTIER_ + its upper name)."""
        return "KVTIER_" + name.upper()

    @classmethod
    def options(cls) -> list[dataclasses.Field[Any]]:
        return list(dataclasses.fields(cls))

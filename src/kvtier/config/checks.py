"""What a valid configuration is: every option's value checked (sizes parsed), each mistake a
`ConfigError` naming the option with a valid example."""

from __future__ import annotations

from kvtier.config.admin import MIN_ADMIN_TOKEN_CHARS, is_loopback_host
from kvtier.config.options import CACHE_POLICIES, LOG_LEVELS, MIN_L1_SIZE, ServerOptions
from kvtier.config.sizes import format_size, parse_size
from kvtier.hashing import HASH_ALGORITHMS


def check(config: ServerOptions) -> None:
    """Raise ConfigError for the first option of `config` whose value is wrong; byte sizes
    written as text ("2GiB") become ints."""
    raw = config.l1_size
    try:
        config.l1_size = parse_size(raw, require_unit=True)
    except ValueError:
        raise config.error("l1_size", f"{raw!r} is not a byte size with a unit") from None
    if config.l1_size < MIN_L1_SIZE:
        raise config.error(
            "l1_size",
            f"{format_size(config.l1_size)} is below the smallest L1, {format_size(MIN_L1_SIZE)}",
        )
    if config.chunk_size <= 0:
        raise config.error("chunk_size", f"must be a positive number of tokens, got "
                           f"{config.chunk_size}")  # fmt: skip
    if config.handler_threads < 1:
        raise config.error("handler_threads", f"must be at least 1, got "
                           f"{config.handler_threads}")  # fmt: skip
    if config.miss_memory < 1:
        raise config.error("miss_memory", f"must be at least 1, got {config.miss_memory}")
    if config.max_prefetch_jobs < 1:
        raise config.error("max_prefetch_jobs", f"must be at least 1, got "
                           f"{config.max_prefetch_jobs}")  # fmt: skip
    if not config.address:
        raise config.error("address", "at least one address is required")
    for address in config.address:
        if not address.startswith(("ipc://", "tcp://")):
            raise config.error("address", f"{address!r} is not an ipc:// or tcp:// address")
    if config.l2_queue_policy not in ("drop", "block"):
        raise config.error("l2_queue_policy", f"must be drop or block, got "
                           f"{config.l2_queue_policy!r}")  # fmt: skip
    if config.l2_queue_size < 1:
        raise config.error("l2_queue_size", f"must be at least 1, got {config.l2_queue_size}")
    for name in ("kv_events_buffer", "kv_events_token_chunks"):
        if getattr(config, name) < 1:
            raise config.error(name, f"must be at least 1, got {getattr(config, name)}")
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        endpoint = getattr(config, name)
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise config.error(name, f"{endpoint!r} is not a tcp://, ipc:// or inproc:// address")
    if config.kv_events_replay_endpoint is not None and config.kv_events_endpoint is None:
        raise config.error(
            "kv_events_replay_endpoint", "replays events, so it needs --kv-events-endpoint"
        )
    if config.log_level.lower() not in LOG_LEVELS:
        raise config.error(
            "log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {config.log_level!r}"
        )
    if config.policy not in CACHE_POLICIES:
        raise config.error(
            "policy",
            f"unknown cache policy {config.policy!r}; one of {', '.join(CACHE_POLICIES)}",
        )
    spec = HASH_ALGORITHMS.get(config.hash_algorithm)
    if spec is None:
        raise config.error(
            "hash_algorithm",
            f"unknown algorithm {config.hash_algorithm!r}; one of " + ", ".join(HASH_ALGORITHMS),
        )
    if spec.requires_seed and config.hash_seed is None:
        raise config.error(
            "hash_seed",
            f"--hash-algorithm {config.hash_algorithm} reproduces vLLM's block hashes, whose "
            "first parent comes from the engine's PYTHONHASHSEED: pass that value",
        )
    for name in ("session_ttl", "session_cleanup_interval", "pin_lease", "staging_lease",
                 "handoff_lease", "client_timeout", "reap_interval",
                 "layout_ttl"):  # fmt: skip
        value = getattr(config, name)
        if not value > 0:
            raise config.error(name, f"must be a positive number of seconds, got {value}")
    if not 0 < config.tenant_session_share <= 1:
        raise config.error(
            "tenant_session_share", f"must be in (0, 1], got {config.tenant_session_share}"
        )
    raw_frame = config.max_frame_bytes
    try:
        config.max_frame_bytes = parse_size(raw_frame)
    except ValueError:
        raise config.error("max_frame_bytes", f"{raw_frame!r} is not a byte size") from None
    for name in ("max_inflight_bytes", "kv_events_buffer_bytes", "kv_events_queue_bytes"):
        raw = getattr(config, name)
        try:
            setattr(config, name, parse_size(raw))
        except ValueError:
            raise config.error(name, f"{raw!r} is not a byte size") from None
    for name in ("max_frame_bytes", "max_request_tokens", "max_world_size", "max_sessions",
                 "max_session_tokens", "max_clients_per_tenant", "max_connections_per_client",
                 "max_watched_processes", "max_queued_requests",
                 "max_inflight_bytes", "max_lookup_shards", "kv_events_buffer_bytes",
                 "kv_events_max_connections", "kv_events_queue_bytes",
                 "max_admin_connections", "max_registrations_per_client"):  # fmt: skip
        if getattr(config, name) <= 0:
            raise config.error(name, f"must be positive, got {getattr(config, name)}")
    for name in ("tenant_staging_share", "tenant_quarantine_share", "tenant_pinned_share",
                 "tenant_prefetch_share"):  # fmt: skip
        value = getattr(config, name)
        if not 0 < value <= 1:
            raise config.error(name, f"must be a fraction in (0, 1], got {value}")
    if not -1 <= config.admin_port <= 65535:
        raise config.error("admin_port", f"must be in [-1, 65535], got {config.admin_port}")
    if config.admin_token is not None and not config.admin_token:
        raise config.error("admin_token", "must not be empty")
    if (
        config.admin_token is not None
        and len(config.admin_token) < MIN_ADMIN_TOKEN_CHARS
        and not is_loopback_host(config.admin_host)
    ):
        raise config.error(
            "admin_token",
            f"{len(config.admin_token)} characters is too short to guard an admin API other "
            f"machines can reach (--admin-host {config.admin_host}): use at least "
            f"{MIN_ADMIN_TOKEN_CHARS}",
        )

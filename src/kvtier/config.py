"""The server's configuration: one dataclass, the single source of truth for every option.

`kvtier serve`'s flags and the `KVTIER_*` environment variables are generated from the fields
below (name, default, help), so an option cannot exist in one place and not the other.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_L2", "ServerConfig", "format_size", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in a size such as "50GiB", "512MiB", "1G", "1.5KiB", "4096" or "4096B".

    Follows coreutils: "K"/"KiB" are powers of 1024, "KB" (a B without the i) powers of 1000.
    """
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if m is None or (not m.group(2) and m.group(3)):
        raise ValueError(f"not a byte size: {text!r} (expected e.g. '50GiB', '512MiB', '4096')")
    number, unit, binary, b_suffix = m.groups()
    power = "kmgtp".index(unit.lower()) + 1 if unit else 0
    base = 1000 if b_suffix and not binary else 1024
    value = float(number) * base**power
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def format_size(num_bytes: int) -> str:
    """The inverse of parse_size for display: 2147483648 -> "2GiB"."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:g}{unit}" if unit != "B" else f"{int(value)}B"
        value /= 1024
    raise AssertionError("unreachable")


#: the embedded default L2: a local folder per server (per arena), needing nothing installed
DEFAULT_L2 = "disk://~/.cache/kvtier/{arena}?size=10GiB"


def _opt(default: Any, help: str, *, kind: str = "", **kw: Any) -> Any:
    """A config field with its CLI help; `kind` "size" parses byte sizes like 2GiB."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, "kind": kind})
    return field(default=default, metadata={"help": help, "kind": kind, **kw})


@dataclass
class ServerConfig:
    """Every knob of `kvtier serve`, with its default."""

    address: list[str] = _opt(
        ["ipc:///tmp/kvtier.sock"],
        "ZMQ address(es) to listen on: ipc:///path or tcp://host:port (repeat for several)",
    )
    l1_size: int = _opt(1024**3, "Byte capacity of the shared-memory L1 (e.g. 2GiB)", kind="size")
    l2: list[str] = _opt(
        [DEFAULT_L2],
        "L2 tier URL(s), consulted in order: disk:///path?size=50GiB, redis://host:6379/0"
        "?prefix=kvtier&ttl=3600 (repeat for several; 'none' for no L2). {arena} stands for "
        "the arena name, so servers on different addresses never share a folder",
    )
    chunk_size: int = _opt(256, "Tokens per chunk")
    hash_algorithm: str = _opt("blake3", "Chunk hash: blake3, xxh3_128, sha256, sha256_cbor")
    hash_seed: str | None = _opt(
        None, "Hash seed (sha256_cbor needs the engine's PYTHONHASHSEED to match vLLM)"
    )
    arena_name: str | None = _opt(
        None, "Shared-memory segment name (default: derived from the first address)"
    )
    prefault: bool = _opt(True, "Touch every arena page at start so no store pays first-touch")
    session_ttl: float = _opt(600.0, "Seconds after its last use that a session expires")
    session_cleanup_interval: float = _opt(10.0, "Seconds between session expiry sweeps")
    pin_lease: float = _opt(
        60.0, "Seconds a lookup's pins survive without the request using them again"
    )
    staging_lease: float = _opt(30.0, "Seconds a store may hold uncommitted staging slots")
    client_timeout: float = _opt(
        10.0, "Seconds without a heartbeat after which a client's leases are reclaimed"
    )
    reap_interval: float = _opt(1.0, "Seconds between lease-reclaim sweeps")
    l2_queue_size: int = _opt(1024, "Chunks the L2 write-through queue holds")
    l2_queue_policy: str = _opt(
        "drop", "When the write-through queue is full: drop (and count) or block"
    )
    max_prefetch_jobs: int = _opt(
        8, "Lookups loading from L2 at once; more are answered from L1 alone (like LMCache)"
    )
    handler_threads: int = _opt(
        4, "Threads that handle requests with long prompts or inline bytes, off the I/O thread"
    )
    admin_host: str = _opt(
        "127.0.0.1", "Admin HTTP host; any non-loopback host requires --admin-token"
    )
    admin_port: int = _opt(8080, "Admin HTTP port (0 picks a free one; -1 disables the API)")
    admin_token: str | None = _opt(None, "Bearer token every admin endpoint then requires")
    log_level: str = _opt("info", "Log level: debug, info, warning, error")

    def __post_init__(self) -> None:
        self.l1_size = parse_size(self.l1_size)
        if self.l1_size <= 0:
            raise ValueError(f"--l1-size must be positive, got {self.l1_size}")
        if self.chunk_size <= 0:
            raise ValueError(f"--chunk-size must be positive, got {self.chunk_size}")
        if self.max_prefetch_jobs < 1:
            raise ValueError(f"--max-prefetch-jobs must be >= 1, got {self.max_prefetch_jobs}")
        if self.handler_threads < 1:
            raise ValueError(f"--handler-threads must be >= 1, got {self.handler_threads}")
        if not self.address:
            raise ValueError("at least one --address is required")
        if self.l2_queue_policy not in ("drop", "block"):
            raise ValueError(
                f"--l2-queue-policy must be 'drop' or 'block', got {self.l2_queue_policy!r}"
            )

    def l2_urls(self, arena_name: str) -> list[str]:
        """The L2 tier URLs to open, in order, with {arena} filled in ("none" means no L2)."""
        return [u.replace("{arena}", arena_name) for u in self.l2 if u and u.lower() != "none"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe view, with the admin token masked."""
        data = dataclasses.asdict(self)
        if data["admin_token"]:
            data["admin_token"] = "***"
        return data

    @staticmethod
    def env_var(name: str) -> str:
        return "KVTIER_" + name.upper()

    @classmethod
    def options(cls) -> list[dataclasses.Field[Any]]:
        return list(dataclasses.fields(cls))

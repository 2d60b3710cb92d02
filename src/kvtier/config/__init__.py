"""The server's configuration: one dataclass, the single source of truth for every option.

`kvtier serve`'s flags and the `KVTIER_*` environment variables are generated from the fields
below (name, default, help), so an option cannot exist in one place and not the other.

Its parts: `options` (`ServerOptions`: every option with its default, help and example, and
`ConfigError`), `checks` (what a valid configuration is), `server_config` (`ServerConfig`: the
options, checked), `admin` (the admin API's token file and loopback rule) and `sizes` (byte
sizes as people write them).
"""

from kvtier.config.admin import (
    ADMIN_TOKEN_ENV,
    MIN_ADMIN_TOKEN_CHARS,
    admin_token_file,
    is_loopback_host,
)
from kvtier.config.options import DEFAULT_L2, MIN_L1_SIZE, ConfigError
from kvtier.config.server_config import ServerConfig
from kvtier.config.sizes import format_size, parse_size

__all__ = [
    "ADMIN_TOKEN_ENV",
    "DEFAULT_L2",
    "MIN_ADMIN_TOKEN_CHARS",
    "MIN_L1_SIZE",
    "ConfigError",
    "ServerConfig",
    "admin_token_file",
    "format_size",
    "is_loopback_host",
    "parse_size",
]

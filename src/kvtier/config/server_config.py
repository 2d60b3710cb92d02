"""`ServerConfig`: the server's options, checked, with the views the server and CLI show."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvtier.config.checks import check
from kvtier.config.options import ServerOptions
from kvtier.redaction import redact


@dataclass
class ServerConfig(ServerOptions):
    """Every knob of `kvtier serve`, with its default; a wrong value raises ConfigError."""

    def __post_init__(self) -> None:
        check(self)

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

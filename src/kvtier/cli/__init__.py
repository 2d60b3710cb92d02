"""The `kvtier` command: `serve`, `demo` and `version` (`main`); `status` and `clear`, which
talk to a running server's admin API (`admin`)."""

from kvtier.cli.main import app, main

__all__ = ["app", "main"]

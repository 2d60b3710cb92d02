"""The `kvtier` command (`main`): `serve`, `status` and `clear` (which talk to a running
server's admin API, `admin`), `replay`, `demo` and `pd-proxy`; `kvtier --version`."""

from kvtier.cli.main import app, main

__all__ = ["app", "main"]

"""`kvtier status` and `kvtier clear`: operator commands that talk to a running server's admin API.

Plain functions with typer annotations; `kvtier.cli` registers them as commands. `app` is a small
typer app with just these two, for `python -m kvtier.cli.admin`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import urllib.parse
from typing import Annotated, Any, NoReturn

import httpx
import msgspec
import typer
from rich.console import Console
from rich.table import Table

from kvtier.config import ADMIN_TOKEN_ENV, ConfigError, admin_token_file
from kvtier.server.observe.snapshots import ServerStatus

TOKEN_ENV = ADMIN_TOKEN_ENV
DEFAULT_ADMIN = "http://127.0.0.1:8080"
TIMEOUT_S = 10.0

AdminOption = Annotated[
    str, typer.Option("--admin", help="Base URL of the server's admin API.", show_default=True)
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        help=f"Admin API bearer token (default: ${TOKEN_ENV}, else the token file the server "
        "wrote for its port on this machine).",
        show_default=False,
    ),
]


def _fail(message: str) -> NoReturn:
    print(f"kvtier: {message}", file=sys.stderr)
    raise typer.Exit(1)


def _request(
    method: str, admin: str, path: str, token: str | None, body: dict[str, Any] | None = None
) -> Any:
    """Call the admin API and return the decoded JSON; any failure exits with a one-line error."""
    token = token if token is not None else os.environ.get(TOKEN_ENV) or _token_from_file(admin)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = admin.rstrip("/") + path
    try:
        response = httpx.request(method, url, headers=headers, json=body, timeout=TIMEOUT_S)
    except httpx.InvalidURL as exc:
        _fail(f"bad --admin URL {admin!r}: {exc}")
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the kvtier admin API at {admin} ({type(exc).__name__}: {exc})")
    if response.status_code == 401:
        _fail(
            f"the admin API at {admin} refused {'the' if token else 'a request without a'} "
            f"token: pass --token or set {TOKEN_ENV} (or run this as the server's user)"
        )
    try:
        payload = response.json()
    except ValueError:
        _fail(f"{method} {url} answered HTTP {response.status_code} with a non-JSON body")
    if response.is_error:
        error = payload.get("error") if isinstance(payload, dict) else payload
        _fail(f"{method} {url} failed with HTTP {response.status_code}: {error}")
    return payload


def _token_from_file(admin: str) -> str | None:
    """The token a server on this machine wrote for the admin port of `admin`, if readable."""
    try:
        parts = urllib.parse.urlsplit(admin)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        return None
    try:
        return admin_token_file(port).read_text(encoding="utf-8").strip() or None
    except (OSError, ConfigError):
        return None


def status_command(
    admin: AdminOption = DEFAULT_ADMIN,
    token: TokenOption = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the raw /status JSON instead of tables.")
    ] = False,
) -> None:
    """Show a running server's status: L1, L2 tiers, sessions, clients, recent errors."""
    raw = _request("GET", admin, "/status", token)
    if json_output:
        print(json.dumps(raw, indent=2, sort_keys=True))
        return
    try:
        status = msgspec.convert(raw, ServerStatus)
    except msgspec.ValidationError as exc:
        _fail(f"the server at {admin} answered a /status this kvtier cannot read ({exc})")
    Console().print(*render_status(status))


def clear_command(
    admin: AdminOption = DEFAULT_ADMIN,
    token: TokenOption = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Clear only this model's chunks.")
    ] = None,
    cache_salt: Annotated[
        str | None, typer.Option("--cache-salt", help="Clear only chunks with this cache salt.")
    ] = None,
) -> None:
    """Drop cached chunks from L1 and L2 (all of them unless --model / --cache-salt narrow it)."""
    result = _request("POST", admin, "/clear", token, {"model": model, "cache_salt": cache_salt})
    print(f"cleared {result['cleared']} chunks")


def _bytes(n: float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _fill(used: float, capacity: float) -> str:
    if capacity <= 0:
        return f"{_bytes(used)} (unbounded)"
    return f"{_bytes(used)} / {_bytes(capacity)} ({100 * used / capacity:.1f}%)"


def _clock_time(when: Any) -> str:
    """Local HH:MM:SS of a wall-clock timestamp; other values as they are."""
    if isinstance(when, int | float):
        return datetime.datetime.fromtimestamp(when).strftime("%H:%M:%S")
    return str(when)


def render_status(status: ServerStatus) -> list[Table]:
    """The /status snapshot as rich tables, in the order an operator reads them."""
    lookup = status.lookup
    requested, hit = lookup.requested_tokens, lookup.hit_tokens
    overview = Table(title="kvtier server", show_header=False, title_justify="left")
    overview.add_column(style="bold")
    overview.add_column()
    overview.add_row("version", status.version)
    overview.add_row("uptime", f"{status.uptime_s:.0f} s")
    overview.add_row("ready", "yes" if status.ready else "[red]no[/red]")
    health = status.health if status.health == "ok" else f"[red]{status.health}[/red]"
    overview.add_row("health", "; ".join([health, *status.health_reasons]))
    overview.add_row("threads", "healthy" if status.threads_healthy else "[red]stalled[/red]")
    rate = f"{100 * hit / requested:.1f}%" if requested else "n/a"
    overview.add_row("lookup hit rate", f"{rate} ({hit:,} of {requested:,} tokens)")
    overview.add_row(
        "traffic",
        f"stored {_bytes(status.traffic.stored_bytes)}, "
        f"retrieved {_bytes(status.traffic.retrieved_bytes)}",
    )
    sessions = status.sessions
    overview.add_row(
        "sessions",
        f"{sessions.active} active, {sessions.created} created, "
        f"{sessions.expired} expired, {sessions.orphaned} orphaned",
    )

    l1 = status.l1
    l1_table = Table(title="L1 (shared memory)", show_header=False, title_justify="left")
    l1_table.add_column(style="bold")
    l1_table.add_column()
    l1_table.add_row("fill", _fill(l1.used_bytes, l1.capacity_bytes))
    l1_table.add_row("groups", f"{l1.groups} ({l1.ready_groups} ready)")
    l1_table.add_row("pinned groups", str(l1.pinned_groups))
    l1_table.add_row("staging shards", str(l1.staging_shards))
    l1_table.add_row("evictions", f"{l1.evictions} ({_bytes(l1.evicted_bytes)})")

    l2 = status.l2
    l2_table = Table(
        title=(
            f"L2 tiers: queue {l2.queue_depth}/{l2.queue_capacity} ({l2.policy}), "
            f"written {l2.written}, dropped {l2.dropped}, write errors {l2.write_errors}"
        ),
        title_justify="left",
    )
    columns = ("tier", "fill", "objects", "hits", "misses", "corrupt", "errors", "codec", "state")
    for column in columns:
        l2_table.add_column(column, justify="left" if column in ("tier", "fill") else "right")
    if not l2.tiers:
        l2_table.add_row("(none configured)", *([""] * (len(columns) - 1)))
    for tier in l2.tiers:
        l2_table.add_row(
            tier.name,
            _fill(tier.used_bytes, tier.capacity_bytes),
            *(str(v) for v in (tier.objects, tier.hits, tier.misses, tier.corrupt, tier.errors)),
            f"{tier.codec.name} {tier.codec.ratio:.2f}x",
            "[red]failing[/red]" if tier.name in l2.failing else "ok",
        )

    models = Table(title="Lookups per model", title_justify="left")
    for column in ("model", "lookups", "hit rate", "hit / requested tokens"):
        models.add_column(column)
    for m in status.models:
        share = f"{100 * m.hit_tokens / m.requested_tokens:.1f}%" if m.requested_tokens else "n/a"
        models.add_row(m.model, str(m.lookups), share, f"{m.hit_tokens:,} / {m.requested_tokens:,}")

    misses = Table(title="Why lookups missed (tokens since start)", title_justify="left")
    for column in ("reason", "tokens", "share of misses"):
        misses.add_column(column, justify="left" if column == "reason" else "right")
    missed = sum(miss.tokens for miss in status.misses)
    for miss in status.misses:
        reason = f"{miss.reason} ({miss.tier})" if miss.tier else miss.reason
        misses.add_row(reason, f"{miss.tokens:,}", f"{100 * miss.tokens / missed:.1f}%")
    loads = Table(title="L2 load speed (decides loading against recomputing)", title_justify="left")
    for column in ("tier", "throughput", "round trip"):
        loads.add_column(column, justify="left" if column == "tier" else "right")
    for load in status.load_rates:
        if load.bytes_per_s:
            loads.add_row(
                load.tier, f"{_bytes(load.bytes_per_s)}/s", f"{1e3 * load.latency_s:.3g} ms"
            )
        else:
            loads.add_row(load.tier, "not measured yet", "-")

    latency = Table(title="Request latency (server side)", title_justify="left")
    for column in ("operation", "requests", "mean", "p50 <=", "p99 <="):
        latency.add_column(column)
    for row in status.latency:
        latency.add_row(
            row.operation,
            f"{row.count:,}",
            *(f"{1e3 * v:.3g} ms" for v in (row.mean_s, row.p50_s, row.p99_s)),
        )

    clients = Table(title="Clients", title_justify="left")
    for column in ("client", "connected", "last seen", "registrations"):
        clients.add_column(column)
    for client in status.clients:
        registrations = ", ".join(
            f"{r.model} rank {r.worker_id}/{r.world_size} {r.dtype}{r.chunk_shape}"
            for r in client.registrations
        )
        clients.add_row(
            client.client_id,
            f"{client.connected_s:.0f} s",
            f"{client.last_seen_s:.1f} s ago",
            registrations or "-",
        )

    errors = Table(title="Recent errors (newest last)", title_justify="left")
    for column in ("time", "operation", "code", "message"):
        errors.add_column(column)
    for error in status.recent_errors[-10:]:
        errors.add_row(_clock_time(error.time), error.operation, error.code, error.message)
    speeds = [loads] if status.load_rates else []
    return [overview, l1_table, l2_table, models, misses, *speeds, latency, clients, errors]


app = typer.Typer(help="Operator commands for a running kvtier server.", no_args_is_help=True)
app.command("status")(status_command)
app.command("clear")(clear_command)

if __name__ == "__main__":
    app()

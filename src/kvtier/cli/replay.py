"""`kvtier replay TRACE.jsonl`: the hit rate a cache policy reaches on a recorded trace, beside
LRU, Belady's MIN and an infinite cache, for operators sizing a cache.

The trace (Mooncake's format, see `trace.py`) is replayed through a real kvtier server on the
real lookup and store path (`replayrun.py`): one the command starts (an L1 of `--l1-chunks`
chunks of 512 tokens, `--policy`, `--l2`), or the running one at `--address`. LRU that stores
everything is a second server run of its own with `--policy lru` (simulated when replaying
against `--address`); Belady's MIN and the infinite cache are computed from the trace
(`tracesim.py`).

Hit rates: of blocks, the hit blocks over all the requests' blocks; of tokens, each request's
hit blocks times 512 tokens (at most its `input_length`: a prompt's last block is partial) over
all input tokens.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kvtier.cli import tracesim
from kvtier.cli.policycost import policy_time
from kvtier.cli.replayrun import CHUNK_BYTES, Run, Server, private_server, read_status, replay
from kvtier.cli.trace import BLOCK_TOKENS, TraceError, TraceRequest, read
from kvtier.config import ADMIN_TOKEN_ENV, MIN_L1_SIZE
from kvtier.storage.admission import POLICIES

__all__ = ["hit_rates", "replay_command"]

#: The L1 a started server gets when --l1-chunks is not given: this share of the trace's
#: distinct blocks.
DEFAULT_SHARE = 0.1


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"kvtier replay: {message}", err=True)
    raise typer.Exit(code)


def hit_rates(requests: Sequence[TraceRequest], hits: Sequence[int]) -> dict[str, Any]:
    """The hit rates of these per-request hit blocks (see the module's text), and the counts."""
    blocks = sum(len(r.hash_ids) for r in requests)
    tokens = sum(r.input_length for r in requests)
    hit_tokens = sum(
        min(hit * BLOCK_TOKENS, r.input_length) for r, hit in zip(requests, hits, strict=True)
    )
    return {
        "block_hit_rate": sum(hits) / blocks if blocks else 0.0,
        "token_hit_rate": hit_tokens / tokens if tokens else 0.0,
        "hit_blocks": sum(hits),
        "hit_tokens": hit_tokens,
    }


def _server_figures(requests: Sequence[TraceRequest], name: str, run: Run) -> dict[str, Any]:
    n = max(1, len(requests))
    figures: dict[str, Any] = {"name": name, "source": "server", **hit_rates(requests, run.hits)}
    figures |= {
        "seconds": run.seconds,
        "lookup_ms": 1e3 * run.lookup_s / n,
        "store_ms": 1e3 * run.store_s / n,
        "store_errors": run.store_errors,
    }
    if run.counters is not None:
        figures |= asdict(run.counters)
    return figures


def _progress(console: Console, what: str) -> Progress:
    return Progress(
        TextColumn(what),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def _replay(
    console: Console, server: Server, requests: Sequence[TraceRequest], what: str, token: str
) -> Run:
    with _progress(console, what) as bar:
        task = bar.add_task(what, total=len(requests))
        return replay(
            server,
            requests,
            token=token,
            admin_token=os.environ.get(ADMIN_TOKEN_ENV) or None,
            progress=lambda done: bar.update(task, completed=done),
        )


def _running_server(address: str, admin: str | None) -> tuple[int | None, str | None]:
    """The L1 capacity in replay chunks and the policy of the server at `address`, from its
    admin API (None for each when there is none)."""
    if admin is None:
        return None, None
    try:
        status = read_status(admin, os.environ.get(ADMIN_TOKEN_ENV) or None)
    except RuntimeError as exc:
        _fail(str(exc), 1)
    return int(status["l1"]["capacity_bytes"]) // CHUNK_BYTES, status["config"].get("policy")


def replay_command(
    trace: Annotated[Path, typer.Argument(help="A Mooncake-format trace (JSON lines).")],
    l1_chunks: Annotated[
        int | None,
        typer.Option(
            "--l1-chunks",
            help="L1 capacity in 512-token chunks (default: 10% of the trace's distinct blocks).",
            metavar="N",
            show_default=False,
        ),
    ] = None,
    l2: Annotated[
        list[str] | None,
        typer.Option(
            "--l2",
            help="An L2 tier URL for the started server (repeatable; default none).",
            metavar="URL",
            show_default=False,
        ),
    ] = None,
    policy: Annotated[
        str, typer.Option("--policy", help=f"Cache policy: {', '.join(POLICIES)}.", metavar="NAME")
    ] = "adaptive",
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit", help="Replay only the first N requests.", metavar="N", show_default=False
        ),
    ] = None,
    json_file: Annotated[
        Path | None,
        typer.Option(
            "--json",
            help="Also write the figures to FILE as one JSON object.",
            metavar="FILE",
            show_default=False,
        ),
    ] = None,
    address: Annotated[
        str | None,
        typer.Option(
            "--address",
            help="Replay through this running server instead of starting "
            "one (its chunk size must be 512).",
            metavar="URL",
            show_default=False,
        ),
    ] = None,
    admin: Annotated[
        str | None,
        typer.Option(
            "--admin",
            help="With --address: the server's admin API, for its L1 size, policy and counters.",
            metavar="URL",
            show_default=False,
        ),
    ] = None,
    token: Annotated[
        str,
        typer.Option(
            "--token",
            help="With --address: a client credential, when the server has --auth-tokens-file.",
            show_default=False,
        ),
    ] = "",
) -> None:
    """Replay a trace through a real server: hit rates of the policy, LRU, Belady and infinite."""
    if policy not in POLICIES:
        _fail(f"--policy: unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if limit is not None and limit < 1:
        _fail(f"--limit: must be at least 1, got {limit} (e.g. --limit 2000)")
    try:
        requests = read(trace, limit)
    except TraceError as exc:
        _fail(str(exc))
    if not requests:
        _fail(f"{trace} holds no request")
    chains = [r.hash_ids for r in requests]
    distinct = len({block for chain in chains for block in chain})
    longest = max(len(chain) for chain in chains)
    if address is not None:
        found, running_policy = _running_server(address, admin)
        l1_chunks = l1_chunks or found
        policy = running_policy or policy
        if l1_chunks is None:
            _fail(
                "with --address, give --l1-chunks (the server's L1 in 512-token chunks) or "
                "--admin (its admin API tells)"
            )
    elif l1_chunks is None:
        l1_chunks = max(longest, MIN_L1_SIZE // CHUNK_BYTES, int(DEFAULT_SHARE * distinct))
    least = max(longest, MIN_L1_SIZE // CHUNK_BYTES)
    if address is None and l1_chunks < least:
        _fail(
            f"--l1-chunks: {l1_chunks} cannot hold the trace's longest prompt and the "
            f"smallest L1; give at least {least} (e.g. --l1-chunks {least})"
        )
    console = Console(stderr=False)
    share = l1_chunks / distinct
    console.print(
        f"kvtier replay: {len(requests):,} requests of {trace.name} "
        f"({sum(map(len, chains)):,} blocks of {BLOCK_TOKENS} tokens, {distinct:,} distinct); "
        f"L1 of {l1_chunks:,} chunks ({share:.1%} of the distinct blocks), policy {policy}"
    )
    figures = _run(console, requests, l1_chunks, policy, l2 or [], address, admin, token)
    report = {
        "trace": str(trace),
        "requests": len(requests),
        "blocks": sum(map(len, chains)),
        "distinct_blocks": distinct,
        "input_tokens": sum(r.input_length for r in requests),
        "capacity_chunks": l1_chunks,
        "chunk_tokens": BLOCK_TOKENS,
        "chunk_bytes": CHUNK_BYTES,
        "l2": [] if address else list(l2 or []),
        **figures,
    }
    _print(console, report)
    if json_file is not None:
        try:
            json_file.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            _fail(f"--json: cannot write {json_file}: {exc.strerror or exc}", 1)


def _run(
    console: Console,
    requests: Sequence[TraceRequest],
    l1_chunks: int,
    policy: str,
    l2: list[str],
    address: str | None,
    admin: str | None,
    token: str,
) -> dict[str, Any]:
    """The figures of the policy, LRU, Belady and the infinite cache."""
    chains = [r.hash_ids for r in requests]
    try:
        if address is not None:
            run = _replay(console, Server(address, admin), requests, f"{policy}", token)
            lru: dict[str, Any] = {"name": "lru", "source": "simulation"}
            lru |= hit_rates(requests, tracesim.lru(chains, l1_chunks))
        else:
            with private_server(l1_chunks, policy, l2) as server:
                run = _replay(console, server, requests, policy, token)
            if policy == "lru":
                lru = _server_figures(requests, "lru", run)
            else:
                with private_server(l1_chunks, "lru", l2) as server:
                    lru = _server_figures(
                        requests, "lru", _replay(console, server, requests, "lru", token)
                    )
    except (RuntimeError, OSError) as exc:
        _fail(str(exc), 1)
    mine = _server_figures(requests, policy, run)
    cost: dict[str, float] = policy_time(requests, policy, l1_chunks)
    if lru["source"] == "server":
        cost |= {
            "lookup_ms_added": mine["lookup_ms"] - lru["lookup_ms"],
            "store_ms_added": mine["store_ms"] - lru["store_ms"],
            "lookup_added_fraction": mine["lookup_ms"] / lru["lookup_ms"] - 1,
            "store_added_fraction": mine["store_ms"] / lru["store_ms"] - 1,
        }
    belady: dict[str, Any] = {"name": "belady", "source": "simulation"}
    belady |= hit_rates(requests, tracesim.belady(chains, l1_chunks))
    infinite: dict[str, Any] = {"name": "infinite", "source": "simulation"}
    infinite |= hit_rates(requests, tracesim.infinite(chains))
    return {"policy": mine, "lru": lru, "belady": belady, "infinite": infinite,
            "policy_cost": cost}  # fmt: skip


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _print(console: Console, report: dict[str, Any]) -> None:
    rates = Table(title="hit rates", title_justify="left")
    for column in ("cache", "how", "blocks hit", "tokens hit", "hit blocks"):
        rates.add_column(column, justify="left" if column in ("cache", "how") else "right")
    for role in ("policy", "lru", "belady", "infinite"):
        f = report[role]
        how = "server" if f["source"] == "server" else "computed"
        label = f["name"] if role != "policy" else f"{f['name']} (the policy)"
        rates.add_row(label, how, f"{f['block_hit_rate']:.1%}", f"{f['token_hit_rate']:.1%}",
                      f"{f['hit_blocks']:,}")  # fmt: skip
    console.print(rates)
    runs = [report[r] for r in ("policy", "lru") if report[r]["source"] == "server"]
    if report["policy"]["name"] == "lru":
        runs = runs[:1]
    server = Table(title="server runs", title_justify="left")
    server.add_column("")
    for f in runs:
        server.add_column(f["name"], justify="right")
    rows: list[tuple[str, str]] = [
        ("lookup, per request", "lookup_ms"),
        ("store, per request", "store_ms"),
        ("L1 stored", "l1_stored_bytes"),
        ("L1 evictions", "l1_evictions"),
        ("  of chunks not admitted", "l1_declined_evictions"),
        ("store errors", "store_errors"),
    ]
    for label, key in rows:
        if key not in runs[0]:
            continue
        cells = []
        for f in runs:
            value = f[key]
            cells.append(f"{value:.3f} ms" if key.endswith("_ms") else
                         _mib(value) if key.endswith("bytes") else f"{value:,}")  # fmt: skip
        server.add_row(label, *cells)
    for tier in runs[0].get("l2_written_bytes", {}):
        written = [_mib(f.get("l2_written_bytes", {}).get(tier, 0)) for f in runs]
        server.add_row(f"L2 {tier} written", *written)
    console.print(server)
    cost = report["policy_cost"]
    console.print(
        f"policy cost: {report['policy']['name']} itself takes {cost['observe_us_per_lookup']:.1f}"
        f" us per lookup and {cost['decide_us_per_store']:.1f} us per store (timed in-process)"
    )
    if "lookup_ms_added" in cost and report["policy"]["name"] != "lru":
        console.print(
            f"against the lru run, per request: lookup {1e3 * cost['lookup_ms_added']:+.0f} us "
            f"({cost['lookup_added_fraction']:+.1%}), store {1e3 * cost['store_ms_added']:+.0f}"
            f" us ({cost['store_added_fraction']:+.1%}) (hits differ too: more hits, less to store)"
        )
    sys.stdout.flush()

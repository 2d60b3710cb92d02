"""The `kvtier` command: serve, status, clear, replay, demo, pd-proxy.

`serve`'s options are generated from ServerConfig's fields, so every option has exactly one
definition (name, type, default, help, example) and a matching KVTIER_* environment variable.
A configuration mistake is one line on stderr naming the option with a valid example, exit
code 2, never a traceback.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
import typing
from pathlib import Path
from typing import Any

import typer
import typer.main

from kvtier._version import __version__
from kvtier.cli.admin import clear_command, status_command
from kvtier.cli.replay import replay_command
from kvtier.config import ConfigError, ServerConfig, format_size
from kvtier.errors import KVTierError
from kvtier.redaction import redact

#: exit code of a usage or configuration mistake (as click, and POSIX utilities, use it)
EXIT_USAGE = 2

app = typer.Typer(
    name="kvtier",
    help="kvtier: a KV-cache server for LLM inference engines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvtier {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print kvtier's version and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    """kvtier: a KV-cache server for LLM inference engines."""


def _fail(command: str, message: str, code: int) -> typing.NoReturn:
    typer.echo(f"kvtier {command}: {message}", err=True)
    raise typer.Exit(code)


def _serve(**options: Any) -> None:
    """Run the kvtier server in the foreground (Ctrl-C stops it cleanly)."""
    try:
        config = ServerConfig(**options)
    except ConfigError as exc:
        _fail("serve", str(exc), EXIT_USAGE)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from kvtier.server.app import KVTierServer, StartInterrupted, interrupt_start

    # From here until run() takes the signals over, SIGINT/SIGTERM unwind the start-up so that
    # nothing it made (a half-sized segment in /dev/shm, a started tier) is left behind.
    interrupt_start()
    try:
        server = KVTierServer(config)
    except StartInterrupted as exc:
        _stopped_at_start(exc)
    except (ConfigError, KVTierError, ValueError) as exc:
        _fail("serve", redact(str(exc)), EXIT_USAGE)
    except OSError as exc:  # anything the start-up checks did not name: still one line
        where = f"{exc.filename}: " if exc.filename else ""
        _fail("serve", redact(f"{where}{exc.strerror or exc}"), EXIT_USAGE)
    try:
        server.run()
    except StartInterrupted as exc:  # the signal came before run() took the signals over
        server.close()
        _stopped_at_start(exc)


def _stopped_at_start(exc: BaseException) -> typing.NoReturn:
    typer.echo(f"kvtier serve: stopped by {exc} during start-up", err=True)
    raise typer.Exit(0)


def _serve_signature() -> inspect.Signature:
    hints = typing.get_type_hints(ServerConfig)
    params = []
    for f in dataclasses.fields(ServerConfig):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc,operator]
        annotation = hints[f.name]
        if f.metadata.get("kind") == "size":
            annotation, default = str, format_size(default)
        option = typer.Option(
            default,
            envvar=ServerConfig.env_var(f.name),
            help=f.metadata["help"],
            show_default=True,
            metavar=f.metadata.get("metavar") or ("" if annotation is bool else None),
        )
        params.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
            )
        )
    return inspect.Signature(params)


_serve.__signature__ = _serve_signature()  # type: ignore[attr-defined]
app.command("serve")(_serve)


app.command("status")(status_command)
app.command("clear")(clear_command)
app.command("replay")(replay_command)


@app.command()
def demo(
    address: str | None = typer.Option(
        None, help="Use this running server instead of starting one", metavar="URL"
    ),
    output_dir: Path = typer.Option(
        Path("kvtier-demo"), help="Where the plot is written", metavar="DIR"
    ),
    quick: bool = typer.Option(
        False, help="A small, fast run (smoke test): a tiny model, so speedups stay near 1x"
    ),
    repeats: int = typer.Option(
        5, help="Runs of each point; the table shows their median and spread", metavar="N"
    ),
) -> None:
    """Prove TTFT savings with a real transformers model (needs the transformers extra)."""
    if repeats < 1:
        _fail("demo", f"--repeats: must be at least 1, got {repeats} (e.g. --repeats 5)", 2)
    try:
        from kvtier.integrations.demo import run_demo
    except ImportError as exc:  # the message says which extra (kvtier is not on an index)
        hint = "install the transformers extra: pip install '.[transformers]' in the kvtier clone"
        _fail("demo", str(exc) if "transformers extra" in str(exc) else f"{hint} ({exc})", 1)
    path = run_demo(address, output_dir, quick=quick, repeats=repeats)
    typer.echo(f"plot: {path}")


@app.command("pd-proxy")
def pd_proxy(
    prefill: list[str] = typer.Option(
        ...,
        help="A prefill instance (vLLM, kv_role kv_producer); repeat or comma-separate for more",
        metavar="URL",
    ),
    decode: list[str] = typer.Option(
        ...,
        help="A decode instance (vLLM, kv_role kv_consumer); repeat or comma-separate for more",
        metavar="URL",
    ),
    port: int = typer.Option(8000, help="The port to serve the OpenAI API on", metavar="N"),
    host: str = typer.Option("127.0.0.1", help="The address to listen on", metavar="HOST"),
) -> None:
    """An OpenAI-compatible front for prefill/decode disaggregation through kvtier."""
    from kvtier.integrations.pdproxy import serve

    prefill = [u for given in prefill for u in given.split(",") if u]
    decode = [u for given in decode for u in given.split(",") if u]
    for url in [*prefill, *decode]:
        if not url.startswith(("http://", "https://")):
            _fail("pd-proxy", f"{url!r} is not an http:// or https:// URL", 2)
    typer.echo(f"kvtier pd-proxy: http://{host}:{port} (prefill {prefill}, decode {decode})")
    serve(prefill, decode, host=host, port=port)


def _usage_hint(exc: Exception) -> str:
    """The config example of the option a usage error names, if it is a serve option."""
    name = getattr(getattr(exc, "param", None), "name", None)
    if not name:
        return ""
    try:
        example = ServerConfig.field(name).metadata.get("example", "")
    except KeyError:
        return ""
    return f" (e.g. {example})" if example else ""


def main(argv: list[str] | None = None) -> None:
    """Entry point: usage errors become one line and exit code 2.

    Click's exceptions are matched by shape (`format_message`, `exit_code`): typer vendors its
    own copy of click from 0.29 on, so they are not `click.ClickException` there.
    """
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="kvtier", standalone_mode=False)
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.Abort:
        code = 130
    except Exception as exc:
        if not hasattr(exc, "format_message"):
            raise
        ctx = getattr(exc, "ctx", None)
        sub = ctx.info_name if ctx is not None and ctx.parent is not None else ""
        message = str(exc.format_message()).replace("\n", " ")
        if message.strip():
            typer.echo(f"{f'kvtier {sub}'.rstrip()}: {message}{_usage_hint(exc)}", err=True)
        code = getattr(exc, "exit_code", EXIT_USAGE)
    if isinstance(code, int):
        sys.exit(code)

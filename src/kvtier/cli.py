"""The `kvtier` command: serve, status, clear, demo.

`serve`'s options are generated from ServerConfig's fields, so every option has exactly one
definition (name, type, default, help) and a matching KVTIER_* environment variable.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import typing
from pathlib import Path
from typing import Any

import typer

from kvtier.cli_admin import clear_command, status_command
from kvtier.config import ServerConfig, format_size

app = typer.Typer(
    name="kvtier",
    help="kvtier: a KV-cache server for LLM inference engines.",
    no_args_is_help=True,
    add_completion=False,
)


def _serve(**options: Any) -> None:
    """Run the kvtier server in the foreground (Ctrl-C stops it cleanly)."""
    from kvtier.server.app import KVTierServer

    config = ServerConfig(**options)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        server = KVTierServer(config)
    except (OSError, ValueError) as exc:
        from kvtier.server.auth import redact

        typer.echo(f"kvtier serve: {redact(str(exc))}", err=True)
        raise typer.Exit(1) from exc
    server.run()


def _serve_signature() -> inspect.Signature:
    hints = typing.get_type_hints(ServerConfig)
    params = []
    for f in dataclasses.fields(ServerConfig):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc,operator]
        annotation = hints[f.name]
        if f.metadata.get("kind") == "size":
            annotation, default = str, format_size(default)
        option = typer.Option(
            default, envvar=ServerConfig.env_var(f.name), help=f.metadata["help"], show_default=True
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


@app.command()
def demo(
    address: str | None = typer.Option(
        None, help="Use this running server instead of starting one"
    ),
    output_dir: Path = typer.Option(Path("kvtier-demo"), help="Where the plot is written"),
    quick: bool = typer.Option(False, help="A small, fast run (smoke test)"),
) -> None:
    """Prove TTFT savings with a real transformers model (needs the transformers extra)."""
    try:
        from kvtier.integrations.demo import run_demo
    except ImportError as exc:
        typer.echo(
            f"kvtier demo needs torch and transformers: pip install 'kvtier[transformers]' ({exc})",
            err=True,
        )
        raise typer.Exit(1) from exc
    path = run_demo(address, output_dir, quick=quick)
    typer.echo(f"plot: {path}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()

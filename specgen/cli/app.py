"""The `specgen` command line: the Typer app and its commands (one module each), the entry point.

Commands map options onto settings objects and call one function; they import torch only once
they run, so `--help` is instant and a run on a server imports none.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Annotated

import typer

from specgen import __version__, files
from specgen.cli.bench import bench_app
from specgen.cli.chat import chat
from specgen.cli.check import check
from specgen.cli.models import models_app
from specgen.cli.run import run
from specgen.cli.serve import serve
from specgen.cli.train_head import train_head


def _flags_show_no_type() -> None:
    """A flag takes no value, so its help line shows none: typer 0.29 prints every option's type,
    `--version <bool>` and `--help <bool>` included, as if each flag took a boolean argument."""
    from typer.core import TyperOption  # once, at import: the class every flag is built with

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "flags_show_no_type", False):  # another typer, or done
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag and not self.count else shown(self, ctx)

    display_type_rich.flags_show_no_type = True
    TyperOption.display_type_rich = display_type_rich


def _help_paragraphs_reflow() -> None:
    """A command's help wraps its later paragraphs to the terminal: typer 0.29 joins the lines of
    a help text's first paragraph but keeps the source line breaks of the others, so a docstring
    wrapped at this code's 110 columns printed ragged in an 80-column terminal. A paragraph that
    starts with click's `\\b` keeps its lines as written."""
    from typer import rich_utils  # once, at import: the module whose helper joins the paragraphs

    joined = getattr(rich_utils, "_fix_linebreaks", None)
    if joined is None or getattr(joined, "reflows", False):  # another typer, or done
        return

    def _fix_linebreaks(paragraphs, markup_mode):
        if markup_mode == "markdown":  # markdown joins a paragraph's lines itself
            return joined(paragraphs, markup_mode)
        return "\n\n".join(p if p.startswith("\b") else p.replace("\n", " ") for p in paragraphs)

    _fix_linebreaks.reflows = True
    rich_utils._fix_linebreaks = _fix_linebreaks


_flags_show_no_type()
_help_paragraphs_reflow()
app = typer.Typer(
    help="Speculative decoding for language models, shown round by round.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"specgen {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """Speculative decoding for language models, shown round by round."""


app.command()(run)
app.command()(chat)
app.command()(serve)
app.command()(check)
app.command("train-head")(train_head)
app.add_typer(bench_app, name="bench")  # per prompt; its commands `bench batch` and `bench serve`
app.add_typer(models_app, name="models", help="The offline model catalog: list, pull, path, verify, rm.")


def main() -> None:
    """The `specgen` command. It ends with `os._exit` once its output is flushed: Python's own
    teardown of a loaded pair (thousands of modules, packed weights and tensors, gigabytes)
    takes a second or more of every run and does nothing a finished command needs (every file
    specgen writes is closed, or renamed into place, before this).

    A standard stream closed by the caller (`>&-`) is None in Python: a closed stdout is refused
    at once (the answer would be lost), a closed stdin reads as empty and a closed stderr takes
    the notes nowhere."""
    if sys.stdin is None:
        sys.stdin = open(os.devnull, encoding="utf-8")
    if sys.stderr is None or not _writable(2):  # closed, or its number taken by a file read-only (a shim's)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)  # child processes (the int8 builders) inherit it
        os.close(null)
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False)
    if sys.stdout is None or not _writable(1):
        print(
            "error: stdout is closed, and specgen writes its answers there; redirect it to a file or "
            "/dev/null",
            file=sys.stderr,
        )
        sys.stderr.flush()
        os._exit(1)
    try:
        app()
        status = 0
    except SystemExit as exc:
        status = exit_status(exc.code)
    files.run_exit_hooks()  # what must outlive the command (a suffix memory's file)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or stream: nothing left to say
            pass
    os._exit(status)


def _writable(fd: int) -> bool:
    """Is `fd` open for writing? (A full device says ENOSPC even to an empty write: it is open.)"""
    try:
        os.write(fd, b"")
        return True
    except OSError as exc:
        return exc.errno != errno.EBADF


def exit_status(code) -> int:
    """SystemExit's code as a process status: None is 0, an int is itself, text is printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except (OSError, ValueError):
        pass
    return 1

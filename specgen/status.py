"""One-line messages on stderr: a spinner while a slow step runs on a terminal (a plain line
when stderr is piped or logged), notes, and the one-line error. Every layer uses them."""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console
from rich.markup import escape


@contextlib.contextmanager
def status(message: str, quiet: bool):
    """While a slow step runs: a spinner on a terminal, else `message` as one line on stderr."""
    if quiet:
        yield
        return
    # bound to the real stream now: a step that silences transformers swaps `sys.stderr` meanwhile
    console = Console(emoji=False, file=sys.stderr)
    if not console.is_terminal:  # piped or logged: a spinner would print nothing at all
        note(message)
        yield
        return
    with console.status(escape(message)):
        yield


def note(text: str) -> None:
    """One line on stderr, never a failure (a closed stream is ignored)."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def error_line(message: str, hint: str | None = None) -> None:
    """A known failure as one red line on stderr, its hint dimmed in brackets."""
    console = Console(emoji=False, stderr=True, highlight=False, soft_wrap=True)
    # user text (paths, hints like `pip install 'specgen[plot]'`) must not be read as Rich markup
    console.print(
        f"[bold red]error:[/] {escape(message)}" + (f" [dim]({escape(hint)})[/]" if hint else ""), markup=True
    )

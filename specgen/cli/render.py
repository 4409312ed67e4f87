"""Showing a generation: a Rich live view, plain streamed text, or one JSON object.

Renderers see text pieces (decoding/views.py) and statistics only, never tensors or token ids.
"""

from __future__ import annotations

import json
import sys

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from specgen.decoding.stats import Stats
from specgen.decoding.views import Outcome, ReplayView, RoundView, TreeView, summary_line

ACCEPTED = "green"
REJECTED = "red strike"
TARGET = "bold cyan"
PROMPT = "dim"


PENDING = "dim"


def rich_tree(view: TreeView, title: str) -> Tree:
    """A tree round as a Rich tree: accepted nodes green, tried ones struck through in red."""
    nodes = [Tree(Text(title + " ", style="bold") + Text(repr(view.texts[0]), style=PROMPT))]
    for i in range(1, len(view.texts)):
        style = ACCEPTED if i in view.accepted else REJECTED if i in view.tried else "dim"
        nodes.append(nodes[view.parents[i]].add(Text(repr(view.texts[i]), style=style)))
    return nodes[0]


def footer(stats: Stats) -> Text:
    line = Text()
    line.append(f"round {stats.rounds}", style="bold")
    if stats.drafted:
        line.append(f" · accepted {stats.accepted}/{stats.drafted} ({stats.acceptance_rate:.0%})")
    line.append(f" · {stats.tokens_per_target_forward:.2f} tokens/target forward")
    line.append(f" · {stats.tokens_per_second:.1f} tok/s")
    line.append("   ")
    line.append("accepted", style=ACCEPTED)
    line.append(" ")
    line.append("rejected", style=REJECTED)
    line.append(" ")
    line.append("target", style=TARGET)
    return line


def summary_table(stats: Stats, title: str = "summary") -> Table:
    table = Table(title=title, title_justify="left", show_header=True, header_style="bold")
    for name in ("method", "tokens", "rounds", "accepted", "tok/fwd", "tok/s",
                 "prefill s", "draft s", "verify s"):
        table.add_column(name, justify="right" if name != "method" else "left")
    table.add_row(stats.method, str(stats.new_tokens), str(stats.rounds),
                  f"{stats.acceptance_rate:.1%}" if stats.drafted else "-",
                  f"{stats.tokens_per_target_forward:.2f}", f"{stats.tokens_per_second:.1f}",
                  f"{stats.prefill_seconds:.2f}", f"{stats.draft_seconds:.2f}", f"{stats.verify_seconds:.2f}")
    return table


class RichRenderer:
    """A Live view that grows the answer round by round, then a summary table."""

    def __init__(self, console: Console | None = None, header: str | None = None, show_tree: bool = False):
        self.console = console or Console(emoji=False)
        self.header = header
        self.show_tree = show_tree
        self.text = Text()
        self.rejected = Text()
        self.pending: list[tuple[str, str]] = []  # (text, final style) awaiting a replay
        self._live: Live | None = None
        self._stats: Stats | None = None

    def __enter__(self) -> "RichRenderer":
        self._live = Live(self._view(), console=self.console, refresh_per_second=10,
                          transient=False, auto_refresh=False)
        self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.rejected = Text()  # rejected tokens belong to their round only
        if self._live is not None:
            self._live.update(self._view(), refresh=True)
            self._live.__exit__(*exc)
            self._live = None

    def on_round(self, view: RoundView, stats: Stats) -> None:
        # a piece per emitted token (empty ones too): a replay's rollback counts tokens
        pieces = [(piece, ACCEPTED) for piece in view.accepted] + ([(view.target, TARGET)] if view.target_emitted
                                                                    else [])
        if view.pending:
            self.pending.extend(pieces)
        else:
            for piece, style in pieces:
                self.text.append(piece, style=style)
        self.rejected = Text("".join(view.rejected), style=REJECTED)
        self._stats = stats
        if self.show_tree and view.tree is not None:
            self.console.print(rich_tree(view.tree, f"round {stats.rounds}"))  # above the live view
        if self._live is not None:
            self._live.update(self._view(), refresh=True)

    def on_replay(self, view: ReplayView, stats: Stats) -> None:
        """Verified pending tokens take their colours; rolled-back ones show red this round."""
        keep = len(self.pending) - len(view.rolled_back)
        for piece, style in self.pending[:keep]:
            self.text.append(piece, style=style)
        if view.correction is not None:
            self.text.append(view.correction, style=TARGET)
        self.rejected = Text("".join(view.rolled_back), style=REJECTED)
        self.pending = []
        self._stats = stats
        if self._live is not None:
            self._live.update(self._view(), refresh=True)

    def finish(self, outcome: Outcome) -> None:
        if outcome.interrupted:
            self.console.print(Text("interrupted", style="yellow"))
        self.console.print(summary_table(outcome.stats))

    def _view(self) -> Group:
        parts = []
        if self.header:
            parts.append(Text(self.header, style=PROMPT))
        pending = Text("".join(piece for piece, _ in self.pending), style=PENDING)
        parts.append(self.text + pending + self.rejected)
        if self._stats is not None:
            parts.append(footer(self._stats))
        return Group(*parts)


class PlainRenderer:
    """Generated text streamed to stdout, statistics to stderr."""

    def __init__(self, out=None, err=None, show_tree: bool = False):
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.show_tree = show_tree
        self._pending: list[str] = []
        self._written: list[str] = []

    def __enter__(self) -> "PlainRenderer":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def on_round(self, view: RoundView, stats: Stats) -> None:
        if self.show_tree and view.tree is not None:
            Console(emoji=False, file=self.err, highlight=False).print(rich_tree(view.tree, f"round {stats.rounds}"))
        if view.pending:  # only verified text is printed; a piece per token, as a rollback counts them
            self._pending.extend(view.pieces)
            return
        self._write("".join(view.pieces))

    def on_replay(self, view: ReplayView, stats: Stats) -> None:
        keep = len(self._pending) - len(view.rolled_back)
        self._write("".join(self._pending[:keep]) + (view.correction or ""))
        self._pending = []

    def _write(self, text: str) -> None:
        if text:
            self._written.append(text)
            self.out.write(text)
            self.out.flush()

    def finish(self, outcome: Outcome) -> None:
        # The stream holds back a character whose bytes are not all there yet; at the end the
        # final text (as JSON has it, U+FFFD for a cut character) says what is left to print.
        written = "".join(self._written)
        if outcome.text.startswith(written):
            self._write(outcome.text[len(written):])
        self.out.write("\n")
        self.out.flush()
        self.err.write(summary_line(outcome) + "\n")


class JsonRenderer:
    """One JSON object on stdout when the generation ends (or is interrupted)."""

    def __init__(self, out=None):
        self.out = out or sys.stdout

    def __enter__(self) -> "JsonRenderer":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def on_round(self, view: RoundView, stats: Stats) -> None:
        pass

    def on_replay(self, view: ReplayView, stats: Stats) -> None:
        pass

    def finish(self, outcome: Outcome) -> None:
        record = {"text": outcome.text, "token_ids": outcome.token_ids, "method": outcome.stats.method,
                  **outcome.extra, "interrupted": outcome.interrupted, "stats": outcome.stats.as_dict()}
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()

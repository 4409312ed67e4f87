"""Showing a generation: a Rich live view, plain streamed text, or one JSON object.

Renderers read a round's text (its pieces, given by decoding/views.py) and the statistics, never
tensors; a round's ids are there for them to read, as a client of the server gets them too.
"""

from __future__ import annotations

import json
import re
import sys

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from specgen.decoding.events import Origin, ReplayResult, RoundResult
from specgen.decoding.stats import Stats
from specgen.decoding.views import Outcome, declined_note, speed, summary_line

ACCEPTED = "green"
RECALLED = "green underline"  # accepted tokens the suffix memory drafted (earlier requests' text)
REJECTED = "red strike"
TARGET = "bold cyan"
PROMPT = "dim"


PENDING = "dim"
SUMMARY_WIDTH = 100  # narrower terminals get the summary as one line: the table's cells were blank there
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """Text for a terminal: control characters other than newline and tab shown as escapes
    (`\x1b`), so what a model writes can move no cursor and set no title or mode there."""
    return _CONTROL.sub(lambda hit: f"\\x{ord(hit.group()):02x}", text)


def rich_tree(result: RoundResult, title: str) -> Tree:
    """A tree round as a Rich tree: accepted nodes green, tried ones struck through in red."""
    texts = result.node_texts
    nodes = [Tree(Text(title + " ", style="bold") + Text(repr(texts[0]), style=PROMPT))]
    for i, parent in enumerate(result.parents, 1):
        style = ACCEPTED if i in result.path else REJECTED if i in result.tried else "dim"
        nodes.append(nodes[parent].add(Text(repr(texts[i]), style=style)))
    return nodes[0]


def footer(stats: Stats) -> Text:
    line = Text()
    line.append(f"round {stats.rounds}", style="bold")
    if stats.drafted:
        line.append(f" · accepted {stats.accepted}/{stats.drafted} ({stats.acceptance_rate:.0%})")
    line.append(f" · {stats.tokens_per_target_forward:.2f} tokens/target forward")
    line.append(f" · {speed(stats)}")
    line.append("   ")
    line.append("accepted", style=ACCEPTED)
    if stats.accepted_by_origin.get(Origin.MEMORY.value):
        line.append(" ")
        line.append("from memory", style=RECALLED)
    line.append(" ")
    line.append("rejected", style=REJECTED)
    line.append(" ")
    line.append("target", style=TARGET)
    return line


def summary_table(stats: Stats, title: str = "summary") -> Table:
    table = Table(
        title=title,
        title_justify="left",
        show_header=True,
        header_style="bold",
        caption=declined_note(stats) or None,
        caption_justify="left",
    )
    for name in (
        "method",
        "tokens",
        "rounds",
        "accepted",
        "tok/fwd",
        "tok/s",
        "prefill s",
        "draft s",
        "verify s",
    ):
        table.add_column(name, justify="right" if name != "method" else "left")
    table.add_row(
        stats.method,
        str(stats.new_tokens),
        str(stats.rounds),
        f"{stats.acceptance_rate:.1%}" if stats.drafted else "-",
        f"{stats.tokens_per_target_forward:.2f}",
        speed(stats).removesuffix(" tok/s"),
        f"{stats.prefill_seconds:.2f}",
        f"{stats.draft_seconds:.2f}",
        f"{stats.verify_seconds:.2f}",
    )
    return table


class RichRenderer:
    """A Live view that grows the answer round by round, then a summary table.

    Finished lines of the answer are printed above the live region as they complete, so it holds
    only the line being written, this round's rejected tokens and the footer: an answer taller
    than the screen keeps its newest tokens and footer in view (Live shows `...` past the
    screen's height), and a resize or typed keys disturb one line, not every frame."""

    def __init__(self, console: Console | None = None, header: str | None = None, show_tree: bool = False):
        self.console = console or Console(emoji=False)
        self.header = header
        self.show_tree = show_tree
        self.text = Text()
        self.rejected = Text()
        self.pending: list[tuple[str, str]] = []  # (text, final style) awaiting a replay
        self._live: Live | None = None
        self._stats: Stats | None = None
        self._printed = 0  # characters of `text` printed above the live region

    def __enter__(self) -> "RichRenderer":
        if self.header:
            self.console.print(Text(visible(self.header), style=PROMPT))
        self._live = Live(
            self._view(), console=self.console, refresh_per_second=10, transient=False, auto_refresh=False
        )
        self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.rejected = Text()  # rejected tokens belong to their round only
        if self._live is not None:
            self._live.update(self._view(), refresh=True)
            self._live.__exit__(*exc)
            self._live = None

    def on_round(self, result: RoundResult, stats: Stats) -> None:
        # a piece per emitted token (empty ones too): a replay's rollback counts tokens
        accepted = RECALLED if result.origin is Origin.MEMORY else ACCEPTED
        pieces = [(piece, accepted) for piece in result.accepted_pieces] + (
            [(result.target_piece, TARGET)] if result.target_emitted else []
        )
        if result.pending:
            self.pending.extend(pieces)
        else:
            for piece, style in pieces + [(result.tail, pieces[-1][1] if pieces else TARGET)]:
                self.text.append(visible(piece), style=style)
        self.rejected = Text(visible("".join(result.rejected_texts)), style=REJECTED)
        self._stats = stats
        if self.show_tree and not result.is_chain:
            self.console.print(rich_tree(result, f"round {stats.rounds}"))  # above the live view
        self._refresh()

    def on_replay(self, replay: ReplayResult, stats: Stats) -> None:
        """Verified pending tokens take their colours; rolled-back ones show red this round."""
        keep = len(self.pending) - len(replay.rolled_back_texts)
        for piece, style in self.pending[:keep]:
            self.text.append(visible(piece), style=style)
        if replay.correction_text is not None:
            self.text.append(visible(replay.correction_text), style=TARGET)
        self.text.append(visible(replay.tail), style=TARGET)
        self.rejected = Text(visible("".join(replay.rolled_back_texts)), style=REJECTED)
        self.pending = []
        self._stats = stats
        self._refresh()

    def finish(self, outcome: Outcome) -> None:
        if outcome.interrupted:
            self.console.print(Text("interrupted", style="yellow"))
        if self.console.width < SUMMARY_WIDTH:
            self.console.print(summary_line(outcome), style="dim", markup=False)
        else:
            self.console.print(summary_table(outcome.stats))

    def _refresh(self) -> None:
        if self._live is None:
            return
        end = self.text.plain.rfind("\n", self._printed) + 1  # the finished lines go above, for good
        if end > self._printed:
            self._live.console.print(self.text[self._printed : end], end="")
            self._printed = end
        self._live.update(self._view(), refresh=True)

    def _view(self) -> Group:
        pending = Text(visible("".join(piece for piece, _ in self.pending)), style=PENDING)
        line = self.text[self._printed :] + pending + self.rejected
        parts = [line] if line.plain else []
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

    def on_round(self, result: RoundResult, stats: Stats) -> None:
        if self.show_tree and not result.is_chain:
            Console(emoji=False, file=self.err, highlight=False).print(
                rich_tree(result, f"round {stats.rounds}")
            )
        if result.pending:  # only verified text is printed; a piece per token, as a rollback counts them
            self._pending.extend(result.pieces)
            return
        self._write("".join(result.pieces) + result.tail)

    def on_replay(self, replay: ReplayResult, stats: Stats) -> None:
        keep = len(self._pending) - len(replay.rolled_back_texts)
        self._write("".join(self._pending[:keep]) + (replay.correction_text or "") + replay.tail)
        self._pending = []

    def _write(self, text: str) -> None:
        if text:
            self._written.append(text)
            self.out.write(visible(text) if self._terminal else text)  # a file or pipe gets the text as is
            self.out.flush()

    @property
    def _terminal(self) -> bool:
        isatty = getattr(self.out, "isatty", None)
        return bool(isatty and isatty())

    def finish(self, outcome: Outcome) -> None:
        # The stream holds back a character whose bytes are not all there yet; at the end the
        # final text (as JSON has it, U+FFFD for a cut character) says what is left to print.
        written = "".join(self._written)
        if outcome.text.startswith(written):
            self._write(outcome.text[len(written) :])
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

    def on_round(self, result: RoundResult, stats: Stats) -> None:
        pass

    def on_replay(self, replay: ReplayResult, stats: Stats) -> None:
        pass

    def finish(self, outcome: Outcome) -> None:
        record = {
            "text": outcome.text,
            "token_ids": outcome.token_ids,
            "method": outcome.stats.method,
            **outcome.extra,
            "interrupted": outcome.interrupted,
            "stats": outcome.stats.as_dict(),
        }
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()

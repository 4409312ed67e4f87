"""The live view colours: accepted green, rejected red (struck), the target's token distinct."""

from __future__ import annotations

import io
import re

from rich.console import Console

from specgen.cli.render import ACCEPTED, REJECTED, TARGET, Outcome, PlainRenderer, RichRenderer
from specgen.decoding.events import ReplayResult, RoundResult
from specgen.decoding.stats import Stats


def shown(accepted: list[str], target: str, rejected: list[str] = (), pending: bool = False) -> RoundResult:
    """A chain round with its text, as the driver hands it to a renderer (the ids are stand-ins)."""
    return RoundResult(
        path=tuple(range(1, len(accepted) + 1)),
        emitted=list(range(len(accepted) + 1)),
        pieces=(*accepted, target),
        rejected_texts=tuple(rejected),
        pending=pending,
    )


def replayed(rolled_back: list[str], correction: str | None) -> ReplayResult:
    """A replay with its text (the ids are stand-ins)."""
    return ReplayResult(
        0,
        0,
        tuple(range(len(rolled_back))),
        None if correction is None else 0,
        0,
        0.0,
        rolled_back_texts=tuple(rolled_back),
        correction_text=correction,
    )


def test_rich_view_colours_each_kind_of_token():
    console = Console(
        record=True, force_terminal=True, color_system="truecolor", width=120, file=io.StringIO()
    )
    stats = Stats(method="chain", new_tokens=3, rounds=1, drafted=3, accepted=2)
    renderer = RichRenderer(console)
    with renderer:
        renderer.on_round(shown(["Hel", "lo"], " world", ["XX"]), stats)
        spans = {renderer.text.plain[s.start : s.end]: str(s.style) for s in renderer.text.spans}
        assert spans == {"Hel": ACCEPTED, "lo": ACCEPTED, " world": TARGET}
        assert renderer.rejected.plain == "XX" and str(renderer.rejected.style) == REJECTED
    renderer.finish(Outcome("Hello world", [1, 2, 3], stats))
    ansi = console.export_text(styles=True, clear=False)
    assert "\x1b[32mHel" in ansi  # green
    assert "\x1b[1;36m world" in ansi  # bold cyan
    assert "\x1b[9;31mrejected" in ansi  # struck-through red, shown in the legend
    assert "summary" in console.export_text()


def test_rejected_tokens_only_last_for_their_round():
    console = Console(record=True, force_terminal=True, width=80, file=io.StringIO())
    renderer = RichRenderer(console)
    stats = Stats(method="chain")
    with renderer:
        renderer.on_round(shown(["a"], "b", ["zz"]), stats)
        renderer.on_round(shown([], "c", []), stats)
        assert renderer.rejected.plain == ""
    assert renderer.text.plain == "abc"


def test_plain_renderer_separates_text_and_stats():
    out, err = io.StringIO(), io.StringIO()
    renderer = PlainRenderer(out, err)
    stats = Stats(method="plain", new_tokens=2, rounds=2)
    renderer.on_round(shown([], "Hi"), stats)
    renderer.on_round(shown([], "!"), stats)
    renderer.finish(Outcome("Hi!", [1, 2], stats))
    assert out.getvalue() == "Hi!\n"
    assert "[plain] 2 tokens" in err.getvalue()


def test_pending_tokens_are_dim_until_a_replay_commits_or_rolls_them_back():
    from specgen.cli.render import PENDING

    console = Console(record=True, force_terminal=True, width=100, file=io.StringIO())
    renderer = RichRenderer(console)
    stats = Stats(method="chain")
    with renderer:
        renderer.on_round(shown(["ab"], "c", [], pending=True), stats)
        renderer.on_round(shown([], "d", [], pending=True), stats)
        assert renderer.text.plain == "" and [p for p, _ in renderer.pending] == ["ab", "c", "d"]
        view = renderer._view()
        assert any(str(span.style) == PENDING for line in [view.renderables[0]] for span in line.spans)
        renderer.on_replay(replayed(["d"], "X"), stats)
        spans = {renderer.text.plain[s.start : s.end]: str(s.style) for s in renderer.text.spans}
        assert renderer.text.plain == "abcX"
        assert spans == {"ab": ACCEPTED, "c": TARGET, "X": TARGET}
        assert renderer.rejected.plain == "d" and str(renderer.rejected.style) == REJECTED


def test_plain_renderer_prints_only_verified_text():

    out, err = io.StringIO(), io.StringIO()
    renderer = PlainRenderer(out, err)
    stats = Stats(method="chain")
    renderer.on_round(shown(["a"], "b", pending=True), stats)
    assert out.getvalue() == ""
    renderer.on_replay(replayed(["b"], "Z"), stats)
    assert out.getvalue() == "aZ"


def test_a_rollback_counts_tokens_even_those_that_complete_no_character():
    """Byte tokens: 'U', a byte that completes no character (its text comes with the next token),
    'F'. A replay that rolls back 'F' keeps 'U' and the byte, and the correction brings the
    byte's text again: every view shows what decoding the kept tokens gives."""
    from tiny import build_tokenizer

    from specgen.decoding.views import replay_text, round_text
    from specgen.text import TextStream

    tokenizer = build_tokenizer()
    u, byte, f, g = (
        tokenizer.convert_tokens_to_ids(t) for t in ("U", "ô", "F", "G")
    )  # ô: GPT-2's stand-in for 0xF4
    stream = TextStream(tokenizer)
    first = round_text(RoundResult([u], (0,), (1,), byte, emitted=[u, byte]), stream, pending=True)
    second = round_text(RoundResult(target_token=f, emitted=[f]), stream, pending=True)
    assert first.pieces == ("U", "") and second.pieces == ("\ufffdF",)  # a piece per token, the empty one too
    replay = replay_text(ReplayResult(2, 1, (f,), g, 3, 0.0), stream)
    assert replay.correction_text == "\ufffdG" == tokenizer.decode([u, byte, g])[1:]
    out, err = io.StringIO(), io.StringIO()
    plain = RichRenderer(Console(file=io.StringIO(), width=80)), PlainRenderer(out, err)
    stats = Stats(method="chain")
    for renderer in plain:
        renderer.on_round(first, stats)
        renderer.on_round(second, stats)
        renderer.on_replay(replay, stats)
    assert plain[0].text.plain == out.getvalue() == "U\ufffdG" == tokenizer.decode([u, byte, g])


def test_control_characters_reach_a_terminal_as_escapes_and_a_pipe_as_they_are():
    """A model's ESC, BEL or CR could set the terminal's title, move the cursor or switch its
    character set: a terminal shows them as `\\x1b`; a file or pipe gets the exact text."""
    from specgen.cli.render import visible

    title = "hi\x1b]0;pwned\x07\r\x0e\x9b there\n\tok"
    assert visible(title) == "hi\\x1b]0;pwned\\x07\\x0d\\x0e\\x9b there\n\tok"
    console = Console(record=True, force_terminal=True, width=120, file=io.StringIO())
    stats = Stats(method="plain", new_tokens=1, rounds=1)
    renderer = RichRenderer(console)
    with renderer:
        renderer.on_round(shown([], title), stats)
    assert "\x1b]0;" not in console.file.getvalue() and "\\x1b]0;pwned" in console.export_text()

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for out, expected in ((Terminal(), visible(title)), (io.StringIO(), title)):
        plain = PlainRenderer(out, io.StringIO())
        plain.on_round(shown([], title), stats)
        plain.finish(Outcome(title, [1], stats))
        assert out.getvalue() == expected + "\n"


def test_finished_lines_go_above_the_live_region():
    """The live region holds the line being written: an answer taller than the screen keeps its
    newest tokens and footer in view, and every line is printed once."""
    out = io.StringIO()
    console = Console(force_terminal=True, width=80, height=6, file=out)
    stats = Stats(method="chain", new_tokens=1, rounds=1)
    renderer = RichRenderer(console)
    with renderer:
        for i in range(20):
            renderer.on_round(shown([f"line {i} "], f"end {i}\n"), stats)
        renderer.on_round(shown(["last "], "words"), stats)
        live = renderer._view().renderables[0].plain
        assert live == "last words"
    renderer.finish(Outcome(renderer.text.plain, [], stats))
    printed = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert all(printed.count(f"line {i} end {i}") == 1 for i in range(20)) and "last words" in printed


def test_a_rate_is_shown_only_for_a_decode_long_enough_to_time():
    from specgen.decoding.views import speed

    assert speed(Stats(method="plain", new_tokens=1, prefill_seconds=0.5, seconds=0.50004)) == "– tok/s"
    assert speed(Stats(method="plain", new_tokens=21, prefill_seconds=0.5, seconds=1.5)) == "21.0 tok/s"
    # JSON (run's, the server's `speculative`) says the same: no number for a decode too short to time
    assert (
        Stats(method="plain", new_tokens=1, prefill_seconds=0.5, seconds=0.50004).as_dict()[
            "tokens_per_second"
        ]
        is None
    )
    assert (
        Stats(method="plain", new_tokens=21, prefill_seconds=0.5, seconds=1.5).as_dict()["tokens_per_second"]
        == 21
    )

"""`specgen chat`: options -> a conversation (on a matching `specgen serve` when one runs,
else with the pair loaded here) -> an interactive or a scripted loop.

Owns the terminal side of chat: the input loop, live replies, round summaries, notices and
Ctrl-C/Ctrl-D. The prompt, line editing and unechoed keys are in cli/terminal.py; the
conversation, caches and slash commands live in specgen/chat/. No tensor code here.

Stdin a terminal: interactive, replies rendered live like `specgen run`. Otherwise one user
message per line (lines starting with / are commands, // sends a literal /), replies as plain
text on stdout (stats on stderr) or, with --format json, one JSON object per reply. A line that
fails (a bad command, a failed /save, an undecodable line) prints one error line and the session
goes on; the exit status is then 1, so a script can tell (130 after Ctrl-C).

SPECGEN_CHAT_TEST_DELAY=SECONDS (undocumented for users, for the pseudo-terminal test): sleep
that long after each round, so a test can press Ctrl-C in the middle of a reply on models
that would otherwise finish in a blink.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from specgen.chat.conversation import Conversation
from specgen.chat.saves import config_from, read_save, settings_dict
from specgen.cli.options import (
    Format,
    ending_signals,
    given,
    note_unused,
    sigterm_as_ctrl_c,
    user_errors,
    with_options,
)
from specgen.cli.reading import check_text, decode_text
from specgen.cli.remote import ServerChat, find
from specgen.cli.render import JsonRenderer, PlainRenderer, RichRenderer
from specgen.cli.terminal import keys_unechoed, line_editing, prompt
from specgen.config import GenerationConfig, ModelSettings
from specgen.decoding.views import declined_note, speed
from specgen.errors import PromptError, SpecgenError, one_line
from specgen.files import cache_root
from specgen.status import note

DELAY_ENV = "SPECGEN_CHAT_TEST_DELAY"
# options a --load file supplies, unless they are given on the command line (same names as its settings)
_SETTING_OPTIONS = tuple(settings_dict(GenerationConfig()))


@with_options()
def chat(
    *,
    ctx: typer.Context,
    system: Annotated[
        Optional[str], typer.Option("--system", help="System prompt for the conversation.")
    ] = None,
    load_file: Annotated[
        Optional[Path],
        typer.Option(
            "--load",
            help="Resume a conversation saved with /save (options given here override its settings).",
        ),
    ] = None,
    models: ModelSettings,
    generation: GenerationConfig,
    show_tree: Annotated[
        bool, typer.Option("--show-tree", help="Print each tree round's tree (tree methods).")
    ] = False,
    format: Annotated[
        Optional[Format],
        typer.Option(
            "--format", help="rich (terminal default), plain (pipe default) or json (one object per reply)."
        ),
    ] = None,
    server: Annotated[
        bool,
        typer.Option(
            "--server/--no-server",
            help="Chat on a running `specgen serve` with the same model options when there is one.",
        ),
    ] = True,
) -> None:
    """Chat with the target model; caches are kept between turns. /help lists the commands."""
    try:
        with user_errors():
            code = _chat(ctx, system, load_file, models, show_tree, format, server, generation)
    except KeyboardInterrupt:  # while loading models
        code = 130
    raise typer.Exit(code)


def _chat(ctx, system, load_file, settings: ModelSettings, show_tree, format, use_server, config) -> int:
    messages = None
    if system is not None:
        check_text(system, "--system")
    if load_file is not None:
        saved = read_save(load_file)
        named = {name for name in _SETTING_OPTIONS if given(ctx, name)}
        if "draft_tokens" in named:  # `-k auto` brings its schedule, `-k 5` the fixed one
            named.add("draft_schedule")
        ours = settings_dict(config)
        config = config_from({**saved.settings, **{k: ours[k] for k in named}}, config)
        system = system if given(ctx, "system") else saved.system
        messages = saved.messages
    note_unused(ctx, config)
    interactive = sys.stdin.isatty()
    fmt = format or (Format.rich if interactive and sys.stdout.isatty() else Format.plain)
    # a terminal gets Rich's word wrapping (a soft-wrapping Live view cut each reply line at the
    # width); a pipe or file gets every line whole
    out = Console(emoji=False, highlight=False, soft_wrap=not sys.stdout.isatty())
    err = Console(emoji=False, stderr=True, highlight=False, soft_wrap=not sys.stderr.isatty())

    def notify(message: str) -> None:
        err.print(f"note: {message}", style="yellow", markup=False)

    server = find(settings) if use_server else None
    if server is not None:  # no torch in this process: the server has the pair
        if fmt is not Format.json:
            note(
                f"specgen: chatting on the specgen server (pid {server.info['pid']}, {server.info['models']})"
            )
        chat_session = Conversation(
            ServerChat(server, settings), settings, config, system, messages, notify=notify
        )
        chat_session.configure(config)  # a method its models cannot run (-m, a loaded save's): one line now
    else:
        chat_session = _local_session(settings, config, system, messages, notify, quiet=fmt is Format.json)
    if load_file is not None:
        chat_session.note_models(saved)
        notify(f"resumed {len(chat_session.messages)} messages from {load_file}")
    ui = _Loop(chat_session, fmt, out, err, show_tree, float(os.environ.get(DELAY_ENV) or 0), interactive)
    return ui.interactive() if interactive else ui.scripted()


def _local_session(settings: ModelSettings, config, system, messages, notify, quiet: bool):
    """A conversation with the pair loaded here."""
    # these import torch: only when no server answers (a chat on a server never loads it)
    from specgen.chat.session import ChatSession
    from specgen.decoding.build import check_draft
    from specgen.runtime.pair import load

    check_draft(settings.draft, config.method)
    pair = load(settings, config.method, quiet=quiet)
    return ChatSession(pair, settings, config, system, messages, notify=notify, quiet=quiet)


class _TurnView:
    """A renderer for one turn: an optional delay per round, and `finish` held back so the
    loop can add the turn's numbers (reuse, dropped turns) before showing the end."""

    def __init__(self, inner, delay: float = 0.0):
        self.inner = inner
        self.delay = delay

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def on_round(self, result, stats) -> None:
        self.inner.on_round(result, stats)
        if self.delay:
            time.sleep(self.delay)

    def on_replay(self, replay, stats) -> None:
        self.inner.on_replay(replay, stats)

    def finish(self, outcome) -> None:
        pass


class _Loop:
    def __init__(self, chat_session, fmt: Format, out, err, show_tree: bool, delay: float, is_tty: bool):
        self.is_tty = is_tty  # interactive: Ctrl-C returns to the prompt; scripted: it ends the session
        self.chat = chat_session
        self.fmt = fmt
        self.out = out
        self.err = err
        self.show_tree = show_tree
        self.delay = delay
        self.failed = False  # a line ended in an error: a scripted session then exits 1

    # -- interactive ---------------------------------------------------------------------
    def interactive(self) -> int:
        readline = line_editing()
        shown = prompt()
        c = self.chat
        draft = f" + draft {escape(c.backend.draft_name)}" if c.backend.draft_name else ""
        self.out.print(
            f"[bold]specgen chat[/] · {escape(c.backend.target_name)}{draft} · {c.config.method.value} · "
            f"context {c.context_length} tokens · [dim]/help for commands, Ctrl-D to leave[/]"
        )
        leaving = False  # a Ctrl-C at an empty prompt asks; a second one in a row leaves
        ended = ending_signals()  # SIGTERM or SIGHUP stop a reply as Ctrl-C does, then end the session
        while True:
            if ended:  # the terminal closed (SIGHUP), or a kill: unlike Ctrl-C the session ends
                with contextlib.suppress(OSError):  # a closed terminal takes no more output
                    self.keep_interrupted("the chat was stopped")
                return 128 + ended[0]
            try:
                line = input(shown)
            except UnicodeDecodeError as exc:  # a terminal sending bytes that are not UTF-8
                self.error(PromptError(f"the line is not valid UTF-8 text ({exc.reason})"))
                continue
            except EOFError:
                self.out.print()
                return 0
            except KeyboardInterrupt:
                if ended:
                    continue
                self.out.print()
                if readline is not None and readline.get_line_buffer().strip():
                    leaving = False  # Ctrl-C over typed text drops the line, as in a shell
                    continue
                if leaving:
                    return 0
                # the Ctrl-C that stopped a reply is often pressed twice: it must not end the chat
                leaving = True
                self.notice("(Ctrl-C again, Ctrl-D or /exit to leave)")
                continue
            leaving = False
            try:
                if self.handle(line):
                    return 0
            except KeyboardInterrupt:  # a second Ctrl-C after a reply, or one during a command
                if not ended:
                    self.notice("interrupted")

    # -- scripted ------------------------------------------------------------------------
    def scripted(self) -> int:
        # bytes, decoded line by line: one undecodable line is an error, not the end of the session
        stream = getattr(sys.stdin, "buffer", None) or sys.stdin
        sigterm_as_ctrl_c()  # `kill`, a job's time limit: the conversation is kept as on Ctrl-C
        try:
            for number, raw in enumerate(iter(stream.readline, b"" if stream is not sys.stdin else ""), 1):
                if isinstance(raw, bytes):
                    try:
                        raw = decode_text(raw, f"input line {number}")
                    except SpecgenError as exc:
                        self.error(exc)
                        continue
                if self.handle(raw.rstrip("\r\n")):
                    break
        except (_Interrupted, KeyboardInterrupt):  # in a reply, a command, or waiting for the next line
            self.keep_interrupted("the input's later lines were not run")
            return 130
        return 1 if self.failed else 0  # a script whose /save (or any line) failed must not pass

    def keep_interrupted(self, what: str) -> None:
        """Ctrl-C stops a script, and with it the lines after (often its /save), and SIGTERM or
        SIGHUP ends any session: the conversation so far goes to a save file of its own, which
        `--load` continues."""
        c = self.chat
        if not (c.earlier or c.messages):
            return
        path = cache_root() / "chats" / time.strftime(f"interrupted-%Y%m%d-%H%M%S-{os.getpid()}.json")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            c.save(path)
        except (OSError, SpecgenError) as exc:
            self.notice(f"{what}, and the conversation could not be kept: {one_line(exc)}")
            return
        self.notice(f"{what}; the conversation so far is saved in {path} (specgen chat --load continues it)")

    # -- one line ------------------------------------------------------------------------
    def handle(self, line: str) -> bool:
        """Run one input line; True means leave."""
        if not line.strip():
            return False
        try:
            check_text(line, "the line")
        except SpecgenError as exc:
            self.error(exc)
            return False
        if line.startswith("/") and not line.startswith("//"):
            return self.command(line)
        try:
            self.turn(line[1:] if line.startswith("//") else line)
        except SpecgenError as exc:
            self.error(exc)
        except (_Interrupted, KeyboardInterrupt, BrokenPipeError):
            raise  # a closed stdout (`| head`) ends the session quietly, as it ends `run`
        except Exception as exc:  # noqa: BLE001 - a failed turn must not end the session (and lose it)
            if os.environ.get("SPECGEN_DEBUG"):
                raise
            self.error(
                _unexpected(exc, "the reply failed; the message was not kept, the conversation goes on")
            )
        return False

    def command(self, line: str) -> bool:
        try:
            result = self.chat.command(line)
        except SpecgenError as exc:
            self.error(exc)
            return False
        except (KeyboardInterrupt, BrokenPipeError):
            raise
        except Exception as exc:  # noqa: BLE001
            if os.environ.get("SPECGEN_DEBUG"):
                raise
            self.error(_unexpected(exc, "the command failed; the conversation goes on"))
            return False
        if self.fmt is Format.json and result.data is not None:
            name = line.strip()[1:].split(" ", 1)[0].lower()
            sys.stdout.write(json.dumps({"command": name, **result.data}, ensure_ascii=False) + "\n")
            sys.stdout.flush()
        elif result.message:
            console = self.out if self.fmt is Format.rich else self.err
            console.print(result.message, markup=False)
        return result.exit

    def turn(self, text: str) -> None:
        if self.fmt is Format.rich:
            inner = RichRenderer(self.out, show_tree=self.show_tree)
        elif self.fmt is Format.json:
            inner = JsonRenderer()
        else:
            inner = PlainRenderer(show_tree=self.show_tree)
        try:
            with keys_unechoed(self.is_tty):
                turn = self.chat.send(text, _TurnView(inner, self.delay))
        except KeyboardInterrupt:
            self.notice("interrupted before the reply began; the message was not kept")
            if self.is_tty:
                return
            raise _Interrupted from None
        outcome = turn.outcome
        outcome.extra.update(
            turn=turn.number,
            conversation_tokens=turn.prompt_tokens,
            reused_tokens=turn.reused_tokens,
            dropped_turns=turn.dropped,
        )
        if self.fmt is Format.rich:
            self.out.print(summary_line(turn), style="dim", markup=False)
        else:
            inner.finish(outcome)
            if self.fmt is Format.plain:
                self.err.print(
                    f"turn {turn.number}: conversation {turn.prompt_tokens} tokens, "
                    f"{turn.reused_tokens} reused from the caches",
                    markup=False,
                )
        if outcome.interrupted:
            self.notice("interrupted · the partial reply is kept in the conversation, marked interrupted")
            if not self.is_tty:
                raise _Interrupted

    def notice(self, message: str) -> None:
        self.err.print(message, style="yellow", markup=False)

    def error(self, exc: SpecgenError) -> None:
        self.failed = True
        hint = f" [dim]({escape(exc.hint)})[/]" if getattr(exc, "hint", None) else ""
        self.err.print(f"[bold red]error:[/] {escape(str(exc))}{hint}", markup=True)


def _unexpected(exc: Exception, what: str) -> SpecgenError:
    return SpecgenError(f"unexpected {one_line(exc)}", hint=f"{what}; SPECGEN_DEBUG=1 shows the traceback")


class _Interrupted(Exception):
    """Ctrl-C in a scripted session: stop reading, exit 130 as `run` does."""


def summary_line(turn) -> str:
    """One line after each reply: the round statistics and what the caches saved."""
    s = turn.outcome.stats
    parts = [f"turn {turn.number}", s.method, f"{s.new_tokens} tokens in {s.rounds} rounds"]
    if s.drafted:
        parts.append(f"accepted {s.accepted}/{s.drafted} ({s.acceptance_rate:.0%})")
    parts += [
        f"{s.tokens_per_target_forward:.2f} tokens/target forward",
        speed(s),
        f"first token {s.time_to_first_token or 0.0:.2f} s",
        f"prompt {turn.prompt_tokens} tokens ({turn.reused_tokens} reused, "
        f"{turn.prompt_tokens - turn.reused_tokens} prefilled)",
    ]
    if s.stop:
        parts.append(f"stop: {s.stop}")
    if s.declined:
        parts.append(declined_note(s))
    return " · ".join(parts)

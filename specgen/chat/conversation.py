"""A conversation, wherever its replies are generated: the turns, the settings slash commands
change, session totals, save files and the slash commands themselves (no torch).

Owns the messages (user/assistant turns; a reply cut by Ctrl-C is kept and marked
`"interrupted": true`), the system prompt, the settings, session totals (the turns' Stats
merged), dropping the oldest turns when the context fills up, and save files (saves.py). What
generates the replies is a `Backend`: the pair loaded in this process (session.py, which keeps
the engine's caches between turns) or a running `specgen serve` (its client, which the server
answers from the row it parked after the previous turn). Knows nothing about terminals: notices
go to a `notify` callback, replies to whatever renderer the caller passes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Protocol

from specgen.chat.saves import (
    DEVICE,
    SAVE_FORMAT,
    SAVE_VERSION,
    SETTING_NAMES,
    SavedChat,
    config_from,
    read_save,
    settings_dict,
    write_save,
)
from specgen.config import GenerationConfig, Method, ModelSettings, Schedule
from specgen.decoding.stats import Stats, histogram
from specgen.decoding.views import Outcome, speed
from specgen.errors import ConfigError, PartialReply, PromptError

HELP = f"""\
/help                 this list
/reset                forget the conversation (the system prompt and settings stay)
/system [TEXT]        set the system prompt; without TEXT show it; /system --clear removes it
/stats                session totals
/method [NAME]        switch method: {", ".join(m.value for m in Method)}
/set [NAME VALUE]     temperature, top_k, top_p, seed (or none), max_new_tokens, draft_tokens
                      (or auto, device), draft_schedule, draft_confidence (or device); without
                      arguments show them
/save FILE            write the conversation and settings as JSON
/load FILE            resume a saved conversation
/exit                 leave (also Ctrl-D, or Ctrl-C twice at an empty prompt)
Any other line is a message; start it with // to send a line that begins with /."""
WORDS = {
    "draft_tokens": ("auto", DEVICE),
    "draft_confidence": (DEVICE,),  # /set's values that are no numbers
    "draft_schedule": tuple(schedule.value for schedule in Schedule),
}


@dataclass(frozen=True)
class Turn:
    """What one call to `send` did."""

    number: int
    outcome: Outcome
    prompt_tokens: int  # the rendered conversation
    reused_tokens: int  # cache positions kept from the previous turn
    dropped: int  # old turns dropped to fit the context before this one


@dataclass(frozen=True)
class CommandResult:
    message: str = ""
    exit: bool = False
    data: dict | None = None  # machine-readable form (for --format json)


class Backend(Protocol):
    """What generates a conversation's replies."""

    target_name: str
    draft_name: str | None
    context_length: int

    def count(self, messages: list[dict]) -> int:
        """Tokens of `messages` (system first, role/content only) rendered for a reply; at least
        context_length + 1 for a conversation known to be longer than the context."""

    def reply(self, messages: list[dict], config: GenerationConfig, renderer) -> tuple[Outcome, int]:
        """The next reply generated into `renderer`, and the prompt tokens its caches kept.
        Ctrl-C before the reply began raises KeyboardInterrupt; during it, the outcome is
        marked interrupted."""

    def configure(self, config: GenerationConfig) -> None:
        """Prepare for `config` (a local pair loads its draft model where needed, and chooses a
        draft length left to the device)."""


def plain_messages(messages: list[dict]) -> list[dict]:
    """Only role and content: chat templates must not see our own keys (like `interrupted`)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class Conversation:
    """One conversation; `send` runs a turn, `command` runs a slash command."""

    def __init__(
        self,
        backend: Backend,
        settings: ModelSettings,
        config: GenerationConfig,
        system: str | None = None,
        messages: list[dict] | None = None,
        *,
        notify: Callable[[str], None] | None = None,
    ):
        self.backend = backend
        self.settings = settings
        self.config = config
        self.system = system or None
        self.messages: list[dict] = [dict(m) for m in messages or []]  # the turns the context holds
        self.earlier: list[dict] = []  # turns dropped from the context to fit it: a save keeps them
        self.notify = notify or (lambda message: None)
        self.totals: Stats | None = None  # every turn's Stats merged
        self.turns_by_method: Counter = Counter()
        self.dropped_turns = 0

    @property
    def context_length(self) -> int:
        return self.backend.context_length

    # -- turns ---------------------------------------------------------------------------
    def full(self, messages: list[dict]) -> list[dict]:
        """The messages a reply sees: the system prompt first, our own keys removed."""
        return ([{"role": "system", "content": self.system}] if self.system else []) + plain_messages(
            messages
        )

    @property
    def reserved(self) -> int:
        """Context kept free for a reply: max_new_tokens, but at most half the context (a budget
        past the context, "as long as it takes", must not cost every earlier turn)."""
        return min(self.config.max_new_tokens, self.context_length // 2)

    def fit(self, messages: list[dict]) -> tuple[list[dict], int, int]:
        """Drop the oldest turns until the conversation plus the reply's room (`reserved`) fits
        the context.

        A turn is a user message with the replies after it. The last user message is never
        dropped, nor the system prompt. Returns (messages, their token count, turns dropped).
        """
        count = self.backend.count(self.full(messages))
        dropped = 0
        starts = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if count + self.reserved > self.context_length and len(starts) > 1:
            # the fewest turns to drop, by bisection: a loaded save may hold far more than fits
            counts = {}
            low, high = 1, len(starts) - 1  # drop `high` turns: all but the last (it may still not fit)
            while low < high:
                middle = (low + high) // 2
                counts[middle] = self.backend.count(self.full(messages[starts[middle] :]))
                if counts[middle] + self.reserved > self.context_length:
                    low = middle + 1
                else:
                    high = middle
            dropped, messages = low, messages[starts[low] :]
            count = counts[low] if low in counts else self.backend.count(self.full(messages))
        if count >= self.context_length:
            raise PromptError(
                f"the message needs {count} tokens with the system prompt and the chat "
                f"template, but the context holds {self.context_length}; shorten it"
            )
        return messages, count, dropped

    def send(self, text: str, renderer) -> Turn:
        """One turn: the user's `text`, a reply generated into `renderer`, both kept."""
        if not text.strip():
            raise PromptError("the message is empty")
        asked = self.messages + [{"role": "user", "content": text}]
        messages, count, dropped = self.fit(asked)
        if dropped:
            self.earlier += asked[: len(asked) - len(messages)]
            self.dropped_turns += dropped
            self.notify(
                f"dropped the oldest {dropped} turn{'s' if dropped > 1 else ''} to make room in the "
                f"context of {self.context_length} tokens ({count} in the conversation, "
                f"{min(self.context_length - count, self.config.max_new_tokens)} left for the reply)"
            )
        room = self.context_length - count
        if room < self.config.max_new_tokens and not dropped:  # the note above said it
            self.notify(f"the context leaves room for {room} new tokens in this reply")
        self.messages = messages[:-1]  # the user's message joins once there is a reply
        try:
            outcome, reused = self.backend.reply(self.full(messages), self.config, renderer)
        except PartialReply as broken:  # the server went away mid-answer: what came is kept, as on Ctrl-C
            self.messages = messages + [
                {"role": "assistant", "content": broken.outcome.text, "interrupted": True}
            ]
            raise
        reply = {"role": "assistant", "content": outcome.text}
        if outcome.interrupted:
            reply["interrupted"] = True
        self.messages = messages + [reply]
        turn = replace(outcome.stats, reused_tokens=reused)
        self.totals = turn if self.totals is None else self.totals.merge(turn)
        self.turns_by_method[turn.method] += 1
        return Turn(self.totals.generations, outcome, count, reused, dropped)

    # -- settings ------------------------------------------------------------------------
    def configure(self, config: GenerationConfig) -> None:
        """Switch to `config` (the backend prepares first: on failure nothing changed). The
        conversation keeps it as given ("device" stays the device's to choose: a save made here
        and loaded on another machine gets that machine's choice); a local backend decodes with
        the draft length chosen."""
        self.backend.configure(config)
        self.config = config

    def set_option(self, name: str, value: str) -> None:
        """/set NAME VALUE; every setting but the words below takes a number."""
        name = name.strip().lower().replace("-", "_")
        if name not in SETTING_NAMES:
            raise ConfigError(f"unknown setting '{name}'; choose one of: {', '.join(SETTING_NAMES)}")
        value = value.strip()
        if name == "seed" and value.lower() in ("none", "off", ""):
            parsed = None
        elif value.lower() in WORDS.get(name, ()):
            parsed = value.lower()
        elif name == "draft_schedule":
            raise ConfigError(f"draft_schedule takes {', '.join(WORDS[name])}, got '{value}'")
        else:
            kind = float if name in ("temperature", "top_p", "draft_confidence") else int
            try:
                parsed = kind(value)
            except ValueError:
                raise ConfigError(
                    f"{name} takes {'a number' if kind is float else 'an integer'}, got '{value}'"
                ) from None
        self.configure(config_from({name: parsed}, self.config))  # its errors name the setting

    def set_method(self, name: str) -> None:
        self.configure(replace(self.config, method=Method.parse(name)))

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    def reset(self) -> None:
        """Forget the turns; the caches stay (the system prompt's tokens are still reusable)."""
        self.messages, self.earlier = [], []

    # -- save files ----------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            "format": SAVE_FORMAT,
            "version": SAVE_VERSION,
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "models": {
                "target": self.settings.target,
                "draft": self.settings.draft,
                "target_name": self.backend.target_name,
            },
            "system": self.system,
            "settings": settings_dict(self.config),
            "messages": [dict(m) for m in self.earlier + self.messages],  # every turn, dropped ones too
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path).expanduser()
        write_save(path, self.snapshot())
        return path

    def load(self, path: str | Path) -> SavedChat:
        """Resume a save file; on any error the session is unchanged."""
        saved = read_save(path)
        self.configure(config_from(saved.settings, self.config))  # may fail: nothing changed yet
        self.system, self.messages, self.earlier = saved.system, [dict(m) for m in saved.messages], []
        self.note_models(saved)
        return saved

    def note_models(self, saved: SavedChat) -> None:
        """Say so when a save was made with another target (`/load` and `--load` alike); a path
        given another way (relative, with ~) is the same target."""

        def where(name: str) -> str:
            path = Path(name).expanduser()
            return str(path.resolve()) if path.exists() else name

        made = saved.models.get("target")
        if isinstance(made, str) and where(made) != where(self.settings.target):
            self.notify(f"the save was made with target {made}; continuing with {self.settings.target}")

    # -- session totals ------------------------------------------------------------------
    def totals_dict(self) -> dict:
        t = self.totals or Stats(method=self.config.method.value, generations=0)
        return {
            "turns": t.generations,
            "interrupted": t.interrupted,
            "new_tokens": t.new_tokens,
            "rounds": t.rounds,
            "drafted": t.drafted,
            "accepted": t.accepted,
            "acceptance_rate": round(t.acceptance_rate, 4),
            "tokens_per_target_forward": round(t.tokens_per_target_forward, 4),
            # null for a decode too short to time; `tokens_per_second`, its old name, for one release
            "decode_tokens_per_second": t.as_dict()["decode_tokens_per_second"],
            "tokens_per_second": t.as_dict()["decode_tokens_per_second"],
            "prompt_tokens": t.prompt_tokens,
            "reused_tokens": t.reused_tokens,
            "prefilled_tokens": t.prompt_tokens - t.reused_tokens,
            "dropped_turns": self.dropped_turns,
            "prefill_seconds": round(t.prefill_seconds, 4),
            "decode_seconds": round(t.decode_seconds, 4),
            "turns_by_method": dict(self.turns_by_method),
            "accepted_length_histogram": histogram(t.accepted_lengths),
        }

    def totals_lines(self) -> list[str]:
        t = self.totals or Stats(method=self.config.method.value, generations=0)
        accept = f"accepted {t.accepted}/{t.drafted} ({t.acceptance_rate:.1%})" if t.drafted else "no drafts"
        methods = ", ".join(f"{m} {n}" for m, n in sorted(self.turns_by_method.items())) or "-"
        return [
            f"turns {t.generations} ({t.interrupted} interrupted) · methods: {methods}",
            f"{t.new_tokens} new tokens in {t.rounds} rounds · {accept} · "
            f"{t.tokens_per_target_forward:.2f} tokens/target forward · {speed(t)}",
            f"prompt tokens {t.prompt_tokens}: {t.reused_tokens} reused from the caches, "
            f"{t.prompt_tokens - t.reused_tokens} prefilled in {t.prefill_seconds:.2f} s"
            + (
                f" · {self.dropped_turns} old turn{'s' if self.dropped_turns != 1 else ''} dropped"
                if self.dropped_turns
                else ""
            ),
        ]

    # -- slash commands ------------------------------------------------------------------
    def command(self, line: str) -> CommandResult:
        """Run one slash command; a SpecgenError means the session is unchanged."""
        name, _, arg = line.strip()[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        if arg and name in ("exit", "quit", "help", "?", "reset", "stats"):
            raise ConfigError(f"/{name} takes nothing after it, got '{arg[:40]}'")
        if name in ("exit", "quit"):
            return CommandResult(exit=True)
        if name in ("help", "?"):
            return CommandResult(HELP)
        if name == "reset":
            self.reset()
            return CommandResult(
                "conversation cleared" + (" (the system prompt stays)" if self.system else "")
            )
        if name == "system":
            if arg == "--clear":
                self.set_system(None)
                return CommandResult("system prompt removed")
            if not arg:
                return CommandResult(f"system prompt: {self.system}" if self.system else "no system prompt")
            self.set_system(arg)
            return CommandResult("system prompt set")
        if name == "stats":
            return CommandResult("\n".join(self.totals_lines()), data={"totals": self.totals_dict()})
        if name == "method":
            if arg:
                self.set_method(arg)
            choices = ", ".join(m.value for m in Method)
            return CommandResult(
                f"method: {self.config.method.value} (choices: {choices})",
                data={"method": self.config.method.value},
            )
        if name == "set":
            if arg:
                option, _, value = arg.replace("=", " ", 1).partition(" ")
                if not value.strip():
                    raise ConfigError("/set needs a name and a value, like /set temperature 0.7")
                self.set_option(option, value)
            shown = settings_dict(self.config)
            return CommandResult(
                " · ".join(
                    f"{k} {'none' if shown[k] is None else shown[k]}" for k in ("method", *SETTING_NAMES)
                ),
                data={"settings": shown},
            )
        if name in ("save", "load"):
            if not arg:
                raise ConfigError(f"/{name} needs a file name, like /{name} chat.json")
            if name == "save":
                count, path = len(self.earlier) + len(self.messages), self.save(arg)
                return CommandResult(
                    f"saved {count} messages to {path}", data={"saved": str(path), "messages": count}
                )
            self.load(arg)
            return CommandResult(
                f"loaded {len(self.messages)} messages from {arg}",
                data={"loaded": arg, "messages": len(self.messages)},
            )
        raise ConfigError(f"unknown command /{name}; /help lists the commands")

"""A chat session: the conversation, the engine state kept between turns, slash commands.

Owns the messages (user/assistant turns; a reply cut by Ctrl-C is kept and marked
`"interrupted": true`), the system prompt, the settings that slash commands change, session
totals, rendering the conversation with the tokenizer's chat template, dropping the oldest
turns when the context fills up, and save files. Knows nothing about terminals or Typer:
notices go to a `notify` callback, replies to whatever renderer the caller passes.

Cache reuse: each turn renders the whole conversation and hands the previous DecodeState to
`session.generate`; `Engine.resume` keeps the longest common prefix of both caches, so a turn
prefills only its new tokens, and anything that changes earlier tokens (dropped turns, a new
system prompt, a template that re-renders old turns) falls back from the first difference.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from specgen import session
from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.errors import ConfigError, PromptError, SpecgenError
from specgen.render import Outcome
from specgen.stats import Stats

SAVE_FORMAT = "specgen-chat"
SAVE_VERSION = 1
ROLES = ("user", "assistant")

HELP = """\
/help                 this list
/reset                forget the conversation (the system prompt and settings stay)
/system [TEXT]        set the system prompt; without TEXT show it; /system --clear removes it
/stats                session totals
/method [NAME]        switch method: plain, chain, rsd-c, rsd-s, multi-draft
/set [NAME VALUE]     temperature, top_k, top_p, seed (or none), max_new_tokens, draft_tokens;
                      without arguments show the settings
/save FILE            write the conversation and settings as JSON
/load FILE            resume a saved conversation
/exit                 leave (also Ctrl-D, or Ctrl-C at an empty prompt)
Any other line is a message; start it with // to send a line that begins with /."""


class SaveFileError(SpecgenError):
    """A save file that cannot be read, is not JSON, or is not a chat save of this version."""


@dataclass
class Totals:
    """Session totals: the per-turn Stats added up."""

    turns: int = 0
    interrupted: int = 0
    new_tokens: int = 0
    rounds: int = 0
    target_forwards: int = 0  # Stats.target_forwards summed (replays included)
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: int = 0  # rendered conversation tokens, summed over turns
    reused_tokens: int = 0  # of those, served from the kept caches
    dropped_turns: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    turns_by_method: Counter = field(default_factory=Counter)
    accepted_lengths: Counter = field(default_factory=Counter)

    def add(self, stats: Stats, reused: int, interrupted: bool) -> None:
        self.turns += 1
        self.interrupted += interrupted
        self.new_tokens += stats.new_tokens
        self.rounds += stats.rounds
        self.target_forwards += stats.target_forwards
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.prompt_tokens += stats.prompt_tokens
        self.reused_tokens += reused
        self.prefill_seconds += stats.prefill_seconds
        self.decode_seconds += stats.decode_seconds
        self.turns_by_method[stats.method] += 1
        self.accepted_lengths.update(stats.accepted_lengths)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "turns": self.turns, "interrupted": self.interrupted, "new_tokens": self.new_tokens,
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_target_forward": round(self.tokens_per_target_forward, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
            "prefilled_tokens": self.prompt_tokens - self.reused_tokens,
            "dropped_turns": self.dropped_turns,
            "prefill_seconds": round(self.prefill_seconds, 4), "decode_seconds": round(self.decode_seconds, 4),
            "turns_by_method": dict(self.turns_by_method),
            "accepted_length_histogram": {str(k): v for k, v in sorted(self.accepted_lengths.items())},
        }

    def lines(self) -> list[str]:
        accept = (f"accepted {self.accepted}/{self.drafted} ({self.acceptance_rate:.1%})"
                  if self.drafted else "no drafts")
        methods = ", ".join(f"{m} {n}" for m, n in sorted(self.turns_by_method.items())) or "-"
        return [
            f"turns {self.turns} ({self.interrupted} interrupted) · methods: {methods}",
            f"{self.new_tokens} new tokens in {self.rounds} rounds · {accept} · "
            f"{self.tokens_per_target_forward:.2f} tokens/target forward · {self.tokens_per_second:.1f} tok/s",
            f"prompt tokens {self.prompt_tokens}: {self.reused_tokens} reused from the caches, "
            f"{self.prompt_tokens - self.reused_tokens} prefilled in {self.prefill_seconds:.2f} s"
            + (f" · {self.dropped_turns} old turns dropped" if self.dropped_turns else ""),
        ]


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


@dataclass(frozen=True)
class SavedChat:
    """A validated save file."""

    system: str | None
    messages: list[dict]
    settings: dict  # GenerationConfig fields, flattened (see settings_dict)
    models: dict


SETTING_NAMES = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "draft_tokens")


def settings_dict(config: GenerationConfig) -> dict:
    s = config.sampling
    return {"method": config.method.value, "max_new_tokens": config.max_new_tokens,
            "draft_tokens": config.draft_tokens, "temperature": s.temperature, "top_k": s.top_k,
            "top_p": s.top_p, "seed": s.seed, "branching": list(config.branching),
            "beam_width": config.beam_width, "depth": config.depth}


def config_from(settings: dict, base: GenerationConfig | None = None) -> GenerationConfig:
    """A validated GenerationConfig from (some of) settings_dict's keys over `base`."""
    base = base or GenerationConfig()
    merged = {**settings_dict(base), **settings}
    try:
        sampling = SamplingConfig(temperature=float(merged["temperature"]), top_k=_int(merged["top_k"]),
                                  top_p=float(merged["top_p"]),
                                  seed=None if merged["seed"] is None else _int(merged["seed"]))
        return replace(  # keeps what /set does not name (deterministic mode, the draft schedule)
            base, method=Method.parse(str(merged["method"])), max_new_tokens=_int(merged["max_new_tokens"]),
            draft_tokens=_int(merged["draft_tokens"]), sampling=sampling,
            branching=tuple(_int(b) for b in merged["branching"]), beam_width=_int(merged["beam_width"]),
            depth=_int(merged["depth"]))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid settings: {exc}") from None


def _int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def plain_messages(messages: list[dict]) -> list[dict]:
    """Only role and content: chat templates must not see our own keys (like `interrupted`)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def load_draft(settings: session.ModelSettings, target, quiet: bool = False):
    """Load the draft alone, placed as `models.load_pair` places it (for /method and /load)."""
    from specgen.models import load_draft as load

    return load(settings.draft, target, device=settings.device, draft_device=settings.draft_device,
                dtype=settings.dtype, quiet=quiet)


class ChatSession:
    """One conversation with a loaded pair; `send` runs a turn, `command` runs a slash command."""

    def __init__(self, pair: session.Pair, settings: session.ModelSettings, config: GenerationConfig,
                 system: str | None = None, messages: list[dict] | None = None, *,
                 notify: Callable[[str], None] | None = None, reuse_cache: bool = True, quiet: bool = False):
        self.pair = pair
        self.settings = settings
        self.config = config
        self.system = system or None
        self.messages: list[dict] = [dict(m) for m in messages or []]
        self.notify = notify or (lambda message: None)
        self.reuse_cache = reuse_cache  # False: every turn prefills from scratch (for measurements)
        self.quiet = quiet
        self.totals = Totals()
        self.state = None  # the engine's DecodeState after the last turn
        self.engine = session.build_engine(pair, config.method, config)
        self._drafter_key = self._key(config)
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError("the target's tokenizer has no chat template; specgen chat needs one",
                              hint="use `specgen run --raw` for base models")

    @property
    def tokenizer(self):
        return self.pair.target.tokenizer

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    # -- turns ---------------------------------------------------------------------------
    def render(self, messages: list[dict] | None = None) -> list[int]:
        """The conversation (system prompt first) through the chat template, ready for a reply."""
        messages = self.messages if messages is None else messages
        full = ([{"role": "system", "content": self.system}] if self.system else []) + plain_messages(messages)
        return list(self.tokenizer.apply_chat_template(full, add_generation_prompt=True,
                                                       return_dict=True)["input_ids"])

    def fit(self, messages: list[dict]) -> tuple[list[dict], list[int], int]:
        """Drop the oldest turns until the conversation plus max_new_tokens fits the context.

        A turn is a user message with the replies after it. The last user message is never
        dropped, nor the system prompt. Returns (messages, rendered ids, turns dropped).
        """
        ids = self.render(messages)
        dropped = 0
        while len(ids) + self.config.max_new_tokens > self.context_length:
            starts = [i for i, m in enumerate(messages) if m["role"] == "user"]
            if len(starts) < 2:
                break
            messages = messages[starts[1]:]
            ids = self.render(messages)
            dropped += 1
        if len(ids) >= self.context_length:
            raise PromptError(f"the message needs {len(ids)} tokens with the system prompt and the chat "
                              f"template, but the context holds {self.context_length}; shorten it")
        return messages, ids, dropped

    def send(self, text: str, renderer) -> Turn:
        """One turn: the user's `text`, a reply generated into `renderer`, both kept."""
        if not text.strip():
            raise PromptError("the message is empty")
        messages, ids, dropped = self.fit(self.messages + [{"role": "user", "content": text}])
        if dropped:
            self.totals.dropped_turns += dropped
            self.notify(f"dropped the oldest {dropped} turn{'s' if dropped > 1 else ''} to fit the "
                        f"context of {self.context_length} tokens ({len(ids)} in the conversation + "
                        f"{self.config.max_new_tokens} for the reply)")
        room = self.context_length - len(ids)
        if room < self.config.max_new_tokens:
            self.notify(f"the context leaves room for {room} new tokens in this reply")
        self.messages = messages[:-1]  # the user's message joins once there is a reply
        if not self.reuse_cache:
            self._fresh()
        previous = self.state
        try:
            outcome = session.generate(self.engine, self.tokenizer, ids, self.config, renderer, state=previous)
        except KeyboardInterrupt:  # landed outside generate's own guard: the caches may be mid-update
            self._fresh()
            raise
        self.state = outcome.state
        reused = 0
        if outcome.interrupted and not self._resumed(outcome.state, ids):
            self._fresh()  # Ctrl-C during the prefill: the state's ids no longer describe its cache
        elif outcome.state is not None:
            reused = outcome.state.reused_tokens
        reply = {"role": "assistant", "content": outcome.text}
        if outcome.interrupted:
            reply["interrupted"] = True
        self.messages = messages + [reply]
        self.totals.add(outcome.stats, reused, outcome.interrupted)
        return Turn(self.totals.turns, outcome, len(ids), reused, dropped)

    @staticmethod
    def _resumed(state, ids: list[int]) -> bool:
        return state is not None and state.prompt_length == len(ids) and state.ids[: len(ids)] == ids

    def _fresh(self) -> None:
        """Forget both caches: the next turn prefills from scratch (a new drafter, too)."""
        self.state = None
        self.engine = session.build_engine(self.pair, self.config.method, self.config)

    # -- settings ------------------------------------------------------------------------
    @staticmethod
    def _key(config: GenerationConfig) -> tuple:
        """What the drafter is built from: a change means a new drafter (with an empty cache)."""
        m = config.method
        return (m, config.branching, config.beam_width, config.depth) if m.is_tree else (m,)

    def configure(self, config: GenerationConfig) -> None:
        """Switch to `config`, loading the draft model and building a new drafter where needed.

        The target's cache is kept even when the drafter changes: the new drafter starts empty
        and `Engine.resume` prefills it from the conversation.
        """
        if config.method.needs_draft_model and self.pair.draft is None:
            if not self.settings.draft:
                raise ConfigError(f"method {config.method.value} needs a draft model; start chat with --draft MODEL")
            self.notify(f"loading the draft model {self.settings.draft}")
            self.pair.draft = load_draft(self.settings, self.pair.target, quiet=self.quiet)
        key = self._key(config)
        if key != self._drafter_key:
            self.engine = session.build_engine(self.pair, config.method, config)
            self._drafter_key = key
        self.config = config

    def set_option(self, name: str, value: str) -> None:
        name = name.strip().lower().replace("-", "_")
        if name not in SETTING_NAMES:
            raise ConfigError(f"unknown setting '{name}'; choose one of: {', '.join(SETTING_NAMES)}")
        value = value.strip()
        if name == "seed" and value.lower() in ("none", "off", ""):
            parsed = None
        else:
            kind = float if name in ("temperature", "top_p") else int
            try:
                parsed = kind(value)
            except ValueError:
                raise ConfigError(f"{name} takes {'a number' if kind is float else 'an integer'}, "
                                  f"got '{value}'") from None
        self.configure(config_from({name: parsed}, self.config))

    def set_method(self, name: str) -> None:
        self.configure(replace(self.config, method=Method.parse(name)))

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    def reset(self) -> None:
        """Forget the turns; the caches stay (the system prompt's tokens are still reusable)."""
        self.messages = []

    # -- save files ----------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            "format": SAVE_FORMAT, "version": SAVE_VERSION,
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "models": {"target": self.settings.target, "draft": self.settings.draft,
                       "target_name": self.pair.target.name},
            "system": self.system,
            "settings": settings_dict(self.config),
            "messages": [dict(m) for m in self.messages],
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path).expanduser()
        write_atomic(path, json.dumps(self.snapshot(), ensure_ascii=False, indent=2) + "\n")
        return path

    def load(self, path: str | Path) -> SavedChat:
        """Resume a save file; on any error the session is unchanged."""
        saved = read_save(path)
        self.configure(config_from(saved.settings, self.config))  # may fail: nothing changed yet
        self.system, self.messages = saved.system, [dict(m) for m in saved.messages]
        if saved.models.get("target") not in (None, self.settings.target):
            self.notify(f"the save was made with target {saved.models['target']}; "
                        f"continuing with {self.settings.target}")
        return saved

    # -- slash commands ------------------------------------------------------------------
    def command(self, line: str) -> CommandResult:
        """Run one slash command; a SpecgenError means the session is unchanged."""
        name, _, arg = line.strip()[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        if name in ("exit", "quit"):
            return CommandResult(exit=True)
        if name in ("help", "?"):
            return CommandResult(HELP)
        if name == "reset":
            self.reset()
            return CommandResult("conversation cleared" + (" (the system prompt stays)" if self.system else ""))
        if name == "system":
            if arg == "--clear":
                self.set_system(None)
                return CommandResult("system prompt removed")
            if not arg:
                return CommandResult(f"system prompt: {self.system}" if self.system else "no system prompt")
            self.set_system(arg)
            return CommandResult("system prompt set")
        if name == "stats":
            return CommandResult("\n".join(self.totals.lines()), data={"totals": self.totals.as_dict()})
        if name == "method":
            if arg:
                self.set_method(arg)
            choices = ", ".join(m.value for m in Method)
            return CommandResult(f"method: {self.config.method.value} (choices: {choices})")
        if name == "set":
            if arg:
                option, _, value = arg.replace("=", " ", 1).partition(" ")
                if not value.strip():
                    raise ConfigError("/set needs a name and a value, like /set temperature 0.7")
                self.set_option(option, value)
            shown = settings_dict(self.config)
            return CommandResult(" · ".join(f"{k} {shown[k]}" for k in ("method", *SETTING_NAMES)),
                                 data={"settings": shown})
        if name in ("save", "load"):
            if not arg:
                raise ConfigError(f"/{name} needs a file name, like /{name} chat.json")
            if name == "save":
                return CommandResult(f"saved {len(self.messages)} messages to {self.save(arg)}")
            self.load(arg)
            return CommandResult(f"loaded {len(self.messages)} messages from {arg}")
        raise ConfigError(f"unknown command /{name}; /help lists the commands")


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file in the same directory, then rename over `path`."""
    try:
        handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise SaveFileError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise SaveFileError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_save(path: str | Path) -> SavedChat:
    """Read and validate a save file; anything wrong is one SaveFileError line."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SaveFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SaveFileError(f"{path} is not a specgen chat save (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise SaveFileError(f"{path} is not a specgen chat save: invalid JSON at line {exc.lineno} "
                            f"column {exc.colno} ({exc.msg})") from None
    if not isinstance(data, dict) or data.get("format") != SAVE_FORMAT:
        raise SaveFileError(f"{path} is not a specgen chat save (no \"format\": \"{SAVE_FORMAT}\")")
    if data.get("version") != SAVE_VERSION:
        raise SaveFileError(f"{path} has save format version {data.get('version')!r}; "
                            f"this specgen reads version {SAVE_VERSION}")
    system, messages = data.get("system"), data.get("messages")
    if system is not None and not isinstance(system, str):
        raise SaveFileError(f"{path}: \"system\" must be text or null")
    if not isinstance(messages, list):
        raise SaveFileError(f"{path}: \"messages\" must be a list")
    for i, m in enumerate(messages):
        if (not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str)
                or not isinstance(m.get("interrupted", False), bool)):
            raise SaveFileError(f"{path}: messages[{i}] needs \"role\" (user or assistant) and "
                                f"\"content\" text")
    settings = data.get("settings", {})
    if not isinstance(settings, dict):
        raise SaveFileError(f"{path}: \"settings\" must be an object")
    known = {k: v for k, v in settings.items() if k in settings_dict(GenerationConfig())}
    try:
        config_from(known)
    except ConfigError as exc:
        raise SaveFileError(f"{path}: {exc}") from None
    models = data.get("models") if isinstance(data.get("models"), dict) else {}
    return SavedChat(system or None, [dict(m) for m in messages], known, models)

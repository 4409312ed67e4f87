"""A conversation with the pair loaded in this process: the engine state kept between turns.

Cache reuse: each turn renders the whole conversation and hands the previous DecodeState to
`run.generate`; the engine keeps the longest common prefix of both caches, so a turn prefills
only its new tokens, and anything that changes earlier tokens (dropped turns, a new system
prompt, a template that re-renders old turns) falls back from the first difference. The
conversation itself (turns, settings, commands, totals, saves) is conversation.py's.
"""

from __future__ import annotations

from typing import Callable

from specgen.chat.conversation import Conversation
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.decoding import run
from specgen.decoding.build import build_engine, resolve_draft_length
from specgen.decoding.prompts import render_chat
from specgen.decoding.views import Outcome
from specgen.errors import ConfigError, PromptError
from specgen.runtime.pair import Pair, load_draft_alone


def load_chat_draft(settings: ModelSettings, target, quiet: bool = False):
    """Load the draft alone, placed and quantized as a pair's draft is (for /method and /load)."""
    return load_draft_alone(settings, target, quiet)


class LocalBackend:
    """Replies from a pair in this process, the engine's caches kept between turns."""

    def __init__(
        self,
        pair: Pair,
        settings: ModelSettings,
        config: GenerationConfig,
        notify: Callable[[str], None],
        reuse_cache: bool = True,
        quiet: bool = False,
    ):
        self.pair, self.settings, self.notify, self.quiet = pair, settings, notify, quiet
        self.reuse_cache = reuse_cache  # False: every turn prefills from scratch (for measurements)
        config, _ = resolve_draft_length(pair, config)  # what replies follow: the device's k chosen
        self.config = config
        self.state = None  # the engine's DecodeState after the last turn
        self.engine = build_engine(pair, config)
        self._drafter_key = self._key(config)
        self._rendered: tuple[list[dict], list[int]] = ([], [])
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptError(
                "the target's tokenizer has no chat template; specgen chat needs one",
                hint="use `specgen run --raw` for base models",
            )

    @property
    def tokenizer(self):
        return self.pair.target.tokenizer

    @property
    def target_name(self) -> str:
        return self.pair.target.name

    @property
    def draft_name(self) -> str | None:
        return self.pair.draft.name if self.pair.draft is not None else None

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def render(self, messages: list[dict]) -> list[int]:
        """The messages through the chat template, ready for a reply (the last one remembered)."""
        if self._rendered[0] != messages:
            ids = render_chat(self.tokenizer, messages)
            self._rendered = ([dict(m) for m in messages], ids)
        return self._rendered[1]

    def count(self, messages: list[dict]) -> int:
        return len(self.render(messages))

    def reply(self, messages: list[dict], config: GenerationConfig, renderer) -> tuple[Outcome, int]:
        """(`config` is the conversation's; this pair decodes with `self.config`, the same with
        a draft length left to the device chosen by `configure`.)"""
        config = self.config
        ids = self.render(messages)
        if not self.reuse_cache:
            self._fresh()
        try:
            outcome = run.generate(self.engine, self.tokenizer, ids, config, renderer, state=self.state)
        except BaseException:
            # Ctrl-C outside generate's own guard, or a failure: the caches may be mid-update
            self._fresh()
            raise
        self.state = outcome.state
        if outcome.interrupted and not self._resumed(outcome.state, ids):
            self._fresh()  # Ctrl-C during the prefill: the state's ids no longer describe its cache
            return outcome, 0
        return outcome, outcome.state.reused_tokens if outcome.state is not None else 0

    @staticmethod
    def _resumed(state, ids: list[int]) -> bool:
        return state is not None and state.prompt_length == len(ids) and state.ids[: len(ids)] == ids

    def _fresh(self) -> None:
        """Forget both caches: the next turn prefills from scratch (a new drafter, too)."""
        self.state = None
        self.engine = build_engine(self.pair, self.config)

    @staticmethod
    def _key(config: GenerationConfig) -> tuple:
        """What the drafter is built from: a change means a new drafter (with an empty cache)."""
        m = config.method
        if m.is_tree:
            return m, config.branching, config.beam_width, config.depth
        return m, config.draft_tokens if m is Method.LOOKUP_CHAIN else None, config.draft_confidence

    def configure(self, config: GenerationConfig) -> None:
        """Load the draft model where `config` needs it, choose the device's draft length where
        it is left to the device (/set draft_tokens device), and build a new drafter where it
        changes.

        The target's cache is kept even when the drafter changes: the new engine takes it over,
        and its drafter, empty, is prefilled from the conversation by the next turn.
        """
        if config.method.needs_draft_model and self.pair.draft is None:
            if not self.settings.draft:
                raise ConfigError(
                    f"method {config.method.value} needs a draft model; start chat with --draft MODEL"
                )
            self.notify(f"loading the draft model {self.settings.draft}")
            self.pair.draft = load_chat_draft(self.settings, self.pair.target, quiet=self.quiet)
        config, _ = resolve_draft_length(self.pair, config)
        key = self._key(config)
        if key != self._drafter_key:
            self.engine = build_engine(self.pair, config, after=self.engine)
            self._drafter_key = key
        self.config = config


class ChatSession(Conversation):
    """A conversation whose replies come from `pair`, loaded in this process."""

    def __init__(
        self,
        pair: Pair,
        settings: ModelSettings,
        config: GenerationConfig,
        system: str | None = None,
        messages: list[dict] | None = None,
        *,
        notify: Callable[[str], None] | None = None,
        reuse_cache: bool = True,
        quiet: bool = False,
    ):
        notify = notify or (lambda message: None)
        super().__init__(
            LocalBackend(pair, settings, config, notify, reuse_cache, quiet),
            settings,
            config,
            system,
            messages,
            notify=notify,
        )

    @property
    def pair(self) -> Pair:
        return self.backend.pair

    @property
    def engine(self):
        return self.backend.engine

    @property
    def state(self):
        return self.backend.state

"""What bench measures: a runner generates one prompt with one method and reports a
Generation, built from a Stats (the one counter) plus the wall-clock figures bench adds; once
measured, the same Generation is bench's record of it (its JSON and CSV row).

Engine methods count everything; the reference columns (transformers, llama.cpp) count what
their libraries let them see, which `known` says.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Callable, Protocol

from specgen.bench.report import RECORD_FIELDS, with_old_keys
from specgen.config import GenerationConfig, Method
from specgen.decoding.build import build_engine
from specgen.decoding.run import timed
from specgen.decoding.stats import Stats, histogram


class Known(enum.Flag):
    """Which of a Generation's Stats figures its runner could count (the others are unknown)."""

    NONE = 0
    FORWARDS = enum.auto()  # target forwards
    DRAFTS = enum.auto()  # drafted, accepted, the accepted-length histogram (their time also needs TIMES)
    TIMES = enum.auto()  # prefill, verify (and with DRAFTS draft) time


def _counted(flag: Known, read: Callable[[Stats], object]) -> property:
    """A Generation's figure read from its Stats where its runner could count it (`flag`), else None."""
    return property(lambda generation: read(generation.stats) if flag in generation.known else None)


@dataclass
class Generation:
    """One generation of one prompt by one method: what its runner reports (the ids, the
    wall-clock figures, its Stats and which of their figures the runner could count) and, once
    measured, where (prompt, repeat, the memory peak). Its figures are read from the Stats;
    those the runner could not count are None."""

    token_ids: list[int]
    seconds: float  # wall time from the call to the last token on the host
    ttft_seconds: float | None  # wall time to the first new token (prefill included)
    first_tokens: int  # tokens that arrived together with the first one
    stats: Stats
    known: Known = Known.NONE
    # where it was measured (bench/measure.py sets them)
    prompt_id: str = ""
    category: str = ""
    method: str = ""  # the column's name (a variant, a reference)
    repeat: int = 0
    prompt_tokens: int = 0
    peak_memory_bytes: int | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def measured(self) -> Stats:
        """Its Stats with bench's wall-clock figures (the tokens the runner returned, the time from
        the call to the last token, the first token's arrival): what every rate here is read from."""
        return replace(
            self.stats,
            new_tokens=self.new_tokens,
            seconds=self.seconds,
            time_to_first_token=self.ttft_seconds,
            first_tokens=self.first_tokens,
        )

    @property
    def wall_tokens_per_second(self) -> float:
        """New tokens over the whole wall time, the same for every method."""
        return self.measured.wall_tokens_per_second

    @property
    def after_first_tokens_per_second(self) -> float | None:
        """Tokens after the first arrival over the time after it, the same for every method (not
        Stats.decode_tokens_per_second, which is over the time after prefill)."""
        return self.measured.after_first_tokens_per_second

    # figures of the Stats that the runner counted (`known`), else None
    target_forwards = _counted(Known.FORWARDS, attrgetter("target_forwards"))
    acceptance_rate = _counted(Known.DRAFTS, attrgetter("acceptance"))
    drafted = _counted(Known.DRAFTS, attrgetter("drafted"))
    accepted = _counted(Known.DRAFTS, attrgetter("accepted"))
    accepted_length_histogram = _counted(Known.DRAFTS, lambda s: histogram(s.accepted_lengths))
    draft_seconds = _counted(Known.DRAFTS | Known.TIMES, attrgetter("draft_seconds"))  # drafts, and timed
    # the first round a draft model drafted (mostly its read of the prompt), in draft_seconds and drafted
    read_seconds = _counted(Known.DRAFTS | Known.TIMES, attrgetter("read_seconds"))
    read_drafted = _counted(Known.DRAFTS, attrgetter("read_drafted"))
    prefill_seconds = _counted(Known.TIMES, attrgetter("prefill_seconds"))
    verify_seconds = _counted(Known.TIMES, attrgetter("verify_seconds"))

    @property
    def tokens_per_target_forward(self) -> float | None:
        return self.measured.tokens_per_target_forward if self.target_forwards else None

    @property
    def stop_reason(self) -> str | None:
        return self.stats.stop

    def record(self) -> dict:
        """The flat row of bench's JSON and CSV (RECORD_FIELDS, and the keys kept for a release)."""
        return with_old_keys(
            {
                name: list(self.token_ids) if name == "token_ids" else getattr(self, name)
                for name in RECORD_FIELDS
            }
        )


class Runner(Protocol):
    """A method under test. `config.method` is ignored: the runner knows its own method."""

    name: str

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Generation: ...


@dataclass(frozen=True)
class MethodSpec:
    """A column bench can measure: its name, whether it drafts with the run's --draft model,
    how its runner is built on a pair, and what it is (the JSON's description)."""

    name: str
    needs_draft: bool
    build: Callable[[object], Runner]  # Pair -> Runner
    description: str


class EngineRunner:
    """A specgen method through the Engine, with a fresh engine (and drafter cache) per call,
    so a repeat cannot reuse the draft cache of the run before it, nor draft from its text."""

    def __init__(self, pair, method: Method, name: str | None = None, overrides: dict | None = None):
        self.pair, self.method, self.name = pair, method, name or method.value
        self.overrides = overrides or {}

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Generation:
        config = replace(config, method=self.method, **self.overrides)
        self.pair.memories.clear()  # nor a suffix memory of the runs before it: its own text only
        ids, stats, seconds, first = timed(
            build_engine(self.pair, config), prompt_ids, config, label=self.name
        )
        known = (
            Known.FORWARDS | Known.TIMES | (Known.DRAFTS if self.method is not Method.PLAIN else Known.NONE)
        )
        return Generation(ids, seconds, stats.time_to_first_token, first, stats, known)

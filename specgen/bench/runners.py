"""What bench measures: a runner generates one prompt with one method and reports a
Generation, built from a Stats (the one counter) plus the wall-clock figures bench adds.

Engine methods count everything; the reference columns (transformers, llama.cpp) count what
their libraries let them see, which `known` says.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Protocol

from specgen.config import GenerationConfig, Method
from specgen.decoding.build import build_engine
from specgen.decoding.run import timed
from specgen.decoding.stats import Stats


class Known(enum.Flag):
    """Which of a Generation's Stats figures its runner could count (the others are unknown)."""

    NONE = 0
    FORWARDS = enum.auto()  # target forwards
    DRAFTS = enum.auto()  # drafted, accepted, the accepted-length histogram, draft time
    TIMES = enum.auto()  # prefill and verify time


@dataclass
class Generation:
    """One generation as a runner reports it."""

    token_ids: list[int]
    seconds: float  # wall time from the call to the last token on the host
    ttft_seconds: float | None  # wall time to the first new token (prefill included)
    first_tokens: int  # tokens that arrived together with the first one
    stats: Stats
    known: Known = Known.NONE


class Runner(Protocol):
    """A method under test. `config.method` is ignored: the runner knows its own method."""

    name: str

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Generation: ...


class EngineRunner:
    """A specgen method through the Engine, with a fresh engine (and drafter cache) per call,
    so a repeat cannot reuse the draft cache of the run before it."""

    def __init__(self, pair, method: Method, name: str | None = None, overrides: dict | None = None):
        self.pair, self.method, self.name = pair, method, name or method.value
        self.overrides = overrides or {}

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Generation:
        config = replace(config, method=self.method, **self.overrides)
        ids, stats, seconds, first = timed(build_engine(self.pair, config), prompt_ids, config, label=self.name)
        known = Known.FORWARDS | Known.TIMES | (Known.DRAFTS if self.method is not Method.PLAIN else Known.NONE)
        return Generation(ids, seconds, stats.time_to_first_token, first, stats, known)

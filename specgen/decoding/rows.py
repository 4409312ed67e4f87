"""One row of the engine's batch: its committed sequence, cache row, sampling, budget and the
draft-length policy it keeps across chat turns (engine.py drives it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specgen.config import GenerationConfig, SamplingConfig
from specgen.decoding.length import LengthPolicy
from specgen.decoding.replay import window_start
from specgen.runtime import kvcache


@dataclass
class DecodeState:
    """One row: its committed sequence; the cache row holds all of it but the last token."""

    ids: list[int]
    cache: kvcache.SlotCache
    prompt_length: int
    sampling: SamplingConfig
    generator: torch.Generator | None = field(default=None, repr=False)
    length: LengthPolicy | None = None  # the draft-length policy (length.py), kept across chat turns
    row: int = 0  # this sequence's row in the cache (and in the drafter)
    index: int = 0  # the prompt's position in the generation's input
    budget: int = 0  # new tokens allowed (max_new_tokens within the context)
    context_bound: bool = False  # the budget was cut by the context length
    verified: int = 0  # deterministic mode: length of the replay-verified prefix of ids
    reused_tokens: int = 0  # cache positions kept from the row's previous generation
    held: bool = False  # the batch's width cap kept the row from drafting (its draft is behind)
    allowed: int = 0  # held: rounds in a row since the cap allowed drafting again
    prefill_seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    stop: str | None = None

    def limit(self, config: GenerationConfig) -> int:
        """The length this row's fast path may reach before it must stop (or replay)."""
        end = self.prompt_length + self.budget
        if config.deterministic:
            start = window_start(max(self.verified, self.prompt_length), self.prompt_length,
                                 config.verify_window)
            end = min(end, start + config.verify_window)
        return end

    def final_ids(self, config: GenerationConfig) -> list[int]:
        """The generated tokens that are final: all of them, or in deterministic mode the
        replay-verified ones."""
        end = max(self.verified, self.prompt_length) if config.deterministic else len(self.ids)
        return self.ids[self.prompt_length: end]

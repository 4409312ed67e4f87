"""One row of the engine's batch: its committed sequence, cache row, sampling, budget and the
draft-length policy it keeps across chat turns (engine.py drives it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.feed import Request
from specgen.decoding.floor import NO_FLOOR, NONE, Floor, NoFloor
from specgen.decoding.length import LengthPolicy, make_policy
from specgen.decoding.replay import window_start
from specgen.decoding.shapes import fit_tree, tree_nodes
from specgen.runtime import kvcache

RESUME_TOKENS = 32  # tokens a row held back by the width cap needs left to draft again
# rounds in a row the cap must allow drafting before a held row drafts again: a batch narrows
# for a round whenever a request ends and the next has not arrived yet (2 clients sending one
# request after another), and a catch-up for that one round cost 2 clients 5-7% of plain
RESUME_ROUNDS = 3


def _seeded(sampling: SamplingConfig, config: GenerationConfig) -> bool:
    """A seeded sampled row outside deterministic mode: its draws depend on its draft lengths, so
    the same seed gives the same text only where k does not depend on timing (no floor)."""
    return not sampling.greedy and sampling.seed is not None and not config.deterministic


@dataclass
class DecodeState:
    """One row: its committed sequence; the cache row holds all of it but the last token."""

    ids: list[int]
    cache: kvcache.SlotCache
    prompt_length: int
    config: GenerationConfig  # its own: drafting, budget and law (the request's)
    generator: torch.Generator | None = field(default=None, repr=False)
    length: LengthPolicy | None = None  # the draft-length policy (length.py), kept across chat turns
    length_for: tuple = ()  # the (schedule, most tokens, cost) it was made for: another makes a new one
    floor: Floor | NoFloor = NO_FLOOR  # the ceiling its measured rounds put on its draft length (floor.py)
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
    stop_ids: frozenset[int] = frozenset()  # the ids that end this row (the engine's, the request's)
    prompt_logprobs: tuple = ()  # asked for: the prompt's tokens 2.. under the target (events.Joined)

    @property
    def sampling(self) -> SamplingConfig:
        return self.config.sampling

    def begin(
        self,
        request: Request,
        reused: int,
        started: float,
        context_length: int,
        cost: float,
        ceiling: int = NONE,
    ) -> None:
        """The row starts on `request`'s prompt, `reused` of its tokens already in the cache. A
        chat turn's row keeps its draft-length policy (what it learned of the draft) while the
        schedule, the draft length and the method's cost stay what it was made for. `cost`: one
        draft token of its method against a target step (build.TABLE), for adaptive schedules;
        `ceiling`: where a fresh floor starts (floor.first_ceiling)."""
        prompt = request.ids
        self.ids, self.prompt_length, self.index = list(prompt), len(prompt), request.index
        self.config, self.reused_tokens, self.verified = request.config, reused, len(prompt)
        config = request.config
        self.stop, self.started, self.held, self.allowed = None, started, False, 0
        made_for = (config.schedule, config.round_tokens, cost)
        if self.length is None or self.length_for != made_for:  # a chat's /set or /method changed it
            self.length, self.length_for = make_policy(*made_for[:2], cost=cost), made_for
            self.floor = NO_FLOOR
        # a turn that continues the row keeps what its floor learned, where it still has one
        if not config.floor or _seeded(request.sampling, config):
            self.floor = NO_FLOOR
        elif not isinstance(self.floor, Floor):
            self.floor = Floor.at(ceiling)
        self.budget = min(request.max_new_tokens, context_length - self.prompt_length)
        self.context_bound = self.budget < request.max_new_tokens

    def wanted(self) -> int:
        """How many tokens the row may draft this round, before any width cap (0: none; a plain
        engine's drafter, NoDrafter, proposes nothing whatever it is allowed)."""
        config = self.config
        remaining = self.limit() - len(self.ids)
        if config.method is Method.PLAIN:
            return 0
        if config.method.is_tree:  # the largest tree within the floor's ceiling, shallower near the end
            return tree_nodes(config.tree_levels, self.floor.limit(), remaining - 1)
        k = min(self.length.next_k(), remaining - 1)
        return max(min(k, self.floor.limit()), 0) if k > 0 else 0

    def draft_length(self) -> int:
        """The most tokens the row would draft now: its draft-length policy's, under its floor's
        ceiling (0: plain rounds), before any width cap."""
        config = self.config
        if config.method is Method.PLAIN:
            return 0
        if config.method.is_tree:
            return sum(fit_tree(config.tree_levels, self.floor.ceiling))
        return min(self.length.next_k(), self.floor.ceiling) if self.length is not None else 0

    def limit(self) -> int:
        """The length this row's fast path may reach before it must stop (or replay)."""
        config, end = self.config, self.prompt_length + self.budget
        if config.deterministic:
            start = window_start(
                max(self.verified, self.prompt_length), self.prompt_length, config.verify_window
            )
            end = min(end, start + config.verify_window)
        return end

    def capped(self, k: int, cap: int) -> int:
        """The row's draft length under the batch's width cap. A row the cap held to plain rounds
        has fallen behind in the draft's cache; it drafts again only once the cap allowed drafting
        RESUME_ROUNDS rounds in a row, with RESUME_TOKENS left to repay the catch-up (so a wide
        batch's rows finish plain as it narrows, and a batch narrowed for a round stays plain)."""
        if cap == 0:
            self.held, self.allowed = self.held or k > 0, 0
            return 0
        if self.held:
            self.allowed += 1
            if self.allowed < RESUME_ROUNDS or self.limit() - len(self.ids) < RESUME_TOKENS:
                return 0
            self.held = False
        return min(k, cap)

    def final_ids(self) -> list[int]:
        """The generated tokens that are final: all of them, or in deterministic mode the
        replay-verified ones."""
        end = max(self.verified, self.prompt_length) if self.config.deterministic else len(self.ids)
        return self.ids[self.prompt_length : end]

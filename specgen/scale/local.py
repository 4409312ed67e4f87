"""A prompt set's decoder: the pair loaded once, one engine on it, prompts decoded with dynamic
batching and each outcome handed back as its row finishes. A local `run --output` uses one in
its own process; every Ray actor holds one (cluster.py), so both decode with the same engine."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from specgen.config import GenerationConfig, ModelSettings
from specgen.decoding import run as driver
from specgen.decoding.build import build_engine, resolve_draft_length
from specgen.decoding.prompts import encode_prompt
from specgen.decoding.views import Outcome
from specgen.runtime.pair import load


class Decoder:
    def __init__(
        self,
        settings: ModelSettings,
        config: GenerationConfig,
        raw: bool = False,
        system: str | None = None,
        quiet: bool = True,
        threads: int | None = None,
    ):
        if threads:
            torch.set_num_threads(threads)
        self.pair = load(settings, config.method, quiet=quiet)
        self.pair.keep_prefixes()  # prompts of a set often share a system prompt or a preamble
        self.config, _ = resolve_draft_length(self.pair, config)
        self.engine = build_engine(self.pair, self.config)
        self.raw, self.system = raw, system

    def encode(self, items: list[tuple[int, str]]) -> list[list[int]]:
        """Each prompt's ids; one the engine cannot decode is a PromptError naming it by its
        place in the whole set (index + 1), whichever part of the set `items` are."""
        prompts = [
            encode_prompt(self.pair.target.tokenizer, text, self.raw, self.system) for _, text in items
        ]
        for (index, _), ids in zip(items, prompts):
            self.engine.check_prompt(ids, f"prompt {index + 1}")
        return prompts

    def run(self, items: Iterable[tuple[int, str]], batch_size: int = 1) -> Iterator[tuple[int, Outcome]]:
        """(index, prompt text) pairs -> (index, Outcome) as each row finishes."""
        items = list(items)
        tokenizer = self.pair.target.tokenizer
        prompts = self.encode(items)
        for position, outcome in driver.finished_rows(
            self.engine, tokenizer, prompts, self.config, batch_size
        ):
            yield items[position][0], outcome

    def decode(self, items: list[tuple[int, str]], batch_size: int = 1) -> list[tuple[int, Outcome]]:
        """`run` to the end, as one list: a Ray actor's answer for one batch of the queue."""
        return list(self.run(items, batch_size))

"""Where a generation's rows come from: a request per prompt, and the feeds the loop takes
them from (a fixed list here; the server's queue in serve/scheduler.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from specgen.config import GenerationConfig, SamplingConfig


@dataclass(frozen=True)
class Request:
    """One prompt to decode, with its own settings: a row of the batch once it joins. Rows of
    one batch may each bring other settings, their drafting (method, draft length, tree shape,
    deterministic window) included: every row is its own (drafters/mixed.py)."""

    ids: list[int]
    index: int  # its position in the input (events carry it)
    # its drafting, token budget and law (and, in deterministic mode, the seed of its keyed choices)
    config: GenerationConfig
    seed: int | None = None  # its random stream (None: fresh entropy)
    ignore_eos: bool = (
        False  # decode past the model's end-of-sequence tokens (a load generator's fixed lengths)
    )
    stop_ids: frozenset[int] = frozenset()  # more token ids that end it
    # the target's log-probability of each prompt token after the first (and sampling.logprobs
    # alternatives), from a prefill of the whole prompt (no prefix cache, no chunks)
    prompt_logprobs: bool = False
    prompt_top: int = 0  # alternatives per prompt token (vLLM's prompt_logprobs: N), beside sampling.logprobs

    @property
    def sampling(self) -> SamplingConfig:
        return self.config.sampling

    @property
    def max_new_tokens(self) -> int:
        return self.config.max_new_tokens


class Feed(Protocol):
    """Where a generation's rows come from: `take(room)` gives at most `room` requests that may
    join now, `dropped()` the indices of running rows to end before the next round (a client
    that went away). The loop ends once no row runs and `take` gives nothing."""

    def take(self, room: int) -> list[Request]: ...

    def dropped(self) -> set[int]: ...


class ListFeed:
    """A fixed list of requests, all waiting from the start (each its own settings);
    `ListFeed.of`: prompts with the run's settings."""

    def __init__(self, requests: list[Request]):
        self.waiting = deque(requests)

    @classmethod
    def of(cls, prompts: list[list[int]], config: GenerationConfig) -> ListFeed:
        """The prompts with one config; prompt i samples with seed + i."""
        seed = config.sampling.seed
        return cls(
            [
                Request(list(ids), i, config, None if seed is None else seed + i)
                for i, ids in enumerate(prompts)
            ]
        )

    def take(self, room: int) -> list[Request]:
        return [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]

    def dropped(self) -> set[int]:
        return set()

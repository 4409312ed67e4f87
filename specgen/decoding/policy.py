"""How an engine schedules its rounds (`Policy`), given when it is built: the width caps a
server measured, the prefill chunk, when a first token comes from the prefill. Never what a
round commits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specgen.config import GenerationConfig
from specgen.decoding.staging import PREFILL_CHUNK

# prompt tokens past which a row's first token comes from its prefill (of what the caches lack, its
# last token at least), not from a first round: it waits for no draft model to read the prompt
# (benchmarks/server.md). The prompt's length decides, never the caches, so a seeded request draws
# the same tokens cached or not. A shorter prompt (the tests of the first token's law) has its
# first token speculated like every other.
PROMPT_CATCH_UP = 4
DRAFT_COST = 0.38  # a draft model's token against a target step, where an engine is told no other
MAX_DRAFT = 256  # more than any round drafts (config.draft_tokens <= 64, trees <= 256 nodes)


def no_cap(width: int, config: GenerationConfig) -> int:
    """No width cap: a row drafts what its own policy asks at every batch width."""
    return MAX_DRAFT


def any_number(width: int, drafting: int) -> bool:
    """No company needed: any number of a batch's rows may draft with the draft model."""
    return True


def capped(config: GenerationConfig) -> bool:
    """Whether a row keeps to a server's width caps: it drafts with the draft model, and its
    request did not set its own draft length (which it then keeps at every width)."""
    return config.method.needs_draft_model and config.floor


@dataclass(frozen=True)
class Policy:
    """How an engine schedules its rounds, given when it is built (a server's from measured
    costs, serve/scheduler.py); never what a round commits."""

    # the most tokens a row of this config may draft when `width` rows share a round
    # (widths.WidthCosts: past some width plain rounds win)
    width_cap: Callable[[int, GenerationConfig], int] = no_cap
    # whether this many of `width` rows (the `capped` ones that would draft this round) may
    # draft with the draft model: its step holds up the rest, so a few alone may not repay it
    # (widths.WidthCosts.least); those rows then run a plain round
    together: Callable[[int, int], bool] = any_number
    # a longer prompt joining rows that decode is prefilled this many tokens per round
    # (staging.py); 0: whole. Only on a CPU, where a long prefill stalls the others for seconds
    prefill_chunk: int = PREFILL_CHUNK
    # new prompt tokens past which a row's first token comes from its prefill; larger
    # speculates the first token of longer prompts too (tests of that token's law)
    prompt_catch_up: int = PROMPT_CATCH_UP

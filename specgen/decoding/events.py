"""What the engine reports, in token ids: per row, a join, rounds, replays and a finish
(engine.RowEvent carries them with the row's state).

Host data only (no tensors, no torch import): the driver folds these into Stats and turns them
into text, and a client process can read them without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


class StopReason:
    EOS = "eos"
    LENGTH = "length"
    CONTEXT = "context"
    CANCELLED = "cancelled"  # the feed dropped the row (its client went away)


@dataclass(frozen=True)
class TreeInfo:
    """A tree round's shape in host ids, for --show-tree and statistics."""

    tokens: list[int]  # node tokens, index 0 the root
    parents: tuple[int, ...]
    accepted_nodes: list[int]  # the accepted path, root excluded
    tried: list[int]  # nodes tried and rejected


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target (its logits as the model gives them,
    before temperature, top-k or top-p), and the most likely tokens at its position."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first
    rank: int = 0  # 1 for the most likely token; 0 where it was not counted (decoded tokens)


@dataclass(frozen=True)
class Joined:
    """A row started: its prompt is in the caches."""

    prompt_tokens: int
    reused_tokens: int  # cache positions kept from the row's previous generation (a chat turn)
    prefill_seconds: float
    # the request asked (Request.prompt_logprobs): prompt tokens 2.. under the target, from the prefill
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class RoundResult:
    """What one round did for one row, in token ids. `emitted` is what was committed."""

    draft_tokens: list[int]  # everything the drafter proposed (empty for plain decoding)
    accepted: int  # draft tokens accepted by the target's rule
    target_token: int  # the target's own token (correction or bonus)
    emitted: list[int]  # committed this round: accepted drafts + target token, cut at EOS/length
    draft_seconds: float
    verify_seconds: float
    stop: str | None = None  # a StopReason once generation has ended
    rejected: tuple[int, ...] = ()  # draft tokens tried or discarded this round (shown red)
    tree: TreeInfo | None = None  # the proposal's tree, when it was not a single chain
    logprobs: tuple[TokenLogprob, ...] = ()  # one per emitted token, when the row's sampling asks

    @property
    def accepted_emitted(self) -> int:
        """Draft tokens among the emitted ones (fewer than `accepted` when cut at EOS/length)."""
        return min(self.accepted, len(self.emitted))

    @property
    def target_emitted(self) -> bool:
        return len(self.emitted) > self.accepted


@dataclass(frozen=True)
class ReplayResult:
    """One deterministic-mode replay of a window: what it checked, and what it rolled back."""

    window_start: int  # absolute position of the window's first token
    checked: int  # unverified tokens compared in this replay
    rolled_back: tuple[int, ...]  # fast-path tokens discarded (empty when all matched)
    correction: int | None  # the replay's token at the first mismatch
    verified: int  # committed-and-verified sequence length afterwards
    seconds: float
    stop: str | None = None  # a StopReason once generation has ended


@dataclass(frozen=True)
class Finished:
    """The row is done (its caches may already hold the next row)."""

    stop: str | None  # a StopReason; None when the generation was cut short


Event = Union[Joined, RoundResult, ReplayResult, Finished]

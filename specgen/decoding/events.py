"""What the engine reports, in token ids: per row, a join, rounds, replays and a finish
(engine.RowEvent carries them with the row's state). The driver gives rounds and replays their
text (views.round_text, views.replay_text): the same event goes on to the renderers and, as
JSON, to a client of the server.

Host data only (no tensors, no torch import): the driver folds these into Stats and turns them
into text, and a client process can read them without loading torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union


class StopReason:
    EOS = "eos"
    LENGTH = "length"
    CONTEXT = "context"
    CANCELLED = "cancelled"  # the feed dropped the row (its client went away)


def is_chain(parents: tuple[int, ...]) -> bool:
    """A tree's shape (node j's parent is parents[j - 1], node 0 the root) is one chain."""
    return parents == tuple(range(len(parents)))


class Origin(str, enum.Enum):
    """Where a round's draft came from: the live view, the playground and the statistics tell
    them apart."""

    MODEL = "model"  # a draft model or an EAGLE-3 head
    TEXT = "text"  # the request's own text (prompt lookup)
    MEMORY = "memory"  # the suffix memory: earlier requests' text (runtime/suffix.py)


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
    # the draft model reads and drafts nothing for this row: reading its prompt would cost more
    # than drafting can save (drafters/model.py); its rounds are plain ones, or lookup's
    declined: bool = False


@dataclass(frozen=True)
class RoundResult:
    """One row's round, from the verdict (verify.py) to the live view: what was proposed, what
    the target's rule kept, what the engine committed of it and, once the driver pushed it
    through the row's text stream, its text.

    Nodes as in `drafters.base.Proposal`: 0 is the root, node j >= 1 is `draft_tokens[j - 1]`
    and `parents[j - 1]` its parent. `emitted` is what was committed: the path's tokens and the
    target's own, cut at EOS or the length limit. A client of the server rebuilds the same round,
    ids and text, from the live JSON (serve/output.py writes it, cli/remote.py reads it).

    Its text is empty until the driver gives it (views.round_text): the engine's own events
    carry ids only."""

    draft_tokens: list[int] = field(
        default_factory=list
    )  # everything the drafter proposed (none: a plain round)
    parents: tuple[int, ...] = ()  # the proposal's shape (a chain: 0, 1, .., k - 1)
    path: tuple[int, ...] = ()  # accepted nodes, root excluded, root to leaf
    target_token: int = 0  # the target's own token after the path (correction or bonus)
    tried: tuple[int, ...] = ()  # nodes tried and rejected on the way, in the order they were tried
    root: int = 0  # node 0's token: the row's last committed token when the round started
    emitted: list[int] = field(default_factory=list)  # the engine's: committed this round
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    stop: str | None = None  # a StopReason once generation has ended
    logprobs: tuple[TokenLogprob, ...] = ()  # one per emitted token, when the row's sampling asks
    # its text (views.round_text): a piece per emitted token, pushed through the row's text stream
    # in order (an empty one for a token that completes no character yet, or a special token)
    pieces: tuple[str, ...] = ()
    rejected_texts: tuple[str, ...] = ()  # each rejected draft token's own text (shown red)
    node_texts: tuple[str, ...] = ()  # a tree round: each node's text, the root first
    pending: bool = False  # deterministic mode: not yet verified by a replay
    # the row's last round: what the stream held back, now text (a character cut short, bytes
    # that form none); it completes the last token that is not special, this round's or earlier
    tail: str = ""
    origin: Origin = Origin.MODEL  # where the draft came from

    @property
    def accepted_pieces(self) -> tuple[str, ...]:
        """The accepted draft tokens' pieces (shown green)."""
        return self.pieces[: self.accepted_emitted]

    @property
    def target_piece(self) -> str:
        """The target's own token's piece; empty when the round was cut (EOS, length) before it."""
        return self.pieces[-1] if self.target_emitted and self.pieces else ""

    @property
    def accepted(self) -> int:
        """Draft tokens accepted by the target's rule."""
        return len(self.path)

    @property
    def is_chain(self) -> bool:
        return is_chain(self.parents)

    @property
    def tree(self) -> "RoundResult | None":
        """The round itself when its proposal was a tree (not one chain), else None (what
        statistics count tree rounds and their nodes by: `len(tree.tokens) - 1`)."""
        return None if self.is_chain else self

    @property
    def tokens(self) -> list[int]:
        """Each node's token, the root first."""
        return [self.root] + self.draft_tokens

    @property
    def rejected(self) -> tuple[int, ...]:
        """Draft tokens discarded this round (shown red): the rest of a chain past its accepted
        prefix, or a tree's nodes that were tried and rejected."""
        if self.is_chain:
            return tuple(self.draft_tokens[len(self.path) :])
        return tuple(self.draft_tokens[node - 1] for node in self.tried)

    @property
    def accepted_emitted(self) -> int:
        """Draft tokens among the emitted ones (fewer than `accepted` when cut at EOS/length)."""
        return min(self.accepted, len(self.emitted))

    @property
    def target_emitted(self) -> bool:
        return len(self.emitted) > self.accepted


@dataclass(frozen=True)
class ReplayResult:
    """One deterministic-mode replay of a window: what it checked, what it rolled back and,
    once the driver gave it its text (views.replay_text), that text. A client of the server
    rebuilds the same replay from the live JSON."""

    window_start: int  # absolute position of the window's first token
    checked: int  # unverified tokens compared in this replay
    rolled_back: tuple[int, ...]  # fast-path tokens discarded (empty when all matched)
    correction: int | None  # the replay's token at the first mismatch
    verified: int  # committed-and-verified sequence length afterwards
    seconds: float
    stop: str | None = None  # a StopReason once generation has ended
    # its text (views.replay_text): the discarded tokens' own texts, the correction's piece, and
    # for the replay that ended the row what the stream held back (RoundResult.tail)
    rolled_back_texts: tuple[str, ...] = ()
    correction_text: str | None = None
    tail: str = ""


@dataclass(frozen=True)
class Finished:
    """The row is done (its caches may already hold the next row)."""

    stop: str | None  # a StopReason; None when the generation was cut short


Event = Union[Joined, RoundResult, ReplayResult, Finished]

"""Drafting with a draft model of another tokenizer: the draft continues the committed TEXT.

`TextDrafter` is a Drafter (base.py) over target ids that holds a Drafter over draft ids (the
batched `ChainDrafter` in use, any drafter in tests). Per row it keeps the committed text as
draft ids, built incrementally:

* `frozen`: draft ids of the target's committed ids up to an anchor, never re-encoded;
  `anchors` holds every (target length, draft length) the anchor was at, so a rewind (a chat
  turn, a deterministic-mode rollback) returns to the last anchor it leaves whole.
* the tail after the anchor (the word being written, at most about MAX_TAIL tokens) is decoded
  and re-encoded each round, so the draft reads a partial word as its own tokenizer splits the
  whole one. Each round the anchor moves to the tail's last cut (retokenize.Bridge.cut): the
  text before it is encoded once and frozen. The cost per round is the tail, never the context.

A round: the draft context (frozen + tail) is handed to the inner drafter, which first rewinds
its cache to what it holds of that context (a re-encoded tail changes a few draft ids); the
draft ids it proposes become text and then target ids (`Bridge.proposal`), proposed as point
masses (`ProposalKind.DETERMINISTIC`, as prompt lookup's): greedy output stays the target's
token for token and sampling stays exactly the target's law under the point-mass rule. The
draft drafts greedily whatever the row samples: a point mass x is accepted with probability
q(x), so the draft's most likely text is the best guess, and the draft's laws (over another
vocabulary) could not be used anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specgen.config import GenerationConfig, SamplingConfig
from specgen.decoding.acceptance import ProposalKind
from specgen.decoding.drafters.base import EMPTY, BaseDrafter, Drafter, Proposal
from specgen.decoding.drafters.retokenize import Bridge, Seam
from specgen.text import common_prefix

GREEDY = SamplingConfig()
CHECK = 8  # committed tokens compared per round to notice a context that no longer extends a row's
DRAFT_PER_TARGET = 4  # draft cache slots reserved per target token a row may still add
RATIO_BOUNDS = (0.25, 4.0)  # draft tokens per target token assumed at most / at least


@dataclass
class RowText:
    """One row's committed text as draft ids (module docstring)."""

    lead: list[int]
    ids: list[int] = field(default_factory=list)  # the committed target ids seen so far
    frozen: list[int] = field(default_factory=list)  # draft ids of ids[:anchor]
    anchors: list[tuple[int, int]] = field(default_factory=list)  # (target length, len(frozen)), increasing
    seen: list[int] = field(default_factory=list)  # draft ids the inner drafter's cache holds a prefix of
    last: list[int] = field(default_factory=list)  # the draft context of the row's last round
    reserved: int = 0  # draft cache slots reserved for the row
    held: str = ""  # committed trailing spaces the last draft context left out (Bridge.tail)
    config: GenerationConfig | None = None  # the row's settings (the inner drafter's read rule)

    def __post_init__(self) -> None:
        self.frozen = list(self.lead)
        self.anchors = [(0, len(self.lead))]

    @property
    def anchor(self) -> int:
        return self.anchors[-1][0]

    def cut_to(self, valid: int) -> None:
        """Only the first `valid` committed target ids still hold."""
        while len(self.anchors) > 1 and self.anchors[-1][0] > valid:
            self.anchors.pop()
        del self.frozen[self.anchors[-1][1] :]
        del self.ids[valid:]
        del self.seen[len(self.frozen) :]
        del self.last[len(self.frozen) :]


class TextDrafter(BaseDrafter):
    """The Drafter protocol for a draft model of another tokenizer (module docstring)."""

    def __init__(self, inner: Drafter, bridge: Bridge):
        self.inner, self.bridge = inner, bridge
        self.rows: list[RowText] = []
        # counters (tests and reports): how rounds met the committed text
        self.seams = {seam: 0 for seam in Seam}  # rounds per seam
        self.retokenized = 0  # rounds whose re-encoded tail changed draft ids of the round before
        self.target_tokens = 0  # committed target ids frozen as draft ids ...
        self.draft_tokens = 0  # ... and the draft ids they became

    @property
    def ratio(self) -> float:
        """Draft tokens per target token in the text seen so far (1 before any)."""
        if not self.target_tokens:
            return 1.0
        return min(max(self.draft_tokens / self.target_tokens, RATIO_BOUNDS[0]), RATIO_BOUNDS[1])

    # -- rows ---------------------------------------------------------------------------------
    def join(self, row: int, prompt_ids: list[int], generator, capacity: int, config=None) -> None:
        """The prompt's text becomes draft ids once (from the last anchor a rewind kept); the
        inner drafter joins with them. The draft is greedy: it takes no generator."""
        while row >= len(self.rows):
            self.rows.append(RowText(list(self.bridge.lead)))
        state = self.rows[row]
        state.config = config
        context = self._context(state, prompt_ids)
        self._rewind_inner(row, state, context)
        state.reserved = len(context) + DRAFT_PER_TARGET * max(capacity - len(prompt_ids), 0)
        self.inner.join(row, context, None, state.reserved, config)
        state.seen = context

    def leave(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep if i < len(self.rows)]
        self.inner.leave(keep)

    def finished(self, row: int, ids: list[int]) -> None:
        if row < len(self.rows):
            self.inner.finished(row, self.rows[row].ids)

    def rewind(self, row: int, valid: int) -> None:
        if row < len(self.rows):
            state = self.rows[row]
            state.cut_to(valid)
            self.inner.rewind(row, len(state.frozen))

    def observe(self, row: int, path: list[int]) -> None:
        """Nothing to keep: the next context says what was committed, and the inner drafter's
        cache is rewound to what it shares with the next draft context."""

    def setup_seconds(self) -> float:
        return self.inner.setup_seconds()

    def declines(self, row: int) -> bool:
        return self.inner.declines(row)

    def widened(self) -> int:
        return self.inner.widened()

    # -- a round ------------------------------------------------------------------------------
    def propose(
        self, contexts: list[list[int]], ks: list[int], samplings: list[SamplingConfig], features=None
    ) -> list[Proposal]:
        drafts = []
        for row, context in enumerate(contexts):
            state = self.rows[row]
            draft = self._context(state, context)
            self._rewind_inner(row, state, draft)
            room = len(draft) + math.ceil(max(ks) * RATIO_BOUNDS[1]) + 2
            if room > state.reserved:  # a draft tokenizer finer than expected
                state.reserved = 2 * room
                self.inner.join(row, draft, None, state.reserved, state.config)
            drafts.append(draft)
        # the draft drafts about as much text as k target tokens hold (a finer tokenizer: more ids)
        draft_ks = [math.ceil(k * self.ratio) if k > 0 else 0 for k in ks]
        drafted = self.inner.propose(drafts, draft_ks, [GREEDY] * len(contexts))
        out = []
        for row, (context, k) in enumerate(zip(contexts, ks)):
            state, draft = self.rows[row], drafts[row]
            tokens = drafted[row].tokens.tolist() if k > 0 else []
            state.seen = draft + tokens
            if not tokens:
                out.append(EMPTY)
                continue
            ids, seam = self.bridge.proposal(context, state.anchor, draft, tokens, k, state.held)
            self.seams[seam] += 1
            out.append(Proposal.chain(torch.tensor(ids, dtype=torch.int64), ProposalKind.DETERMINISTIC))
        return out

    # -- the committed text as draft ids --------------------------------------------------------
    def _context(self, state: RowText, context: list[int]) -> list[int]:
        """The draft context of the committed `context`: the frozen ids (the anchor moved to
        this round's cut, what it passed encoded once) and the re-encoded tail."""
        known = len(state.ids)
        if (
            len(context) < known
            or context[max(known - CHECK, 0) : known] != state.ids[max(known - CHECK, 0) :]
        ):
            state.cut_to(common_prefix(state.ids, context))  # not an extension: a rewind we were not told of
        state.ids.extend(context[len(state.ids) :])
        cut = self.bridge.cut(context, state.anchor)
        if cut > state.anchor:
            frozen = self.bridge.draft_ids(context, state.anchor, cut)
            self.target_tokens += cut - state.anchor
            self.draft_tokens += len(frozen)
            state.frozen.extend(frozen)
            state.anchors.append((cut, len(state.frozen)))
        tail, state.held = self.bridge.tail(context, cut)
        return state.frozen + tail or list(self.bridge.filler)

    def _rewind_inner(self, row: int, state: RowText, draft: list[int]) -> None:
        """The inner drafter keeps what it holds of `draft` but its last id (a round feeds at
        least one id: the one whose logits start the draft)."""
        if common_prefix(state.last, draft) < min(len(state.last), len(draft)):
            self.retokenized += 1
        state.last = draft
        valid = min(common_prefix(state.seen, draft), len(draft) - 1)
        if valid < len(state.seen):
            self.inner.rewind(row, valid)

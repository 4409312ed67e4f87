"""One batch for every method: each row drafted by the drafter its own settings name.

A server's clients choose their drafting per request (plain, lookup, chain, a tree, a head), and
a playground races methods side by side: rows of different drafting share one batch, one target
forward per round. `Mixed` is the engine's drafter then: it keeps one drafter per drafting
(`drafting_key`: the method and what shapes its drafter, such as a tree's branching or a chain's
confidence stop), built on a row's first join (`make`), and routes each call to the rows' own
drafters, numbering each drafter's rows as it expects (0.., in batch order). Chain rows of one
setting share their drafter, so one draft forward per step serves them all; a plain row's
drafter proposes nothing; a lookup row drafts from its own text; a tree row brings its tree,
which the verify pads and masks beside the others' chains (verify.py).

What a row drafts never changes what another row commits: each row's verdict reads only its own
logits, and every row's forward is exact whatever it shares the batch with (runtime/
exact_attention.py, the int8 row-exact products).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from specgen.config import GenerationConfig, Method
from specgen.decoding.drafters.base import EMPTY, BaseDrafter, Drafter, Proposal

# drafters kept with no row to serve (a request chooses its drafting freely, `draft_confidence`
# any number: one drafter per setting kept for ever would let clients fill the memory with draft
# caches); the least recently used idle ones go first
MAX_IDLE = 8


def drafting_key(config: GenerationConfig) -> tuple:
    """What a row's drafter is built from: rows that agree on it share one drafter."""
    method = config.method
    if method is Method.PLAIN:
        return (method,)
    if method in (Method.LOOKUP, Method.SUFFIX):  # a suffix row's memory is its own (config.tenant)
        return (method,)
    if method.is_tree:  # a tree's shape and the stop on its depth
        return (method, config.branching, config.beam_width, config.depth, config.draft_confidence)
    if method is Method.LOOKUP_CHAIN:
        return (method, config.draft_confidence, config.draft_tokens)
    return (method, config.draft_confidence)


class Mixed(BaseDrafter):
    """The Drafter of a batch whose rows draft each their own way (see the module)."""

    def __init__(self, make: Callable[[GenerationConfig], Drafter], taps: tuple[int, ...] = ()):
        self.make = make
        self._taps = tuple(taps)  # an EAGLE head's layers, read by its rows (the target cache keeps them)
        self.drafters: OrderedDict[tuple, Drafter] = OrderedDict()  # least recently joined first
        self.rows: list[tuple[tuple, int]] = []  # the batch's rows: (drafting key, row in that drafter)
        self.spent = 0.0

    # -- rows ---------------------------------------------------------------------------------------
    def join(self, row, prompt_ids, generator, capacity, config) -> None:
        key = drafting_key(config)
        if row == len(self.rows):
            self.rows.append((key, sum(1 for k, _ in self.rows if k == key)))
        elif row > len(self.rows):
            raise ValueError(f"row {row} joins a batch of {len(self.rows)} rows")
        elif self.rows[row][0] != key:  # a reused row (a spare, a chat's row), drafted otherwise before
            self._drop(row)
            self.rows[row] = (key, sum(1 for k, _ in self.rows if k == key))
        self._drafter(key, config).join(self.rows[row][1], prompt_ids, generator, capacity, config)

    def leave(self, keep) -> None:
        # rows this drafter never joined (an engine that took over another's cache) hold nothing
        kept = [self.rows[i] for i in keep if i < len(self.rows)]
        for key, drafter in self.drafters.items():
            drafter.leave([sub for k, sub in kept if k == key])
        numbers: dict[tuple, int] = {}
        self.rows = []
        for key, _ in kept:
            self.rows.append((key, numbers.get(key, 0)))
            numbers[key] = numbers.get(key, 0) + 1

    def _drop(self, row: int) -> None:
        """Row `row` leaves the drafter it had; that drafter's other rows are numbered afresh."""
        key = self.rows[row][0]
        others = [i for i, (k, _) in enumerate(self.rows) if k == key and i != row]
        self.drafters[key].leave([self.rows[i][1] for i in others])
        for number, i in enumerate(others):
            self.rows[i] = (key, number)

    def finished(self, row, ids) -> None:
        if row < len(self.rows):
            key, sub = self.rows[row]
            self.drafters[key].finished(sub, ids)

    def rewind(self, row, valid) -> None:
        if row < len(self.rows):
            key, sub = self.rows[row]
            self.drafters[key].rewind(sub, valid)

    def observe(self, row, path) -> None:
        key, sub = self.rows[row]
        self.drafters[key].observe(sub, path)

    # -- a round ------------------------------------------------------------------------------------
    def propose(self, contexts, ks, samplings, features=None) -> list[Proposal]:
        """Each drafter proposes for its own rows, in its own numbering, in one call."""
        proposals: list[Proposal] = [EMPTY] * len(contexts)
        for key, drafter in self.drafters.items():
            rows = [i for i, (k, _) in enumerate(self.rows) if k == key]
            if not rows or not any(ks[i] for i in rows):
                continue
            rows.sort(key=lambda i: self.rows[i][1])
            made = drafter.propose(
                [contexts[i] for i in rows], [ks[i] for i in rows], [samplings[i] for i in rows], features
            )
            for i, proposal in zip(rows, made):
                proposals[i] = proposal
        return proposals

    # -- the rest of the protocol -------------------------------------------------------------------
    def _drafter(self, key: tuple, config: GenerationConfig) -> Drafter:
        drafter = self.drafters.pop(key, None)
        if drafter is None:
            drafter = self.make(config)
        self.drafters[key] = drafter
        busy = {k for k, _ in self.rows}
        idle = [k for k in self.drafters if k not in busy]
        for stale in idle[: max(0, len(idle) - MAX_IDLE)]:
            self.spent += self.drafters.pop(stale).setup_seconds()
        return drafter

    def setup_seconds(self) -> float:
        return self.spent + sum(d.setup_seconds() for d in self.drafters.values())

    def taps(self) -> tuple[int, ...]:
        return self._taps

    def declines(self, row: int) -> bool:
        key, sub = self.rows[row]
        return self.drafters[key].declines(sub)

    def widened(self) -> int:
        # the drafters of a batch that draft with a model (chains, trees) share one draft model,
        # whose head widens: its count
        return max((drafter.widened() for drafter in self.drafters.values()), default=0)

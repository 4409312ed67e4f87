"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the text's tail.

Owns an n-gram index over the committed sequence (prompt + generated text) and nothing else:
no model, no cache, no randomness. A round looks up the last n tokens of the context
(n = max_ngram down to min_ngram, longer first) and proposes the k tokens that followed the
most recent earlier occurrence. Proposals are point masses (`ProposalKind.DETERMINISTIC`):
greedy verification accepts the longest prefix equal to the target's argmax, and under
sampling `point_mass_sampling(x, q)` accepts x_i with probability q(x_i) and otherwise draws
from norm(max(0, q - onehot(x_i))), so the output law is still exactly q.

Cost per round is O(max_ngram) plus O(max_ngram) per token appended since the last round:
the index maps each n-gram to the positions that followed it, in increasing order, and only
the new tokens are added. The context passed to `propose` is the truth; if it no longer
extends what was indexed (a rollback, a new chat turn rendered differently), the index is cut
back to the common prefix (or rebuilt when that is cheaper). The index only decides what is
proposed, never what is emitted: a stale index would cost speed, not correctness.

How long a continuation is proposed depends on how its kind has fared (`MatchOdds`) and on
what a verify costs here (`cost`, a `VerifyCost` in target steps, measured per machine on a CPU):
a copy's length is the one whose expected accepted tokens, less what its tokens add to the
verify, are the most. A CPU's verify does not cost a line: on a Xeon with AMX 1, 2 and 5
proposed tokens cost 1.09, 1.19 and 1.20 steps, so a copy is priced as a whole, not token by
token. On text that does not repeat (a translation: 4% of lookup's tokens accepted) a one-token
match then proposes one token, or none, instead of a whole k; on code that repeats, its whole k.

A copy never holds one of the tokenizer's control tokens (`never`: a chat template's turn
markers, the end of a turn). The prompt holds them and the answer does not: a one-token match on
the template's last newline would otherwise propose `<|im_start|>assistant` as every answer's
first tokens, and a full stop would propose the user's end of turn.
"""

from __future__ import annotations

from specgen.config import SamplingConfig
from specgen.decoding.costs import VerifyCost
from specgen.decoding.drafters.base import Proposal
from specgen.decoding.events import Origin
from specgen.decoding.length import Acceptance
from specgen.text import common_prefix

HALFLIFE = 16.0  # proposals of one match length
# accepted and rejected tokens before any proposal, by match length (longer: as for 3): worth
# two tokens, with the means lookup's tokens were accepted at on every third prompt of
# prompts/*.jsonl (0.3 after one-token matches, 0.6-0.7 after two, 0.8 after three;
# benchmarks/floor.md). With one prior for all (0.5), a one-token match proposed three tokens
# at first and needed a dozen rejections before it stopped: a third of a 64-token answer's
# rounds verified copies that failed (codeedit-05: 33 tokens proposed, 2 accepted).
PRIORS = {1: (0.5, 1.5), 2: (1.0, 1.0), 3: (1.5, 0.5)}
LONGEST_PRIOR = max(PRIORS)


def prior(n: int) -> tuple[float, float]:
    return PRIORS[min(n, LONGEST_PRIOR)]


class MatchOdds:
    """How often a lookup continuation's tokens are accepted, per length n of the match behind
    it: each token is taken as accepted with one chance p_n, given the ones before it were (an
    `Acceptance` estimate per n from every proposal's accepted tokens and its rejection, if any,
    over HALFLIFE proposals, from prior(n))."""

    def __init__(self):
        self.estimates: dict[int, Acceptance] = {}

    def chance(self, n: int) -> float:
        estimate = self.estimates.get(n)
        if estimate is None:
            accepted, rejected = prior(n)
            return accepted / (accepted + rejected)
        return estimate.value

    def record(self, n: int, proposed: int, accepted: int) -> None:
        self.estimates.setdefault(n, Acceptance(HALFLIFE, *prior(n))).update(proposed, accepted)

    def length(self, n: int, k: int, cost: VerifyCost, held: int = 0) -> int:
        """The copy's length, at most k, with the most expected accepted tokens less what its
        tokens add to a verify that already holds `held` proposed ones (a model's draft that the
        copy extends): the i-th token is reached and accepted with chance p_n^i."""
        chance, reach, tokens, best, length = self.chance(n), 1.0, 0.0, 0.0, 0
        base = cost.steps(held)
        for size in range(1, k + 1):
            reach *= chance
            tokens += reach
            gain = tokens - (cost.steps(held + size) - base)
            if gain > best:
                best, length = gain, size
        return length


class PromptLookupDrafter:
    """One row's drafter with no model (base.RowDrafter): the continuation of the longest,
    latest n-gram match.

    Index invariant: for every position t in 1..len(ids)-1 and every n in [min_ngram,
    max_ngram] with n <= t, `index[tuple(ids[t-n:t])]` contains t (positions in increasing
    order). A query with context length L looks up tuple(ids[L-n:L]); every indexed position
    is < L, so the tail never matches itself, and the last entry is the most recent match.

    The copy may run past the end of the context (the match's period L - start is shorter
    than k): it then continues periodically, as an overlapping LZ77 copy does, so text stuck
    in a loop is proposed k tokens at a time.
    """

    def __init__(
        self,
        max_ngram: int = 3,
        min_ngram: int = 1,
        cost: VerifyCost | None = None,
        never: frozenset[int] = frozenset(),
    ):
        """`cost`: a verify's cost by the tokens proposed, where measured (a CPU's); None proposes
        every match's whole k (a GPU, where it costs next to nothing). `never`: the tokens a copy
        ends before (the tokenizer's control tokens)."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # counters (tests and reports): index operations, for the O(1)-per-round claim, and matches
        self.reads = 0  # index reads by `find`
        self.inserts = 0  # (n-gram, position) entries added
        self.removals = 0  # entries removed by a rollback
        self.rebuilds = 0  # times the index was cleared because the context changed under it
        self.rounds = 0  # calls to `find`
        self.matched = 0  # ... that found a match
        self.by_ngram: dict[int, int] = {}  # matches per n
        self._ids: list[int] = []  # the sequence the index describes
        self._index: dict[tuple[int, ...], list[int]] = {}
        self.cost = cost
        self.never = never
        self.odds = MatchOdds()
        # the last round's proposal, until the context shows its fate: (n, tokens, context length)
        self._pending: tuple[int, list[int], int] | None = None

    @property
    def operations(self) -> int:
        """Dictionary operations so far: reads, inserts and removals."""
        return self.reads + self.inserts + self.removals

    # -- RowDrafter calls ---------------------------------------------------------------------
    def start(self, prompt_ids: list[int], generator=None, capacity: int = 0) -> None:
        """Index the prompt, keeping what is shared with the sequence indexed before."""
        self._pending = None
        self._sync(prompt_ids, check_all=True)

    def rewind(self, valid: int) -> None:
        """Only the first `valid` tokens of what was indexed still hold (a new chat turn)."""
        self._pending = None
        self._cut(min(valid, len(self._ids)))

    def propose(self, context: list[int], k: int, sampling: SamplingConfig | None = None) -> Proposal:
        """Up to k point-mass tokens; none when the tail was not seen before. No randomness."""
        return self.proposal(self.find(context, k))

    def observe(self, path: list[int]) -> None:
        """Nothing to drop: the next context says what was committed."""

    def setup_seconds(self) -> float:
        return 0.0

    # -- lookup ------------------------------------------------------------------------------
    def find(
        self, context: list[int], k: int, new_round: bool = True, least: int = 1, held: int = 0
    ) -> list[int] | None:
        """The k tokens that followed the longest (then most recent) earlier match of the tail;
        None when there is none, or when that longest match is shorter than `least` tokens.
        `new_round=False`: a second query in the same round (a model proposal's extension, whose
        `held` tokens the verify already holds). With a `cost`, the tokens are cut to what `odds`
        says is worth verifying; with `never`, before the first control token (None if none are
        left)."""
        self._sync(context)
        if new_round:
            self._settle(context)
        self.rounds += new_round
        length = len(context)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            self.reads += 1
            positions = self._index.get(tuple(context[length - n :]))
            if positions:
                self.matched += 1
                self.by_ngram[n] = self.by_ngram.get(n, 0) + 1
                if n < least:
                    return None
                if self.cost is not None:
                    k = self.odds.length(n, k, self.cost, held)
                start = positions[-1]
                period = length - start
                tokens = [context[start + i % period] for i in range(k)]
                if self.never:
                    tokens = tokens[: next((i for i, t in enumerate(tokens) if t in self.never), k)]
                if not tokens:
                    return None
                if new_round:
                    self._pending = (n, tokens, length)
                return tokens
        return None

    def _settle(self, context: list[int]) -> None:
        """Count the last round's proposal by what the context shows was committed after it."""
        if self._pending is None:
            return
        n, tokens, length = self._pending
        if len(context) < length:
            self._pending = None  # rewound past it
            return
        committed = context[length : length + len(tokens) + 1]
        accepted = common_prefix(tokens, committed)
        if accepted < len(tokens) and len(committed) <= accepted:
            return  # not verified yet (a round without it)
        self._pending = None
        self.odds.record(n, len(tokens), accepted)

    @staticmethod
    def proposal(tokens: list[int] | None) -> Proposal:
        """Found tokens as a point-mass chain (none: an empty one)."""
        return Proposal.points(tokens or [], Origin.TEXT)

    # -- index maintenance -------------------------------------------------------------------
    def _sync(self, context: list[int], check_all: bool = False) -> None:
        """Make the index describe `context`, touching only what changed.

        Per round the check is O(max_ngram): the context must be at least as long as what was
        indexed and agree on its last max_ngram tokens (the ones the next keys are built
        from). The engine only ever appends within a generation and calls `rewind`/`begin`
        between turns, where `check_all` compares everything at C speed.
        """
        indexed = len(self._ids)
        if check_all:
            valid = common_prefix(self._ids, context)
        else:
            tail = max(0, indexed - self.max_ngram)
            extends = len(context) >= indexed and context[tail:indexed] == self._ids[tail:]
            valid = indexed if extends else common_prefix(self._ids, context)
        if valid < indexed:
            self._cut(valid)
        if len(context) > len(self._ids):
            self._append(context[len(self._ids) :])

    def _cut(self, valid: int) -> None:
        """Keep the first `valid` indexed tokens: unpick the rest, or rebuild if that is cheaper."""
        if len(self._ids) - valid > valid:
            kept = self._ids[:valid]
            self._index.clear()
            self._ids = []
            self.rebuilds += 1
            self._append(kept)
        else:
            self._truncate(valid)

    def _keys(self, t: int):
        """The n-grams that end right before position t, for every indexed n."""
        ids = self._ids
        for n in range(self.min_ngram, min(self.max_ngram, t) + 1):
            yield tuple(ids[t - n : t])

    def _append(self, tokens: list[int]) -> None:
        start = len(self._ids)
        self._ids.extend(tokens)
        index = self._index
        for t in range(max(start, 1), len(self._ids)):
            for key in self._keys(t):
                positions = index.get(key)
                if positions is None:
                    index[key] = [t]
                else:
                    positions.append(t)
                self.inserts += 1

    def _truncate(self, valid: int) -> None:
        """Forget positions >= valid: each was the last entry of its keys' lists."""
        index = self._index
        for t in range(len(self._ids) - 1, max(valid, 1) - 1, -1):
            for key in self._keys(t):
                positions = index[key]
                positions.pop()
                if not positions:
                    del index[key]
                self.removals += 1
        del self._ids[valid:]

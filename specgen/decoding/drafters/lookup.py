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

How long a continuation is proposed depends on how its kind has fared (`MatchOdds`): where a
verified token costs something (`price`, one more verified token in target steps: 0.07-0.1 on
the CPUs measured), a continuation is cut where its next token's chance of being reached and
accepted falls below that price. On text that does not repeat (a translation: 4% of lookup's
tokens accepted) a one-token match then proposes one token, or none, instead of a whole k that
a 5-token verify pays 1.3 plain steps for; on code that repeats, its whole k.
"""

from __future__ import annotations

import enum

import torch

from specgen.config import SamplingConfig, Scope
from specgen.decoding.acceptance import ProposalKind
from specgen.decoding.drafters.base import EMPTY, BaseDrafter, Drafter, Proposal
from specgen.decoding.drafters.suffix import Remembered, remembered
from specgen.decoding.events import Origin
from specgen.decoding.length import Acceptance
from specgen.runtime.memories import Memories
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

    def length(self, n: int, k: int, price: float) -> int:
        """The tokens worth proposing after an n-token match: the i-th is reached and accepted
        with chance p_n^i, and verifying it costs `price` target steps."""
        chance, reach, length = self.chance(n), 1.0, 0
        while length < k:
            reach *= chance
            if reach < price:
                break
            length += 1
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

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, price: float | None = None):
        """`price`: one more verified token's cost in target steps, where measured (a CPU's);
        None proposes every match's whole k (a GPU, where it costs next to nothing)."""
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
        self.price = price
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
    def find(self, context: list[int], k: int, new_round: bool = True, least: int = 1) -> list[int] | None:
        """The k tokens that followed the longest (then most recent) earlier match of the tail;
        None when there is none, or when that longest match is shorter than `least` tokens.
        `new_round=False`: a second query in the same round (a model proposal's extension).
        With a `price`, the tokens are cut to what `odds` says is worth verifying (None if none)."""
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
                if self.price is not None:
                    k = self.odds.length(n, k, self.price)
                    if k == 0:
                        return None
                start = positions[-1]
                period = length - start
                tokens = [context[start + i % period] for i in range(k)]
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


class Source(enum.Enum):
    """Which drafter made a row's proposal in a LookupChain round."""

    LOOKUP = "lookup"
    MEMORY = "memory"  # the suffix memory: earlier requests' text
    MODEL = "model"
    NONE = "none"  # nothing proposed this round (k was 0, or the round is over)


class LookupChain(BaseDrafter):
    """Prompt lookup first, then the suffix memory, the draft model otherwise: one source per row
    and round (the lookup method is this with no model: `NoDrafter`, min_match 1).

    A row's round uses its lookup continuation when the matched tail has at least `min_match`
    tokens; else what its tenant's suffix memory backs (earlier requests' text, drafters/suffix.py;
    the row writes its own text there as it commits); else the model's drafter (the chain
    drafter, one batched forward per step for every such row; for a draft of another tokenizer,
    the text drafter around it). Lookup and memory rounds may propose the round's whole k
    (`GenerationConfig.round_tokens`), model rounds at most `model_tokens`. A proposal comes
    whole from one source, so its kind is consistent (point masses from lookup and the memory;
    the model's sampled laws or greedy point masses), and the acceptance rule is chosen per row
    and round as usual.

    The chain drafter keeps its own cache invariant (a prefix of the committed sequence):
    `observe` reaches it only for rows it proposed for, so after lookup rounds it simply finds
    more unseen tokens and feeds them with its next proposal's first forward (catching up
    lazily is cheaper than keeping it warm). When no row needs the model, it is not called.
    """

    def __init__(
        self,
        model: Drafter,
        min_match: int = 2,
        model_tokens: int | None = None,
        make_lookup=PromptLookupDrafter,
        memories: Memories | None = None,
    ):
        self.make_lookup = make_lookup
        # the suffix memories (a pair's); alone (a test's), one memory of this drafter's rows
        self.memories = memories or Memories(scope=Scope.SHARED)
        self.remembered: list[Remembered] = []  # each row's text in its tenant's memory
        self.lookups: list[PromptLookupDrafter] = []  # each row's own index (LookupChain asks it itself)
        probe = make_lookup()
        if not probe.min_ngram <= min_match <= probe.max_ngram:
            raise ValueError(f"min_match must be in {probe.min_ngram}..{probe.max_ngram}, got {min_match}")
        self.model = model
        self.min_match = min_match
        self.model_tokens = model_tokens  # the model's k; a lookup round may use the round's whole k
        self.sources: list[Source] = []  # per row: who proposed last
        self.rounds = {Source.LOOKUP: 0, Source.MEMORY: 0, Source.MODEL: 0}  # rounds each source proposed in
        self.extended = 0  # model rounds extended by a lookup continuation

    def join(self, row, prompt_ids, generator, capacity, config) -> None:
        while row >= len(self.lookups):
            self.lookups.append(self.make_lookup())
            self.sources.append(Source.NONE)
        self.lookups[row].start(prompt_ids)
        remembered(self.remembered, row, self.memories, config, prompt_ids)
        self.model.join(row, prompt_ids, generator, capacity, config)
        self.sources[row] = Source.NONE

    def leave(self, keep) -> None:
        self.model.leave(keep)
        self.lookups = [self.lookups[i] for i in keep if i < len(self.lookups)]
        self.remembered = [self.remembered[i] for i in keep if i < len(self.remembered)]
        self.sources = [self.sources[i] for i in keep if i < len(self.sources)]

    def finished(self, row, ids) -> None:
        if row < len(self.remembered):
            self.remembered[row].sync(ids)
        self.model.finished(row, ids)

    def rewind(self, row, valid) -> None:
        if row < len(self.lookups):
            self.lookups[row].rewind(valid)
        self.model.rewind(row, valid)

    def setup_seconds(self) -> float:
        return self.model.setup_seconds()

    def taps(self) -> tuple[int, ...]:
        return self.model.taps()

    def declines(self, row: int) -> bool:
        return self.model.declines(row)

    def widened(self) -> int:
        return self.model.widened()

    def propose(self, contexts, ks, samplings, features=None) -> list[Proposal]:
        out: list[Proposal | None] = [None] * len(contexts)
        model_ks = [0] * len(contexts)
        for row, (context, k) in enumerate(zip(contexts, ks)):
            memory = self.remembered[row]
            memory.sync(context)
            found = self.lookups[row].find(context, k, least=self.min_match) if k > 0 else None
            recalled = memory.draft(context, k) if k > 0 and found is None else None
            if found is not None:
                self.sources[row] = Source.LOOKUP
                out[row] = PromptLookupDrafter.proposal(found)
            elif recalled is not None:
                self.sources[row] = Source.MEMORY
                out[row] = recalled
            elif k > 0:
                self.sources[row] = Source.MODEL
                model_ks[row] = min(k, self.model_tokens or k)
            else:
                self.sources[row] = Source.NONE
                out[row] = EMPTY
            if self.sources[row] is not Source.NONE:
                self.rounds[self.sources[row]] += 1
        if any(model_ks):
            drafted = self.model.propose(contexts, model_ks, samplings, features)
            for row, k in enumerate(model_ks):
                if k:
                    out[row] = self._extended(row, drafted[row], contexts[row], ks[row])
        return out

    def _extended(self, row: int, proposal: Proposal, context: list[int], k: int) -> Proposal:
        """A model proposal shorter than k, extended by the lookup continuation of context +
        proposal when that tail matches well: the extra tokens cost no draft forward. Under
        sampling their rows of `probs` are point masses (the law each was drawn from), so the
        rejection rule stays exact position by position."""
        room = k - proposal.size
        if room <= 0 or proposal.size == 0:
            return proposal
        found = self.lookups[row].find(
            context + proposal.tokens.tolist(), room, new_round=False, least=self.min_match
        )
        if found is None:
            return proposal
        extra = torch.tensor(found, dtype=proposal.tokens.dtype, device=proposal.tokens.device)
        self.extended += 1
        probs = proposal.probs
        if proposal.kind is ProposalKind.SAMPLED:
            probs = torch.cat([probs, torch.nn.functional.one_hot(extra, probs.shape[-1]).to(probs.dtype)])
        return Proposal.chain(torch.cat([proposal.tokens, extra]), proposal.kind, probs)

    def observe(self, row, path) -> None:
        if self.sources[row] is Source.MODEL:
            self.model.observe(row, path)
        self.sources[row] = Source.NONE

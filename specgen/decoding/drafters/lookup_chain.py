"""lookup-chain: prompt lookup where the text repeats, the suffix memory, the draft model otherwise
(`LookupChain`: one source per row and round; the lookup method is the same with no model)."""

from __future__ import annotations

import enum

import torch

from specgen.config import Scope
from specgen.decoding.acceptance import ProposalKind
from specgen.decoding.drafters.base import EMPTY, BaseDrafter, Drafter, Proposal
from specgen.decoding.drafters.lookup import PromptLookupDrafter
from specgen.decoding.drafters.suffix import Remembered, remembered
from specgen.runtime.memories import Memories


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
            context + proposal.tokens.tolist(),
            room,
            new_round=False,
            least=self.min_match,
            held=proposal.size,
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

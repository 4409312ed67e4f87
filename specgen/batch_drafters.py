"""Drafters for a batch of rows: one proposal per row per round, in one draft forward per step.

Same contract as drafters.py, row-wise: `propose` returns per-row token lists (a row may get
fewer than asked), and for sampled proposals the reported distributions are exactly the ones
each token was drawn from. `observe(kept)` says how many of each row's proposed tokens were
committed; `rollback(row, valid)` says that only the first `valid` tokens of a row's sequence
still hold (a deterministic-mode replay rewrote the rest); `leave(keep)` drops rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specgen.acceptance import ProposalKind
from specgen.config import SamplingConfig
from specgen.ragged import RaggedCache
from specgen.sampling import make_generator, sample, warp


@dataclass(frozen=True)
class BatchProposal:
    tokens: list[list[int]]  # per row, at most the k asked for that row
    probs: torch.Tensor | None  # [rows, K, V] when sampled (row i's first len(tokens[i]) rows hold)
    kind: ProposalKind


class BatchDrafter(Protocol):
    def join(self, prompt_ids: list[int], generator: torch.Generator | None) -> None: ...

    def leave(self, keep: list[int]) -> None: ...

    def propose(self, contexts: list[list[int]], ks: list[int], sampling: SamplingConfig) -> BatchProposal: ...

    def observe(self, kept: list[int]) -> None: ...

    def rollback(self, row: int, valid: int) -> None: ...


class BatchModelDrafter:
    """Chain drafting for every row with one draft model and one shared ragged cache.

    Cache invariant per row: a prefix of the committed sequence (never its last token). A
    round feeds each row what it has not seen (the root, plus the last draft token after a
    fully accepted round), then K-1 single-token steps; x_K is never fed.
    """

    def __init__(self, model, device: torch.device, vocab: int | None = None, confidence=None,
                 pad_id: int = 0):
        self.device, self.vocab, self.confidence = device, vocab, confidence
        self.cache = RaggedCache(model, device, pad_id)
        self.generators: list[torch.Generator | None] = []
        self._base: list[int] = []
        self._fed: list[int] = []

    def join(self, prompt_ids: list[int], generator: torch.Generator | None) -> None:
        self.cache.join(prompt_ids[:-1])
        if generator is not None and generator.device != self.device:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            generator = make_generator(seed, self.device)
        self.generators.append(generator)

    def leave(self, keep: list[int]) -> None:
        self.cache.select(keep)
        self.generators = [self.generators[i] for i in keep]

    @torch.inference_mode()
    def propose(self, contexts: list[list[int]], ks: list[int], sampling: SamplingConfig) -> BatchProposal:
        rows, steps = len(contexts), max(ks)
        lengths = self.cache.lengths
        new = [context[length:] for context, length in zip(contexts, lengths)]
        last = torch.tensor([len(tokens) - 1 for tokens in new], device=self.device)
        tokens, probs, stopped = [], [], torch.zeros(rows, dtype=torch.bool, device=self.device)
        stop_at = [steps] * rows
        token = None  # the previous step's tokens [rows]
        for step in range(steps):
            if step == 0:  # what each row has not seen: 1 or 2 tokens (or more after a rollback)
                logits = self.cache.forward(new)
                logits = logits[torch.arange(rows, device=logits.device), last.to(logits.device), : self.vocab]
            else:  # the previous step's tokens, straight from the device
                logits = self.cache.step(token.to(self.device))[:, -1, : self.vocab]
            token, dist = self._choose(logits, sampling)
            tokens.append(token)
            probs.append(dist)
            if self.confidence is not None:
                stopped = stopped | self.confidence(logits, dist).to(stopped.device)
                flags = stopped.tolist()  # one small sync per step, as for a single sequence
                for i, flag in enumerate(flags):
                    if flag and stop_at[i] == steps:
                        stop_at[i] = step + 1
                if all(flags):
                    break
            if step == steps - 1:
                break
        drafted = torch.stack(tokens, dim=1).tolist()  # the proposal's one sync
        self._base = [len(context) for context in contexts]
        self._fed = [len(tokens) - 1] * rows
        out = [row[: min(k, stop)] for row, k, stop in zip(drafted, ks, stop_at)]
        sampled = probs[0] is not None
        return BatchProposal(out, torch.stack(probs, dim=1) if sampled else None,
                             ProposalKind.SAMPLED if sampled else ProposalKind.DETERMINISTIC)

    def observe(self, kept: list[int]) -> None:
        self.cache.truncate([base + min(k, fed) for base, k, fed in zip(self._base, kept, self._fed)])

    def rollback(self, row: int, valid: int) -> None:
        lengths = list(self.cache.lengths)
        lengths[row] = min(lengths[row], valid)
        self.cache.truncate(lengths)

    def _choose(self, logits: torch.Tensor, sampling: SamplingConfig):
        if sampling.greedy:
            return logits.argmax(dim=-1), None
        dist = warp(logits, sampling)
        token = torch.stack([sample(dist[i], generator) for i, generator in enumerate(self.generators)])
        return token, dist


class BatchLookupDrafter:
    """Prompt lookup per row (lookup.PromptLookupDrafter): no model, point-mass proposals."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.rows: list = []

    def join(self, prompt_ids: list[int], generator: torch.Generator | None) -> None:
        from specgen.lookup import PromptLookupDrafter

        drafter = PromptLookupDrafter(max_ngram=self.max_ngram)
        drafter.begin(prompt_ids)
        self.rows.append(drafter)

    def leave(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    def propose(self, contexts: list[list[int]], ks: list[int], sampling: SamplingConfig) -> BatchProposal:
        tokens = []
        for drafter, context, k in zip(self.rows, contexts, ks):
            match = drafter.find(context, k) if k > 0 else None
            tokens.append(match.tokens if match else [])
        return BatchProposal(tokens, None, ProposalKind.DETERMINISTIC)

    def observe(self, kept: list[int]) -> None:
        """Nothing to drop: the next context says what was committed."""

    def rollback(self, row: int, valid: int) -> None:
        self.rows[row].rewind(valid)

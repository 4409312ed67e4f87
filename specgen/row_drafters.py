"""Drafters for the rows of a batch: what the engine's round talks to.

Protocol (`RowDrafters`), row-wise: `join` adds a row for a new prompt, `leave(keep)` keeps some
rows, `propose` returns one proposal per row (None where k is 0): a drafters.Proposal (a chain:
its tokens, and for sampled proposals the law each token was drawn from) or a
tree_drafters.TreeProposal; `observe(row, kept, path)` says what was committed (`path`: the
accepted tree nodes); `rewind(row, valid)` says that only the first `valid` tokens of the row's
sequence still hold (a deterministic-mode replay rewrote the rest).

* `PerRow` wraps one single-row drafter per row (drafters.py, tree_drafters.py, lookup.py):
  any method, trees included; each row drafts with its own cache.
* `SharedChain` drafts a chain for every row at once: one draft forward per step for the whole
  batch over one position-indexed cache with a row per sequence.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from specgen import kvcache
from specgen.acceptance import ProposalKind
from specgen.config import SamplingConfig
from specgen.drafters import Proposal
from specgen.sampling import make_generator, sample, warp


class RowDrafters(Protocol):
    def join(self, prompt_ids: list[int], generator: torch.Generator | None, length: int) -> None: ...

    def leave(self, keep: list[int]) -> None: ...

    def propose(self, contexts: list[list[int]], ks: list[int], sampling: SamplingConfig,
                generators: list, rows: list[int]) -> list: ...

    def observe(self, row: int, kept: int, path: list[int] | None) -> None: ...

    def rewind(self, row: int, valid: int) -> None: ...


class PerRow:
    """One single-row drafter per row; `make` builds the drafter of a joining row."""

    def __init__(self, drafters: list | None = None, make: Callable[[], object] | None = None):
        self.rows = list(drafters or [])
        self.make = make

    def join(self, prompt_ids: list[int], generator, length: int) -> None:
        drafter = self.make()
        if hasattr(drafter, "reserve"):
            drafter.reserve(length)
        drafter.begin(prompt_ids)
        self.rows.append(drafter)

    def leave(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    def propose(self, contexts, ks, sampling, generators, rows) -> list:
        out = []
        for context, k, generator, row in zip(contexts, ks, generators, rows):
            drafter = self.rows[row]
            if k <= 0:
                out.append(None)
            elif hasattr(drafter, "propose_tree"):
                out.append(drafter.propose_tree(context, sampling, generator))
            else:
                out.append(drafter.propose(context, k, sampling, generator))
        return out

    def observe(self, row: int, kept: int, path: list[int] | None) -> None:
        drafter = self.rows[row]
        if path is not None:
            drafter.observe_path(path)
        else:
            drafter.observe(kept)

    def rewind(self, row: int, valid: int) -> None:
        self.rows[row].rewind(valid)


class SharedChain:
    """Chain drafting for every row with one draft model and one cache of a row per sequence.

    Cache invariant per row: a prefix of the committed sequence. A round feeds each row what it
    has not seen (the root, plus the last draft token after a fully accepted round), padded at
    the end to the widest row, then K-1 single-token steps for all rows; x_K is never fed.
    """

    def __init__(self, model, device: torch.device, vocab: int | None = None, confidence=None,
                 compile: str = "off"):
        from specgen.compiled import Steps

        self.model, self.device, self.vocab, self.confidence = model, device, vocab, confidence
        self.steps = Steps(model, compile, exact=False)
        self.cache = kvcache.SlotCache(model.config, rows=0)
        self.generators: list[torch.Generator | None] = []
        self._base: list[int] = []
        self._fed: list[int] = []

    def join(self, prompt_ids: list[int], generator, length: int) -> None:
        row = self.cache.add_row()
        self.cache.reserve(length)
        if len(prompt_ids) > 1:
            rows = slice(row, row + 1) if self.cache.rows > 1 else None
            kvcache.forward(self.steps.call, self.cache, torch.tensor([prompt_ids[:-1]], device=self.device), keep=1,
                            rows=rows, full_view=self.steps.mode == "inductor")
        if generator is not None and generator.device != self.device:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            generator = make_generator(seed, self.device)
        self.generators.append(generator)
        self._base.append(0)
        self._fed.append(0)

    def leave(self, keep: list[int]) -> None:
        self.cache.select(keep)
        self.generators = [self.generators[i] for i in keep]
        self._base = [self._base[i] for i in keep]
        self._fed = [self._fed[i] for i in keep]

    @torch.inference_mode()
    def propose(self, contexts, ks, sampling: SamplingConfig, generators, rows) -> list:
        count, steps = len(contexts), max(ks)
        new = [context[length:] for context, length in zip(contexts, self.cache.lengths)]
        width = max(len(tokens) for tokens in new)
        ids = torch.zeros(count, width, dtype=torch.long)
        for i, tokens in enumerate(new):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        bases = list(self.cache.lengths)
        # both copies before the first forward is queued (afterwards they would wait for it)
        ids = ids.to(self.device)
        last = torch.tensor([len(tokens) - 1 for tokens in new], device=self.device)
        logits = self.steps.forward(self.cache, ids)
        logits = logits[torch.arange(count, device=logits.device), last.to(logits.device), : self.vocab]
        kvcache.set_lengths(self.cache, [b + len(tokens) for b, tokens in zip(bases, new)])  # drop the pads
        tokens, probs = [], []
        stopped = torch.zeros(count, dtype=torch.bool, device=self.device)
        stop_at = [steps] * count
        for step in range(steps):
            if step:  # the previous step's tokens, straight from the device
                logits = self.steps.forward(self.cache, token.view(count, 1).to(self.device))[:, -1, : self.vocab]
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
        fed = len(tokens) - 1
        self._base = [len(context) for context in contexts]
        self._fed = [fed] * count
        drafted = torch.stack(tokens, dim=1)  # [rows, K] on the device
        stacked = torch.stack(probs, dim=1) if probs[0] is not None else None
        out = []
        for i, k in enumerate(ks):
            k = min(k, stop_at[i])
            if k <= 0:
                kvcache.set_length(self.cache, i, self._base[i])  # no proposal: keep only the context
                out.append(None)
                continue
            out.append(Proposal(drafted[i, :k], stacked[i, :k] if stacked is not None else None,
                                ProposalKind.SAMPLED if stacked is not None else ProposalKind.DETERMINISTIC))
        return out

    def observe(self, row: int, kept: int, path: list[int] | None) -> None:
        kvcache.set_length(self.cache, row, self._base[row] + min(kept, self._fed[row]))

    def rewind(self, row: int, valid: int) -> None:
        kvcache.set_length(self.cache, row, min(self.cache.lengths[row], valid))

    def _choose(self, logits: torch.Tensor, sampling: SamplingConfig):
        if sampling.greedy:
            return logits.argmax(dim=-1), None
        dist = warp(logits, sampling)
        token = torch.stack([sample(dist[i], generator) for i, generator in enumerate(self.generators)])
        return token, dist

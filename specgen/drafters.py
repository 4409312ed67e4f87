"""Drafters: strategies that propose the next tokens. They own their state, never the target's.

Contract: `propose` returns only the proposal (never the context), and for sampled proposals
the reported `probs` are exactly the distributions the tokens were drawn from. After the
target's verdict the engine calls `observe(kept)` with the number of proposed tokens that
were committed, so the drafter can drop what was rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specgen import kvcache
from specgen.acceptance import ProposalKind
from specgen.config import SamplingConfig
from specgen.sampling import choose


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [k] int64
    probs: torch.Tensor | None  # [k, V] fp32 when kind is SAMPLED, else None
    kind: ProposalKind


class Drafter(Protocol):
    def begin(self, prompt_ids: list[int]) -> None: ...

    def rewind(self, valid: int) -> None: ...

    def propose(self, context: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal: ...

    def observe(self, kept: int) -> None: ...


class ModelDrafter:
    """Chain drafting with a small model and its own KV cache.

    Cache invariant: it holds a prefix of the committed sequence (never the last token).
    A round feeds the tokens it has not seen (the root, and the last draft token if the
    previous round accepted all of them), then k-1 single-token steps; x_k is never fed.
    """

    def __init__(self, model, device: torch.device, vocab: int | None = None, confidence=None,
                 compile: str = "off"):
        from specgen.compiled import Steps

        self.model = model
        self.steps = Steps(model, compile, exact=False)  # on CUDA: the single-token step as a CUDA graph
        self.device = device
        self.confidence = confidence  # adaptive.ConfidenceStop: end the draft when unsure
        self.vocab = vocab  # shared vocabulary when draft and target heads are padded differently
        self.cache = kvcache.new_cache(model)
        self._own_generator: torch.Generator | None = None
        self.cached = 0  # committed tokens in the cache
        self._base = 0  # context length at the last proposal
        self._fed = 0  # draft tokens fed at the last proposal

    def begin(self, prompt_ids: list[int]) -> None:
        self.reset_to(prompt_ids[:-1])

    def reserve(self, length: int) -> None:
        """Preallocate the cache for `length` positions (a compiled step keeps its shapes)."""
        self.cache.reserve(length)

    def rewind(self, valid: int) -> None:
        """Only the first `valid` tokens of what the cache saw still hold (a new chat turn)."""
        self.cached = min(self.cached, valid)
        kvcache.crop(self.cache, self.cached)

    def reset_to(self, ids: list[int]) -> None:
        """Make the cache hold exactly `ids` (reusing the common prefix already there)."""
        kvcache.crop(self.cache, min(self.cached, len(ids)))
        self.cached = min(self.cached, len(ids))
        if len(ids) > self.cached:
            self._forward(ids[self.cached:])
            self.cached = len(ids)

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        generator = self._generator(generator)
        unseen = torch.tensor([context[self.cached:]], device=self.device)
        tokens, probs = [], []
        step_input = unseen
        for i in range(k):
            logits = self._forward_tensor(step_input)[0, -1, : self.vocab]
            token, dist = choose(logits, sampling, generator)
            tokens.append(token)
            probs.append(dist)
            if i == k - 1 or (self.confidence is not None and bool(self.confidence(logits, dist))):
                break  # with a confidence stop: one small host sync per draft step
            step_input = token.view(1, 1)
        self._base, self._fed = len(context), len(tokens) - 1
        sampled = probs[0] is not None
        return Proposal(
            tokens=torch.stack(tokens),
            probs=torch.stack(probs) if sampled else None,
            kind=ProposalKind.SAMPLED if sampled else ProposalKind.DETERMINISTIC,
        )

    def observe(self, kept: int) -> None:
        """`kept` of the proposed tokens were committed; drop the rest from the cache."""
        self.cached = self._base + min(kept, self._fed)
        kvcache.crop(self.cache, self.cached)

    def _generator(self, generator: torch.Generator | None) -> torch.Generator | None:
        """Draws happen on the draft's device; derive a generator there from the engine's one."""
        if generator is None or generator.device == self.device:
            return generator
        if self._own_generator is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            self._own_generator = torch.Generator(device=self.device).manual_seed(seed)
        return self._own_generator

    def _forward(self, ids: list[int]) -> None:
        with torch.inference_mode():
            self._forward_tensor(torch.tensor([ids], device=self.device))

    def _forward_tensor(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.steps.forward(self.cache, input_ids, keep=1)

"""Suffix decoding: drafts from the memory of what earlier requests wrote (runtime/suffix.py),
the request's own text included, at no model cost (SuffixDecoding; Arctic Inference's suffix
method in vLLM; llama.cpp's lookup caches).

Each row writes its prompt to its tenant's memory when it joins (runtime/memories.py says who
shares one) and its committed tokens as the rounds go, so a stream still running already helps
the next request; a chat turn that extends what the row wrote adds only the new tokens. A round
drafts the continuation of the longest earlier occurrence of the row's tail, as long as its
frequency and depth support (`SuffixMemory.draft`), up to the round's k. Proposals are point
masses, verified as prompt lookup's are: greedy output is plain decoding's, and under sampling
`point_mass_sampling` keeps the target's law. The memory decides speed only, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specgen.decoding.drafters.base import EMPTY, BaseDrafter, Proposal
from specgen.decoding.drafters.lookup import PromptLookupDrafter
from specgen.runtime.memories import Memories
from specgen.runtime.suffix import SuffixMemory
from specgen.text import common_prefix

TAIL = 8  # tokens of a row's text compared each round to check the context still extends it


@dataclass
class _Row:
    memory: SuffixMemory
    document: int
    written: list[int] = field(default_factory=list)  # the row's text as the memory holds it


class SuffixDrafter(BaseDrafter):
    """The Drafter of `--method suffix` rows (see the module)."""

    def __init__(self, memories: Memories):
        self.memories = memories
        self.rows: list[_Row] = []
        self.proposed = self.drafted = 0  # rounds that found a continuation, tokens drafted

    def join(self, row, prompt_ids, generator, capacity, config) -> None:
        memory = self.memories.get(config.tenant)
        held = self.rows[row] if row < len(self.rows) else None
        if (
            held is not None
            and held.memory is memory
            and common_prefix(held.written, prompt_ids) == len(held.written)
        ):
            self._write(held, prompt_ids)  # a chat's next turn: only what is new
            return
        state = _Row(memory, memory.open())
        self._write(state, prompt_ids)
        if held is not None:
            self.rows[row] = state
        elif row == len(self.rows):
            self.rows.append(state)
        else:
            raise ValueError(f"row {row} joins a drafter of {len(self.rows)} rows")

    def _write(self, state: _Row, ids: list[int]) -> None:
        new = ids[len(state.written) :]
        if new:
            state.memory.extend(state.document, new)
            state.written.extend(new)
            self.memories.trim()

    def _sync(self, state: _Row, context: list[int]) -> None:
        """Write what the row committed since; a context that no longer extends the written text
        (a replay rewrote it) continues as a new document."""
        n = len(state.written)
        if len(context) < n or context[max(0, n - TAIL) : n] != state.written[max(0, n - TAIL) :]:
            state.document, state.written = state.memory.open(), []
        self._write(state, context)

    def leave(self, keep) -> None:
        self.rows = [self.rows[i] for i in keep if i < len(self.rows)]

    def rewind(self, row, valid) -> None:
        """Nothing to undo: written text stays in the memory (it was committed once); the next
        context says what holds."""

    def finished(self, row, ids) -> None:
        if row < len(self.rows):
            self._sync(self.rows[row], ids)

    def propose(self, contexts, ks, samplings, features=None) -> list[Proposal]:
        out = []
        for state, context, k in zip(self.rows, contexts, ks):
            if k <= 0:
                out.append(EMPTY)
                continue
            self._sync(state, context)
            found = state.memory.draft(context, k, exclude=state.document)
            if found is None or not found.tokens:
                out.append(EMPTY)
                continue
            self.proposed += 1
            self.drafted += len(found.tokens)
            out.append(PromptLookupDrafter.proposal(found.tokens))
        return out

    def observe(self, row, path) -> None:
        """Nothing: the next context says what was committed."""

"""Suffix decoding: drafts from the memory of what earlier requests wrote (runtime/suffix.py),
the request's own text included, at no model cost (SuffixDecoding; Arctic Inference's suffix
method in vLLM; llama.cpp's lookup caches).

Each row writes its prompt to its tenant's memory when it joins (runtime/memories.py says who
shares one) and its committed tokens as the rounds go, so a stream still running already helps
the next request; a chat turn that extends what the row wrote adds only the new tokens
(`Remembered`, which lookup and lookup-chain rows keep too: they consult the memory where their
own text has no match). A round drafts the continuation of the longest earlier occurrence of the
row's tail, as long as its frequency and depth support (`SuffixMemory.draft`), up to the round's
k. Proposals are point masses, verified as prompt lookup's are: greedy output is plain
decoding's, and under sampling `point_mass_sampling` keeps the target's law. Wherever a verified
token costs less than a branch is worth (build.suffix_branches: every device measured so far), a
draft is a small tree of each node's most frequent next tokens instead (`branches`), verified by
`greedy_tree` or `point_mass_tree` (each node's token a draw from the target's law whatever its
children). The memory decides speed only, never the output.
"""

from __future__ import annotations

from specgen.config import GenerationConfig, Scope
from specgen.decoding.drafters.base import EMPTY, BaseDrafter, Proposal
from specgen.decoding.events import Origin
from specgen.runtime.memories import Memories
from specgen.runtime.suffix import SuffixMemory
from specgen.text import common_prefix

TAIL = 8  # tokens of a row's text compared each round to check the context still extends it


class Remembered:
    """One row's text in its tenant's memory: written as the row commits, drafted from."""

    __slots__ = ("memories", "memory", "document", "written")

    def __init__(self, memories: Memories, tenant: str, prompt_ids: list[int]):
        self.memories = memories
        self.memory: SuffixMemory = memories.get(tenant)
        self.document = self.memory.open()
        self.written: list[int] = []  # the row's text as the memory holds it
        self.write(prompt_ids)

    def extends(self, memories: Memories, tenant: str, prompt_ids: list[int]) -> bool:
        """Whether a next turn's prompt continues this row's text in the same memory (a chat)."""
        return memories.get(tenant) is self.memory and common_prefix(self.written, prompt_ids) == len(
            self.written
        )

    def write(self, ids: list[int]) -> None:
        """`ids` extends what was written: the new tokens go to the memory."""
        new = ids[len(self.written) :]
        if new:
            self.memory.extend(self.document, new)
            self.written.extend(new)
            self.memories.trim()

    def sync(self, context: list[int]) -> None:
        """Write what the row committed since; a context that no longer extends the written text
        (a replay rewrote it) continues as a new document."""
        n = len(self.written)
        if len(context) < n or context[max(0, n - TAIL) : n] != self.written[max(0, n - TAIL) :]:
            self.document, self.written = self.memory.open(), []
        self.write(context)

    def draft(self, context: list[int], k: int, branches: int = 1) -> Proposal | None:
        """Up to k tokens the memory backs after `context`, a chain or with `branches` > 1 a tree
        (None: it backs none)."""
        found = self.memory.draft(context, k, exclude=self.document, branches=branches)
        if found is None or not found.tokens:
            return None
        return Proposal.points(found.tokens, Origin.MEMORY, found.parents)  # a chain's are 0..n-1


# a seeded sampled row's: its own text only, so that its seed replays whatever others wrote
PRIVATE = Memories(scope=Scope.REQUEST)


def remembered(
    rows: list[Remembered], row: int, memories: Memories, config: GenerationConfig, prompt_ids
) -> None:
    """Row `row` of `rows` joins with `prompt_ids`: its text continued (a chat's next turn) or
    written afresh (a new row, a reused one). A seeded sampled row (`config.seeded`) drafts from
    its own text only: which tokens a round proposes changes its draws, and its seed must give
    the same text whatever earlier requests wrote."""
    memories, tenant = (PRIVATE if config.seeded else memories), config.tenant
    held = rows[row] if row < len(rows) else None
    if held is not None and held.extends(memories, tenant, prompt_ids):
        held.write(prompt_ids)
        return
    state = Remembered(memories, tenant, prompt_ids)
    if held is not None:
        rows[row] = state
    elif row == len(rows):
        rows.append(state)
    else:
        raise ValueError(f"row {row} joins a drafter of {len(rows)} rows")


class SuffixDrafter(BaseDrafter):
    """The Drafter of `--method suffix` rows (see the module)."""

    def __init__(self, memories: Memories, branches: int = 1):
        """`branches`: each node's most frequent next tokens a draft tries (1: chains; more where a
        verify's cost hardly grows with its tokens: build.suffix_branches)."""
        self.memories, self.branches = memories, branches
        self.rows: list[Remembered] = []
        self.proposed = self.drafted = 0  # rounds that found a continuation, tokens drafted

    def join(self, row, prompt_ids, generator, capacity, config) -> None:
        remembered(self.rows, row, self.memories, config, prompt_ids)

    def leave(self, keep) -> None:
        self.rows = [self.rows[i] for i in keep if i < len(self.rows)]

    def rewind(self, row, valid) -> None:
        """Nothing to undo: written text stays in the memory (it was committed once); the next
        context says what holds."""

    def finished(self, row, ids) -> None:
        if row < len(self.rows):
            self.rows[row].sync(ids)

    def propose(self, contexts, ks, samplings, features=None) -> list[Proposal]:
        out = []
        for state, context, k in zip(self.rows, contexts, ks):
            state.sync(context)
            found = state.draft(context, k, self.branches) if k > 0 else None
            if found is None:
                out.append(EMPTY)
                continue
            self.proposed += 1
            self.drafted += found.size
            out.append(found)
        return out

    def observe(self, row, path) -> None:
        """Nothing: the next context says what was committed."""

"""The drafter protocol: what the engine's round talks to, for every method and batch size.

A drafter serves the rows of a batch (a single prompt is a batch of one). The engine calls:

* `join(row, prompt_ids, generator, capacity)`: row `row` starts on a prompt. `row` is the
  drafter's next new row, or one it holds already (a chat turn, a reused row), which keeps what
  a `rewind` left valid. `generator` is the row's for random draws; `capacity` the positions the
  row may reach (caches are preallocated for it).
* `leave(keep)`: only rows `keep` stay, renumbered 0.. in that order.
* `finished(row)`: the row's request is done (it leaves, or stays parked for a next turn): a
  drafter with a cache may keep what the row holds for later prompts that start the same way.
* `rewind(row, valid)`: only the first `valid` tokens of the row's sequence still hold (a new
  chat turn, a deterministic-mode replay that rewrote the rest). Rows never joined are ignored.
* `propose(contexts, ks, samplings) -> list[Proposal]`: one proposal per row, rows in order;
  `contexts[i]` is row i's committed sequence, `ks[i]` how many tokens it may draft (a tree
  drafter builds its tree when ks[i] > 0), `samplings[i]` its sampling settings (a greedy row
  drafts greedily); a row with nothing to propose gets an empty proposal.
* `observe(row, path)`: the accepted nodes of the row's last proposal that were committed.
* `setup_seconds()`: time spent capturing and compiling its steps (CUDA), for statistics.
* `taps()`: the target layers whose entering hidden states the drafter reads (an EAGLE head's
  low, middle and high features; empty for every other drafter). The engine's target cache
  keeps them at each committed position (kvcache.FeatureLayer), and the drafter reads them
  from the cache the engine hands it with `see(target_cache)`.

Contract: a proposal holds only drafted tokens (never the context), and for sampled proposals
`probs` are exactly the laws the tokens were drawn from. A chain is a one-path tree; the engine
reads a proposal's shape from its parents and never asks what kind of drafter made it.

Per-row drafters (a tree search, a lookup index) implement the smaller `RowDrafter` and are
served to the engine by `PerRow`, one instance per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Protocol

import torch

from specgen.config import SamplingConfig
from specgen.decoding.acceptance import ProposalKind


@dataclass(frozen=True)
class Proposal:
    """One row's draft: `tokens` [n] (BFS order, the root excluded) and their parents (0 is the
    root, the row's last committed token; j >= 1 is tokens[j - 1])."""

    tokens: torch.Tensor  # [n] int64
    parents: tuple[int, ...]  # [n]
    kind: ProposalKind
    probs: torch.Tensor | None = None  # SAMPLED: [m, V], row j the law node j's children were drawn from
    replacement: bool = False  # siblings drawn with replacement (multi-draft)

    @classmethod
    def chain(cls, tokens: torch.Tensor, kind: ProposalKind, probs: torch.Tensor | None = None) -> "Proposal":
        """x1..xk, each the child of the one before: probs row j is the law x_(j+1) was drawn from."""
        return cls(tokens, tuple(range(tokens.shape[0])), kind, probs)

    @classmethod
    def drafted(cls, tokens: torch.Tensor, sampling: SamplingConfig, probs: torch.Tensor | None) -> "Proposal":
        """A drafted chain: point masses for a greedy row, else the laws its tokens were drawn from."""
        if sampling.greedy:
            return cls.chain(tokens, ProposalKind.DETERMINISTIC)
        return cls.chain(tokens, ProposalKind.SAMPLED, probs)

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> "Proposal":
        return cls(torch.zeros(0, dtype=torch.long, device=device), (), ProposalKind.DETERMINISTIC)

    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(len(self.parents)))


class Drafter(Protocol):
    def join(self, row: int, prompt_ids: list[int], generator: torch.Generator | None, capacity: int) -> None: ...

    def leave(self, keep: list[int]) -> None: ...

    def finished(self, row: int) -> None: ...

    def rewind(self, row: int, valid: int) -> None: ...

    def propose(self, contexts: list[list[int]], ks: list[int], samplings: list[SamplingConfig]) -> list[Proposal]: ...

    def observe(self, row: int, path: list[int]) -> None: ...

    def setup_seconds(self) -> float: ...

    def taps(self) -> tuple[int, ...]: ...

    def see(self, target_cache) -> None: ...


class NoDrafter:
    """Plain decoding: nothing is ever proposed."""

    def join(self, row, prompt_ids, generator, capacity) -> None:
        pass

    def leave(self, keep) -> None:
        pass

    def finished(self, row) -> None:
        pass

    def rewind(self, row, valid) -> None:
        pass

    def propose(self, contexts, ks, samplings) -> list[Proposal]:
        return [Proposal.empty() for _ in contexts]

    def observe(self, row, path) -> None:
        pass

    def setup_seconds(self) -> float:
        return 0.0

    def taps(self) -> tuple[int, ...]:
        return ()

    def see(self, target_cache) -> None:
        pass


class RowDrafter(Protocol):
    """One row's drafter (served by PerRow): the same calls for a single sequence."""

    def start(self, prompt_ids: list[int], generator: torch.Generator | None, capacity: int) -> None: ...

    def rewind(self, valid: int) -> None: ...

    def propose(self, context: list[int], k: int, sampling: SamplingConfig) -> Proposal: ...

    def observe(self, path: list[int]) -> None: ...

    def setup_seconds(self) -> float: ...


class PerRow:
    """The Drafter protocol over one RowDrafter per row; `make` builds a joining row's drafter."""

    def __init__(self, make: Callable[[], RowDrafter]):
        self.make = make
        self.rows: list[RowDrafter] = []
        self.spent = 0.0  # setup seconds of rows that left

    def join(self, row, prompt_ids, generator, capacity) -> None:
        while row >= len(self.rows):
            self.rows.append(self.make())
        self.rows[row].start(prompt_ids, generator, capacity)

    def leave(self, keep) -> None:
        kept = [self.rows[i] for i in keep if i < len(self.rows)]
        self.spent += sum(d.setup_seconds() for d in self.rows if d not in kept)
        self.rows = kept

    def finished(self, row) -> None:
        pass  # a row's tree search or lookup index serves that row only

    def rewind(self, row, valid) -> None:
        if row < len(self.rows):
            self.rows[row].rewind(valid)

    def propose(self, contexts, ks, samplings) -> list[Proposal]:
        return [self.rows[row].propose(context, k, sampling) if k > 0 else Proposal.empty()
                for row, (context, k, sampling) in enumerate(zip(contexts, ks, samplings))]

    def observe(self, row, path) -> None:
        self.rows[row].observe(path)

    def setup_seconds(self) -> float:
        return self.spent + sum(d.setup_seconds() for d in self.rows)

    def taps(self) -> tuple[int, ...]:
        return ()

    def see(self, target_cache) -> None:
        pass

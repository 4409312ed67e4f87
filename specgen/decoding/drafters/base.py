"""The drafter protocol: what the engine's round talks to, for every method and batch size.

A drafter serves the rows of a batch (a single prompt is a batch of one); `Drafter` documents
each call. Every method's drafter speaks it: plain decoding's (`NoDrafter`, which proposes
nothing), the chain drafters (drafters/model.py, eagle.py, text.py), lookup-chain, and the
per-row ones (a tree search, a lookup index), which `PerRow` serves from one `RowDrafter` per
row.

Contract: a proposal holds only drafted tokens (never the context), and for sampled proposals
`probs` are exactly the laws the tokens were drawn from. A chain is a one-path tree; the engine
reads a proposal's shape from its parents and never asks what kind of drafter made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Protocol

import torch

from specgen.config import GenerationConfig, SamplingConfig
from specgen.decoding.acceptance import ProposalKind
from specgen.decoding.events import Origin, is_chain


def embeddable(ids: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """Token ids a draft can embed. Where the pair's heads are padded to different sizes
    (`vocab`: the ids they share), a prompt of ids may hold one past the draft's table: the
    draft reads the last shared id instead. What it drafts is a guess the target checks, so
    the output stays the target's; the draft's own tokens and the target's are always shared."""
    return ids if vocab is None else ids.clamp(max=vocab - 1)


@dataclass(frozen=True, eq=False)
class Proposal:
    """One row's draft: a tree of tokens, a chain being a tree with one path.

    Nodes are numbered from the root: node 0 is the root (the row's last committed token, not
    yet in the target's cache, never part of the proposal), node j >= 1 is `tokens[j - 1]`, and
    `parents[j - 1]` is node j's parent, always a node before it (breadth-first order). Every
    shape the verify forward and the walk need (depths, children, the ancestor mask, paths) is
    derived from the parents on the host, indexed by node (root included), so nothing about the
    tree costs a sync.
    """

    tokens: torch.Tensor  # [n] int64
    parents: tuple[int, ...]  # [n]: parents[j - 1] < j
    kind: ProposalKind
    probs: torch.Tensor | None = None  # SAMPLED: [m, V], row i the law node i's children were drawn from
    replacement: bool = False  # siblings drawn with replacement (multi-draft)
    origin: Origin = Origin.MODEL  # where the tokens came from (a model, the text, the memory)

    def __post_init__(self) -> None:
        if self.tokens.shape[0] != len(self.parents):
            raise ValueError("one parent per proposed token")
        if any(not 0 <= p <= j for j, p in enumerate(self.parents)):
            raise ValueError("a node's parent must precede it (node 0 is the root; breadth-first order)")

    @classmethod
    def chain(
        cls,
        tokens: torch.Tensor,
        kind: ProposalKind,
        probs: torch.Tensor | None = None,
        origin: Origin = Origin.MODEL,
    ) -> "Proposal":
        """x1..xk, each the child of the one before: probs row j is the law x_(j+1) was drawn from."""
        return cls(tokens, tuple(range(tokens.shape[0])), kind, probs, origin=origin)

    @classmethod
    def points(cls, tokens: list[int], origin: Origin, parents: tuple[int, ...] | None = None) -> "Proposal":
        """Copied tokens (prompt lookup, the suffix memory) as point masses: a chain, or the tree
        of `parents` (siblings distinct tokens)."""
        ids = torch.tensor(tokens, dtype=torch.int64)
        if parents is None:
            return cls.chain(ids, ProposalKind.DETERMINISTIC, origin=origin)
        return cls(ids, parents, ProposalKind.DETERMINISTIC, origin=origin)

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> "Proposal":
        return cls(torch.zeros(0, dtype=torch.long, device=device), (), ProposalKind.DETERMINISTIC)

    @property
    def size(self) -> int:
        """Proposed tokens (nodes besides the root)."""
        return len(self.parents)

    @cached_property
    def is_chain(self) -> bool:
        return is_chain(self.parents)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        """Each node's depth, root (0) included."""
        depth = [0] * (self.size + 1)
        for j, parent in enumerate(self.parents, 1):
            depth[j] = depth[parent] + 1
        return tuple(depth)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Each node's children, root included, in index order (= draw order: drafters append
        children in the order they were drawn)."""
        kids: list[list[int]] = [[] for _ in range(self.size + 1)]
        for j, parent in enumerate(self.parents, 1):
            kids[parent].append(j)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool over the nodes, root included: node i may attend to node j iff j
        is i or one of its ancestors."""
        mask = torch.zeros(self.size + 1, self.size + 1, dtype=torch.bool)
        mask[0, 0] = True
        for j, parent in enumerate(self.parents, 1):
            mask[j] = mask[parent]
            mask[j, j] = True
        return mask

    def position_ids(self, cached: int, device=None) -> torch.Tensor:
        """[1, n + 1]: cached length + depth (siblings share a position)."""
        return (torch.tensor(self.depth, device=device) + cached).unsqueeze(0)

    def attention_mask(self, cached: int, device=None) -> torch.Tensor:
        """[1, 1, n + 1, cached + n + 1] bool: every node sees the whole cache and its own ancestors."""
        visible_cache = torch.ones(self.size + 1, cached, dtype=torch.bool)
        return torch.cat([visible_cache, self.ancestor_mask], dim=1).to(device)[None, None]

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root to `node`, both included."""
        path = [node]
        while node:
            node = self.parents[node - 1]
            path.append(node)
        return path[::-1]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path as node indices."""
        return [self.path_to(node) for node, kids in enumerate(self.children) if not kids]


EMPTY = Proposal.empty()  # nothing proposed (frozen: one shared instance)


@dataclass(frozen=True)
class ReadRule:
    """Whether a draft model reads a row's prompt at all: a row whose read would cost more than
    drafting can save drafts nothing, and its rounds are plain ones (lookup's, beside lookup).
    The read costs `price` target steps a token (costs.read_price; None where not measured:
    every row reads); drafting saves `gain` plain steps a generated token against the row's
    rounds without the draft (drafters/model.py for a chain's, tree.py for a tree's)."""

    price: float | None = None
    gain: float = 0.0

    def declines(self, unread: int, config: GenerationConfig | None, stored: bool = False) -> bool:
        """For a row with `unread` prompt tokens to read: only under the floor (a fixed draft
        length always drafts) and where no prefix store keeps the read for later rows (`stored`:
        a server's requests that share a long system prompt could each not pay for reading it,
        but the first one's read serves them all)."""
        if self.price is None or config is None or not config.floor or stored:
            return False
        return unread * self.price > self.gain * config.max_new_tokens


def node_laws(laws: list[torch.Tensor], nodes: int) -> torch.Tensor:
    """A sampled tree's `probs`: the laws its inner nodes' children were drawn from, [F, V] per
    depth in node order, then zero rows for the leaves, which drew nothing ([nodes, V])."""
    probs = torch.cat(laws)
    return torch.cat([probs, probs.new_zeros(nodes - probs.shape[0], probs.shape[1])])


class Drafter(Protocol):
    """The calls the engine makes, rows numbered as in the engine's batch."""

    def join(
        self,
        row: int,
        prompt_ids: list[int],
        generator: torch.Generator | None,
        capacity: int,
        config: GenerationConfig,
    ) -> None:
        """Row `row` starts on a prompt, with its own `config` (which drafting serves it: rows
        of one batch may differ, drafters/mixed.py). `row` is the drafter's next new row, or one it holds
        already (a chat turn, a reused row), which keeps what a `rewind` left valid. `generator`
        is the row's for random draws (None: a greedy row); `capacity` the positions the row may
        reach (caches are preallocated for it)."""

    def leave(self, keep: list[int]) -> None:
        """Only rows `keep` stay, renumbered 0.. in that order."""

    def finished(self, row: int, ids: list[int]) -> None:
        """The row's request is done (it leaves, or stays parked for a next turn) with `ids`
        committed: a drafter with a cache may keep what the row holds for later prompts that
        start the same way, a memory of text what it wrote (drafters/suffix.py)."""

    def rewind(self, row: int, valid: int) -> None:
        """Only the first `valid` tokens of the row's sequence still hold (a new chat turn, a
        deterministic-mode replay that rewrote the rest). Rows never joined are ignored."""

    def propose(
        self, contexts: list[list[int]], ks: list[int], samplings: list[SamplingConfig], features=None
    ) -> list[Proposal]:
        """One proposal per row, rows in order. `contexts[i]` is row i's committed sequence,
        `ks[i]` how many tokens it may draft (a tree drafter builds its tree when ks[i] > 0; 0:
        none), `samplings[i]` its sampling settings, whose `ProposalKind.drafting` says how to
        draft (greedily, or sampling and reporting the laws). `features`: the target's
        hidden states at the layers `taps` names, for every committed position
        (slots.FeatureBuffer; None where it keeps none), as vLLM's proposer takes
        `target_hidden_states`: a drafter reads them here and holds no reference to the
        engine's cache. A row with nothing to propose gets an empty proposal (`EMPTY`)."""

    def observe(self, row: int, path: list[int]) -> None:
        """The accepted nodes of the row's last proposal that were committed (node indices as in
        `Proposal`, root excluded, root to leaf): a drafter with a cache keeps theirs."""

    def setup_seconds(self) -> float:
        """Time spent capturing and compiling its steps (CUDA), for statistics."""

    def taps(self) -> tuple[int, ...]:
        """The target layers whose entering hidden states the drafter reads (an EAGLE head's low,
        middle and high features; empty for every other drafter). The engine's target cache
        keeps them at each committed position (slots.FeatureBuffer), which `propose` is given."""

    def declines(self, row: int) -> bool:
        """Whether the draft model reads and drafts nothing for the joined row `row`, because
        reading its prompt would cost more than drafting can save (drafters/model.py): the
        row's rounds are plain ones (lookup's, beside lookup). Its statistics say so."""

    def widened(self) -> int:
        """A count that grows each time the drafter comes to propose ids it could not before
        (a pruned draft head packing the ids of a script a text turned to: runtime/pruned.py).
        The engine then renews its rows' floors: one its rounds lowered measures afresh, since
        they measured a draft that could not propose the text's tokens (decoding/floor.py)."""


class BaseDrafter:
    """The Drafter hooks most drafters do not need, as no-ops: a drafter keeps nothing for later
    prompts (`finished`), captures no steps (`setup_seconds`), reads no target features
    (`taps`), declines no row (`declines`) and never widens (`widened`) unless it says so."""

    def finished(self, row: int, ids: list[int]) -> None:
        pass

    def setup_seconds(self) -> float:
        return 0.0

    def taps(self) -> tuple[int, ...]:
        return ()

    def declines(self, row: int) -> bool:
        return False

    def widened(self) -> int:
        return 0


class NoDrafter(BaseDrafter):
    """Plain decoding: nothing is ever proposed."""

    def join(self, row, prompt_ids, generator, capacity, config) -> None:
        pass

    def leave(self, keep) -> None:
        pass

    def rewind(self, row, valid) -> None:
        pass

    def propose(self, contexts, ks, samplings, features=None) -> list[Proposal]:
        return [EMPTY] * len(contexts)

    def observe(self, row, path) -> None:
        pass


class RowDrafter(Protocol):
    """What `PerRow` asks of one row's drafter: the Drafter calls for a single sequence."""

    def start(self, prompt_ids: list[int], generator: torch.Generator | None, capacity: int) -> None:
        """`Drafter.join` for this row (it keeps what a `rewind` left valid)."""

    def rewind(self, valid: int) -> None:
        """`Drafter.rewind`: only the first `valid` tokens still hold."""

    def propose(self, context: list[int], k: int, sampling: SamplingConfig) -> Proposal:
        """`Drafter.propose` for this row; called only when k > 0."""

    def observe(self, path: list[int]) -> None:
        """`Drafter.observe`: the committed nodes of its last proposal."""

    def setup_seconds(self) -> float:
        """`Drafter.setup_seconds`."""

    def held(self) -> int:
        """The prompt tokens its draft model holds after `start` (what a chat turn kept); asked
        only where PerRow's read rule is priced (a draft model's rows, not a lookup index's)."""


class PerRow(BaseDrafter):
    """The Drafter protocol's helper for per-row drafters (a tree search: state that serves one
    sequence): one RowDrafter per row, `make` building a joining row's. A row whose prompt read
    costs more than its drafts can save (`read`) drafts nothing, as a chain's (model.py)."""

    def __init__(
        self,
        make: Callable[[], RowDrafter],
        widening: Callable[[], int] = lambda: 0,
        remember: Callable[[list[int]], None] = lambda ids: None,
        read: ReadRule = ReadRule(),
    ):
        self.make = make
        self.widening = widening  # the draft model's count the rows share (`widened`)
        self.remember = remember  # what a finished row's text taught the draft's pruned head
        self.read = read
        self.rows: list[RowDrafter] = []
        self.dear: list[bool] = []  # rows whose read costs more than their drafts can save
        self.spent = 0.0  # setup seconds of rows that left

    def join(self, row, prompt_ids, generator, capacity, config) -> None:
        while row >= len(self.rows):
            self.rows.append(self.make())
            self.dear.append(False)
        self.rows[row].start(prompt_ids, generator, capacity)
        if self.read.price is not None:
            self.dear[row] = self.read.declines(len(prompt_ids) - self.rows[row].held(), config)

    def declines(self, row: int) -> bool:
        return row < len(self.dear) and self.dear[row]

    def leave(self, keep) -> None:
        kept = [self.rows[i] for i in keep if i < len(self.rows)]
        self.spent += sum(d.setup_seconds() for d in self.rows if d not in kept)
        self.rows = kept
        self.dear = [self.dear[i] for i in keep if i < len(self.dear)]

    def rewind(self, row, valid) -> None:
        if row < len(self.rows):
            self.rows[row].rewind(valid)

    def finished(self, row, ids) -> None:
        self.remember(ids)

    def propose(self, contexts, ks, samplings, features=None) -> list[Proposal]:
        return [
            self.rows[row].propose(context, k, sampling) if k > 0 and not self.dear[row] else EMPTY
            for row, (context, k, sampling) in enumerate(zip(contexts, ks, samplings))
        ]

    def observe(self, row, path) -> None:
        self.rows[row].observe(path)

    def setup_seconds(self) -> float:
        return self.spent + sum(d.setup_seconds() for d in self.rows)

    def widened(self) -> int:
        return self.widening()

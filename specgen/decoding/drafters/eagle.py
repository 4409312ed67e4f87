"""Chains from an EAGLE-3 head (models/eagle_head.py): a draft that reads the target's features.

The target's cache keeps, at every committed position, the hidden states entering the head's
layers (`taps`; slots.FeatureBuffer); the engine writes them with every forward it runs
anyway (prefill, verify, replay), so drafting adds no target work and no host sync.

Per row the head keeps its own one-layer K/V cache, indexed by position. Its entry at position
p is computed from the target's features at p and the token at p + 1, and predicts the token
at p + 2. Invariant: a row's head cache holds a prefix of the positions whose features the
target has given (`length` <= committed - 1). A round, for each row with committed tokens
x_0..x_(L-1):

1. feed positions length..L-2 (the target's features there, tokens x_(length+1)..x_(L-1)); the
   logits at L-2 give x_L, the first draft token (a long span, such as a prompt, alone first);
2. K-1 single-token steps: position L-1+j reads the head's own output before its norm at the
   position before, and the token just drafted;
3. the head cache is cut back to L-1 positions: the next round feeds the accepted positions
   again, from the target's own features.

Draft ids are mapped to target ids (d2t). A sampled row draws from the head's law over its
draft vocabulary, reported as a law over the target's (zero outside it), so the acceptance
rule stays exact. With a prefix store the head's K/V of a finished row is kept by its tokens
like a draft model's.
"""

from __future__ import annotations

import torch

from specgen.config import SamplingConfig
from specgen.decoding.acceptance import ProposalKind
from specgen.decoding.drafters.base import BaseDrafter, Proposal, node_laws
from specgen.decoding.length import ChainStops, level_stop
from specgen.decoding.sampling import gumbel_top_k, on_device, sample, warp
from specgen.decoding.shapes import fit_tree
from specgen.models.eagle_head import Eagle3Head, HeadStep
from specgen.runtime import kvcache, slots
from specgen.runtime.compiled import WIDTHS, Steps
from specgen.runtime.prefixes import PrefixStore

CATCH_UP = 4  # positions a row feeds in the batched first step; more are fed row by row first


def head_mode(compile: str, device: torch.device) -> str:
    """The head's fixed-shape mode for the target's `compile`: the same, but inductor's CUDA graphs
    without compiling the head's one layer (graphs), and eager where the CPU compiles the target."""
    if compile == "inductor":
        return "graphs" if torch.device(device).type == "cuda" else "off"
    return compile


class EagleDrafter(BaseDrafter):
    """The Drafter protocol for chains from an EAGLE-3 head (base.py has the calls). With a
    confidence stop (`confidence`, the device's on a CPU: costs.choose prices it by a head step's
    cost) a row's chain ends once the product of the head's top probabilities falls under it
    (length.unsure), as a draft model's does."""

    def __init__(
        self,
        head: Eagle3Head,
        device: torch.device,
        vocab: int,
        prefixes: PrefixStore | None = None,
        compile: str = "off",
        confidence: float = 0.0,
    ):
        self.head, self.device, self.vocab = head, device, vocab
        self.confidence = confidence  # the stop below the draft's likeliest path (length.unsure)
        # the head's batched forwards as fixed-shape steps (CUDA graphs on a GPU, where an eager
        # head step is bound by the host): one for the target's features, one for its own outputs
        mode = head_mode(compile, device)
        widest = max(WIDTHS) if mode != "off" else 0  # eager steps read features as given: no buffers
        self.from_target, self.from_head = (Steps(HeadStep(head, widest), mode) for _ in range(2))
        self.prefixes = prefixes if prefixes is not None else PrefixStore(budget=0)
        self.cache = kvcache.SlotCache(head.cache_config, rows=0)
        self.features: slots.FeatureBuffer | None = None  # the target's, during a `propose` only
        self.map = head.draft_to_target().to(device)  # [Vd] target id of each draft id
        self.generators: list[torch.Generator | None] = []
        self._contexts: list[list[int]] = []

    # -- rows ---------------------------------------------------------------------------------
    def taps(self) -> tuple[int, ...]:
        return self.head.config.layers

    def join(self, row: int, prompt_ids: list[int], generator, capacity: int, config=None) -> None:
        while row >= self.cache.rows:
            self.cache.add_row()
            self.generators.append(None)
            self._contexts.append([])
        self.cache.reserve(capacity)
        # position p holds token p + 1: a prompt of n tokens fills at most n - 2 positions before its round
        have = min(self.cache.lengths[row], max(len(prompt_ids) - 2, 0))
        kvcache.set_length(self.cache, row, have)
        # stored by the tokens their positions read (the key's last token is the last position's)
        loaded = self.prefixes.load(self.cache, row, prompt_ids, have=have + 1)
        if loaded > have + 1:
            kvcache.set_length(self.cache, row, loaded - 1)
        self.generators[row] = on_device(generator, self.device)
        self._contexts[row] = prompt_ids

    def finished(self, row: int, ids: list[int]) -> None:
        if row < self.cache.rows:
            self._save(row, self._contexts[row])

    def leave(self, keep: list[int]) -> None:
        keep = [i for i in keep if i < self.cache.rows]
        self.cache.select(keep)
        self.generators = [self.generators[i] for i in keep]
        self._contexts = [self._contexts[i] for i in keep]

    def rewind(self, row: int, valid: int) -> None:
        if row < self.cache.rows:
            kvcache.set_length(self.cache, row, min(self.cache.lengths[row], max(valid - 1, 0)))

    def observe(self, row: int, path: list[int]) -> None:
        """Nothing to keep: the head's drafted positions were cut at the proposal."""

    def setup_seconds(self) -> float:
        return self.from_target.setup_seconds + self.from_head.setup_seconds

    # -- a round ------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(
        self, contexts: list[list[int]], ks: list[int], samplings: list[SamplingConfig], features=None
    ) -> list[Proposal]:
        self.features = features
        try:
            started = self._start(contexts, ks)
            if started is None:
                return [Proposal.empty(self.device) for _ in contexts]
            ks, ends, logits, hidden = started
            proposals = self._draft(ks, logits, hidden, samplings)
        finally:
            self.features = None  # the engine's, never held past the round
        # the next round feeds accepted positions from the target's features
        kvcache.set_lengths(self.cache, [min(end, length) for end, length in zip(ends, self.cache.lengths)])
        return proposals

    def _draft(
        self, ks: list[int], logits: torch.Tensor, hidden: torch.Tensor, samplings: list[SamplingConfig]
    ) -> list[Proposal]:
        """Each row's chain of ks[i] tokens from the head's logits [rows, Vd] and outputs [rows, 1, H]
        at its last committed position (steps 2 of the module docstring)."""
        count, steps = len(ks), max(ks)
        kinds = [ProposalKind.drafting(sampling) for sampling in samplings]
        sampled = ProposalKind.SAMPLED in kinds  # laws are built only when some row samples
        tokens, laws = [], []
        stops = ChainStops(self.confidence, ks)  # where each row's draft ends
        token = None  # each step after the first reads the step before's tokens
        for step in range(steps):
            if step:
                logits, hidden = self._forward(token.view(count, 1), hidden)
                logits = logits[:, -1]
            if sampled:
                token, law = self._sample(logits, samplings)
                laws.append(law)
            else:
                token, law = self.map[logits.argmax(dim=-1)], None
            tokens.append(token)
            if step == steps - 1 or stops.after(step, logits, law):
                break
        drafted = torch.stack(tokens, dim=1)
        stacked = torch.stack(laws, dim=1) if sampled else None  # [rows, K, V]: a sampled row's laws
        return [
            Proposal.chain(
                drafted[i, :k], kinds[i], stacked[i, :k] if kinds[i] is ProposalKind.SAMPLED else None
            )
            if k > 0
            else Proposal.empty(self.device)
            for i, k in enumerate(stops.ends)
        ]

    def _start(self, contexts: list[list[int]], ks: list[int]):
        """Feed every row's positions up to its last committed one from the target's features
        (steps 1 of the module docstring): (each row's k, each row's last committed position,
        the head's logits there [rows, Vd] and its outputs there [rows, 1, H]), or None when no
        row drafts."""
        count = len(contexts)
        self._contexts = list(contexts)
        self._catch_up(contexts, ks)
        ends = [len(context) - 1 for context in contexts]  # positions with the target's features
        for row, (length, end) in enumerate(zip(self.cache.lengths, ends)):
            if length >= end > 0:  # a row rewound to its last position: feed that one again
                kvcache.set_length(self.cache, row, end - 1)
        # a one-token prompt has no features yet: it feeds a pad and drafts nothing this round
        news = [range(length, max(end, length + 1)) for length, end in zip(self.cache.lengths, ends)]
        ks = [k if end > 0 else 0 for k, end in zip(ks, ends)]
        if not max(ks):
            return None
        width = max(len(new) for new in news)
        ids = torch.zeros(count, width, dtype=torch.long)
        features = self._features(news, width)
        for i, (context, new) in enumerate(zip(contexts, news)):
            ids[i, : len(new)] = torch.tensor(context[new.start + 1 : new.stop + 1], dtype=torch.long)
        if all(len(new) == width for new in news):  # one width: the output layer reads the last position only
            logits, hidden = self._forward(ids.to(self.device), features, keep=1)
            logits, hidden = logits[:, -1], hidden[:, -1:]
        else:
            last = torch.tensor([len(new) - 1 for new in news], device=self.device)
            logits, hidden = self._forward(ids.to(self.device), features)
            rows = torch.arange(count, device=self.device)
            logits, hidden = logits[rows, last], hidden[rows, last][:, None]
        kvcache.set_lengths(self.cache, [new.start + len(new) for new in news])  # drop the pads
        return ks, ends, logits, hidden

    def _features(self, news: list[range], width: int, first: int = 0) -> torch.Tensor:
        """[rows, width, taps * H]: the target's features at each row's new positions (zeros past
        them, and where the target kept none); rows from `first` on."""
        held = self.features
        size = len(self.head.config.layers) * self.head.config.hidden_size
        out = torch.zeros(len(news), width, size, device=self.device)
        if held is None or not held.is_initialized:
            return out
        for i, new in enumerate(news):
            if len(new):
                end = min(new.stop, held.capacity)
                out[i, : end - new.start] = held.read(first + i, new.start, end).to(self.device, out.dtype)
        return out

    def _forward(self, ids: torch.Tensor, features: torch.Tensor, keep: int = 0, **where):
        """The head over `ids` [rows, n] at each row's next positions (`where`: kvcache.forward's
        rows, offset, depth and tree), reading the target's features or its own outputs:
        (logits [rows, n|keep, Vd], outputs [rows, n|keep, H])."""
        steps = self.from_head if features.shape[-1] == self.head.config.hidden_size else self.from_target
        steps.model.feed(features)
        return steps.model.split(steps.forward(self.cache, ids, keep=keep, **where))

    def _catch_up(self, contexts: list[list[int]], ks: list[int]) -> None:
        """A row far behind (a new prompt) feeds all but its last CATCH_UP positions alone."""
        for row, (context, length, k) in enumerate(zip(contexts, self.cache.lengths, ks)):
            end = len(context) - 1 - CATCH_UP
            if k > 0 and end > length:
                features = self._features([range(length, end)], end - length, first=row)
                rows = slice(row, row + 1) if self.cache.rows > 1 else None
                self._forward(
                    torch.tensor([context[length + 1 : end + 1]], device=self.device),
                    features,
                    keep=1,
                    rows=rows,
                )
                self._save(row, context)

    def _save(self, row: int, context: list[int]) -> None:
        """The row's positions into the prefix store, keyed by the tokens they read (one more)."""
        held = self.cache.lengths[row]
        if held:
            self.prefixes.save(self.cache, row, context[: held + 1])

    def _sample(self, logits: torch.Tensor, samplings: list[SamplingConfig]):
        """When any row samples: each row's target token and the laws over the target's vocabulary."""
        dist = torch.stack([warp(logits[i], s) for i, s in enumerate(samplings)])  # [rows, Vd]
        index = torch.stack(
            [
                dist[i].argmax() if s.greedy else sample(dist[i], self.generators[i])
                for i, s in enumerate(samplings)
            ]
        )
        law = torch.zeros(len(samplings), self.vocab, device=dist.device)
        law.scatter_(1, self.map.expand(len(samplings), -1), dist)
        return self.map[index], law


class EagleTreeDrafter(EagleDrafter):
    """RSD-C trees from an EAGLE-3 head (`--method rsd-c` with a head as the draft): each node at
    depth l gets `branching[l]` children, the head's top ones when greedy, Gumbel-top-k draws
    without replacement from its law (over the target's vocabulary, zero outside the draft's)
    when sampling, so RSD-C's acceptance rule stays exact. A row whose floor lowered its budget
    drafts the largest tree of that shape within it (shapes.fit_tree), as a draft model's row does.

    A round starts as a chain's does (`_start`); then, per row, each depth but the last is one
    head forward over its nodes, each reading its parent's output and seeing the committed
    positions and its own ancestors (the tree mask). Node i (breadth-first, root 0) sits in the
    head's cache at slot length + i - 1, at position length + depth(i) - 1; the cache is cut
    back to the committed positions afterwards, as after a chain. With a confidence stop the tree
    grows no deeper once every node of its newest level is under it (length.level_stop), as a
    draft model's tree."""

    def __init__(
        self,
        head: Eagle3Head,
        device: torch.device,
        vocab: int,
        levels: tuple[int, ...],
        prefixes: PrefixStore | None = None,
        compile: str = "off",
        confidence: float = 0.0,
    ):
        super().__init__(head, device, vocab, prefixes, compile, confidence)
        self.levels = levels  # the whole tree's nodes at each depth (GenerationConfig.tree_levels)

    def _draft(self, ks, logits, hidden, samplings) -> list[Proposal]:
        return [
            self._tree(row, k, logits[row : row + 1], hidden[row], samplings[row])
            if k > 0
            else Proposal.empty(self.device)
            for row, k in enumerate(ks)
        ]

    def _tree(
        self, row: int, k: int, logits: torch.Tensor, hidden: torch.Tensor, sampling: SamplingConfig
    ) -> Proposal:
        """One row's tree within `k` nodes (the largest of its shape: shapes.fit_tree, as the draft
        model's trees) from the head's logits [1, Vd] and outputs [1, H] at its last committed
        position."""
        kind = ProposalKind.drafting(sampling)
        sampled = kind is ProposalKind.SAMPLED
        base = self.cache.lengths[row]
        parents: list[int] = []
        tokens: list[torch.Tensor] = []
        laws: list[torch.Tensor] = []
        frontier, reach = [0], None
        levels = fit_tree(self.levels, k)
        for level, size in enumerate(levels):
            b = size // len(frontier)  # the level's branching, or fewer (shapes.fit_tree)
            dist = None
            if sampled:
                dist = warp(logits, sampling)  # [F, Vd]
                picks, _ = gumbel_top_k(dist, min(b, dist.shape[-1]), self.generators[row])
                law = torch.zeros(len(frontier), self.vocab, device=dist.device)
                laws.append(law.scatter_(1, self.map.expand(len(frontier), -1), dist))
            else:
                picks = torch.topk(logits, min(b, logits.shape[-1]), dim=-1).indices
            per = picks.shape[1]
            start = len(parents) + 1
            new_parents = [f for f in frontier for _ in range(per)]
            parents.extend(new_parents)
            tokens.append(self.map[picks.reshape(-1)])
            last = level == len(levels) - 1
            if self.confidence > 0 and not last:  # the stop on the tree's depth, as a draft model's
                reach, last = level_stop(self.confidence, frontier, new_parents, logits, dist, reach)
            frontier = list(range(start, len(parents) + 1))
            if last:
                break
            tree = Proposal(torch.cat(tokens), tuple(parents), kind)
            logits, hidden = self._feed(row, base, tree, frontier, hidden.repeat_interleave(per, dim=0))
        kvcache.set_length(self.cache, row, base)
        drafted = torch.cat(tokens)
        probs = node_laws(laws, len(parents) + 1) if sampled else None
        return Proposal(drafted, tuple(parents), kind, probs)

    def _feed(self, row: int, base: int, tree: Proposal, frontier: list[int], inputs: torch.Tensor):
        """The head over the frontier's nodes (their parents' outputs `inputs` [F, H]) with the tree
        mask: (logits [F, Vd], outputs [F, H])."""
        first, last = frontier[0], frontier[-1]
        kvcache.set_length(
            self.cache, row, base
        )  # the nodes fed before sit in slots base .. base + first - 2
        mask = tree.ancestor_mask[
            first : last + 1, 1 : last + 1
        ]  # [F, last]: the round's slots are nodes 1..last
        depth = torch.tensor(tree.depth[1 : last + 1]) - 1  # node i's position: base + depth(i) - 1
        rows = slice(row, row + 1) if self.cache.rows > 1 else None
        logits, hidden = self._forward(
            tree.tokens[first - 1 : last][None],
            inputs[None],
            offset=first - 1,
            depth=depth,
            tree=mask,
            rows=rows,
        )
        return logits[0], hidden[0]

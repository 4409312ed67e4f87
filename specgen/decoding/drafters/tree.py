"""Tree drafters: RSD-C (Gumbel-top-k children), RSD-S (stochastic beam search) and
multi-draft (independent draws with replacement), each building its tree with one batched
draft forward per depth, using the same ancestor masking as the target's verification.

A round's tree is the largest of the method's shape within the k nodes the row may draft
(shapes.fit_tree): the whole tree, or where the row's floor lowered k or started it lower
(decoding/floor.py), the deepest of the largest trees with fewer levels or fewer children per
node (a narrower beam), down to one node. On a 2-core CPU a whole tree of 10-12 nodes costs
about three plain steps a round (three or four draft forwards and an 11-13-token verify).
Drafted whole or not at all, trees ran at 0.97-0.98x plain decoding over 32 prompts and at
0.60-0.66x on a German translation (benchmarks/floor.md).

With a confidence stop (`confidence`, the device's for a draft on the CPU: length.unsure) a tree
grows no deeper once every node of its newest level has a reach under the stop: the product of
the top probabilities of the laws along its path, as a chain's stop reads them. The decision
reads the laws the next level would be drawn from, never the draws (ALGORITHMS.md section 5).

They draft one row each (base.PerRow serves them to the engine): a tree search is per row. A
row whose prompt read would cost more than its trees can save drafts nothing, as a chain's
(drafters/model.py), at a tree's gain (GAIN_TREE): on a 2-core Zen 4 at 64 tokens the trees ran
at 0.91-1.10x plain (about 0.98x on average) on the long summaries this declines, and a declined
row does plain decoding's work in its time (benchmarks/floor.md, "Tree rows read a prompt only
where their trees can pay").

Draft cache layout during a round: the committed context in slots [0, n), the root being the
context's last token at slot n-1, and tree node i (i >= 1, BFS order) at slot n-1+i once fed.
Leaves at the last depth are never fed; after the verdict the accepted path is compacted
into contiguous slots and an unfed accepted leaf is fed at the start of the next round.
"""

from __future__ import annotations

import abc

import torch

from specgen.config import SamplingConfig
from specgen.decoding.acceptance import ProposalKind
from specgen.decoding.drafters.base import Proposal, embeddable, node_laws
from specgen.decoding.length import level_stop
from specgen.decoding.sampling import gumbel, gumbel_top_k, log1mexp, on_device, warp
from specgen.decoding.shapes import fit_tree
from specgen.runtime import kvcache
from specgen.runtime.compiled import Steps

# what a tree draft saves a generated token, in plain steps, against plain rounds: the trees ran
# at 1.11-1.15x plain over 32 prompts on a 2-core Zen 4 (benchmarks/floor.md), 1 - 1/1.11 = 0.1
GAIN_TREE = 0.1


class TreeDrafter(abc.ABC):
    """One row's tree drafting (the RowDrafter calls of base.py); subclasses choose the children
    of a frontier."""

    replacement = False

    def __init__(
        self,
        model,
        device,
        levels: tuple[int, ...],
        vocab: int | None = None,
        compile: str = "off",
        confidence: float = 0.0,
    ):
        # the whole tree's nodes at each depth (GenerationConfig.tree_levels, the one place they
        # are derived from a method's shape)
        self.model, self.device, self.vocab, self.levels = model, device, vocab, levels
        self.confidence = confidence  # the stop below the tree's likeliest path (length.unsure)
        self.steps = Steps(model, compile, exact=False)
        self.cache = kvcache.new_cache(model)
        self.generator: torch.Generator | None = None
        self.cached = 0  # committed tokens in the cache
        self._fed_nodes = 0  # tree nodes (after the root) fed to the cache last round
        self._base = 0  # the context length at the last proposal

    def start(self, prompt_ids: list[int], generator, capacity: int) -> None:
        """Keep what a rewind left valid of the prompt; the rest is fed lazily, with the first
        proposal, so a row whose first rounds draft nothing costs no draft forward yet."""
        self.cache.reserve(capacity)
        self.generator = on_device(generator, self.device)
        self.cached = min(self.cached, len(prompt_ids) - 1)
        kvcache.crop(self.cache, self.cached)

    def rewind(self, valid: int) -> None:
        self.cached = min(self.cached, valid)
        kvcache.crop(self.cache, self.cached)

    def held(self) -> int:
        return self.cached

    def setup_seconds(self) -> float:
        return self.steps.setup_seconds

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, sampling: SamplingConfig) -> Proposal:
        """The largest tree of the method's shape within `k` nodes (see the module)."""
        levels = fit_tree(self.levels, k)
        n = len(context)
        unseen = torch.tensor([context[self.cached :]], device=self.device)
        root = unseen[0, -1:]
        logits = self._forward(unseen)[0, -1:, : self.vocab]  # root's next-token logits
        self.cached = n
        kind = ProposalKind.drafting(sampling)
        sampled = kind is ProposalKind.SAMPLED
        parents: list[int] = []  # node j's parent is parents[j - 1] (Proposal's numbering)
        tokens: list[torch.Tensor] = []
        laws: list[torch.Tensor] = []  # sampled: p(.|node) of every node with children, in node order
        frontier, scores, reach = [0], None, None
        for level, size in enumerate(levels):
            dist = warp(logits, sampling) if sampled else logits  # greedy: children from the draft's logits
            if sampled:
                laws.append(dist)
            new_parents, new_tokens, scores = self._children(
                level, frontier, dist, scores, kind, self.generator, size
            )
            if not new_parents:
                break
            start = len(parents) + 1
            parents.extend(new_parents)
            tokens.append(new_tokens)
            last = level == len(levels) - 1
            if self.confidence > 0 and not last:
                reach, last = level_stop(
                    self.confidence, frontier, new_parents, logits, dist if sampled else None, reach
                )
            frontier = list(range(start, len(parents) + 1))
            if last:
                break
            logits = self._feed(root, Proposal(torch.cat(tokens), tuple(parents), kind), frontier, n)
        self._base, self._fed_nodes = n, (frontier[0] - 1 if parents else 0)
        drafted = torch.cat(tokens) if tokens else root.new_zeros(0)
        probs = node_laws(laws, len(parents) + 1) if sampled else None
        return Proposal(drafted, tuple(parents), kind, probs, self.replacement)

    def observe(self, path: list[int]) -> None:
        """Keep the root and the accepted nodes that were fed; drop every other tree slot."""
        fed = [node for node in path if node <= self._fed_nodes]
        keep = torch.tensor([0] + fed, device=self.device)
        kvcache.crop(self.cache, self._base + self._fed_nodes)
        kvcache.keep_positions(self.cache, self._base - 1, keep)
        self.cached = self._base + len(fed)

    def _forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.steps.forward(self.cache, embeddable(input_ids, self.vocab), keep=1)

    def _feed(self, root: torch.Tensor, tree: Proposal, frontier: list[int], n: int) -> torch.Tensor:
        """One batched forward over the frontier with the tree mask -> their logits.

        The root sits at slot n-1 and node i at slot n-1+i: with the cache cut back to n-1, the
        frontier is written at offset `first`, and sees the nodes fed before it in their slots.
        """
        first, last = frontier[0], frontier[-1]
        kvcache.crop(self.cache, n - 1)
        logits = self.steps.tree(
            self.cache, torch.cat([root, tree.tokens]), tree, offset=first, nodes=slice(first, last + 1)
        )
        return logits[0, :, : self.vocab]

    @abc.abstractmethod
    def _children(
        self,
        level: int,
        frontier: list[int],
        dist: torch.Tensor,
        scores: torch.Tensor | None,
        kind: ProposalKind,
        generator,
        size: int,
    ) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """The `size` children of the frontier's nodes, grouped by parent, each group in draw
        order: (each child's parent node, their tokens [C], what the next depth carries (RSD-S's
        scores)). `dist` [F, V] is the frontier's warped law when `kind` is SAMPLED, its
        logits when GREEDY."""


class RSDConstant(TreeDrafter):
    """RSD-C: each node at depth l gets b_l children by Gumbel-top-k (without replacement); its
    `levels` are b_1, b_1 b_2, ... (GenerationConfig.tree_levels)."""

    def _children(self, level, frontier, dist, scores, kind, generator, size):
        b = size // len(frontier)  # each node's: the level's b_l, or fewer (shapes.fit_tree)
        if kind is ProposalKind.GREEDY:  # greedy target: deterministic top-b children are fine
            tokens = torch.topk(dist, b, dim=-1).indices
        else:
            tokens, _ = gumbel_top_k(dist, b, generator)
        return [f for f in frontier for _ in range(b)], tokens.reshape(-1), None


class MultiDraft(RSDConstant):
    """The baseline: b_l independent draws with replacement per node (SpecInfer-style)."""

    replacement = True

    def _children(self, level, frontier, dist, scores, kind, generator, size):
        if kind is ProposalKind.GREEDY:
            return super()._children(level, frontier, dist, scores, kind, generator, size)
        b = size // len(frontier)
        tokens = torch.multinomial(dist, b, replacement=True, generator=generator)
        return [f for f in frontier for _ in range(b)], tokens.reshape(-1), None


class RSDStochasticBeam(TreeDrafter):
    """RSD-S: stochastic beam search, beam width W, depth L: `levels` (W,) * L (ALGORITHMS.md
    section 5)."""

    def _children(self, level, frontier, dist, scores, kind, generator, size):
        width, count = size, len(frontier)  # the beam's width, or narrower (shapes.fit_tree)
        greedy = kind is ProposalKind.GREEDY
        log_p = torch.log_softmax(dist.float(), dim=-1) if greedy else dist.log()
        if level == 0:  # the root: phi = G = 0
            scores = torch.zeros(count, 2, device=dist.device)
        phi = scores[:, :1] + log_p  # [F, V]
        if greedy:  # plain beam search on the draft's log-probabilities
            keys = phi
        else:
            perturbed = phi + gumbel(phi.shape, generator, phi.device)
            z = perturbed.max(dim=-1, keepdim=True).values
            pre = torch.topk(perturbed, min(width, perturbed.shape[-1]), dim=-1)  # per-parent top-W
            g_parent = scores[:, 1:]
            v = g_parent - pre.values + log1mexp((pre.values - z).clamp_max(0.0))
            truncated = g_parent - v.clamp_min(0.0) - torch.log1p(torch.exp(-v.abs()))
            keys = torch.full_like(phi, float("-inf")).scatter(1, pre.indices, truncated)
        flat = torch.topk(keys.reshape(-1), min(width, keys.numel()))
        vocab = keys.shape[-1]
        parent_rows, child_tokens = flat.indices // vocab, flat.indices % vocab
        # group by parent (BFS order), each parent's children in descending key order
        parent_of = parent_rows.tolist()  # the structure must be known on the host (W ints)
        order = sorted(range(len(parent_of)), key=lambda j: (parent_of[j], j))  # topk: keys descend
        order_t = torch.tensor(order, device=keys.device)
        rows, tokens = parent_rows.index_select(0, order_t), child_tokens.index_select(0, order_t)
        kept_phi = phi[rows, tokens].unsqueeze(1)
        kept_g = flat.values.index_select(0, order_t).unsqueeze(1)
        return [frontier[parent_of[j]] for j in order], tokens, torch.cat([kept_phi, kept_g], 1)

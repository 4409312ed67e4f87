"""The acceptance rules, and the one place that chooses between them.

Notation (docs/ALGORITHMS.md): p = draft distribution, q = target distribution, both warped.
Every rule, chain or tree, returns the same `Verdict`, on the device: whether each proposed
node passes its test once the walk reaches its parent, and the token the target contributes
wherever the walk stops (the correction at a rejection, or the bonus after a leaf). The engine
reads every row's verdict in one sync, and `walk` turns it into the accepted path on the host:
from the root, descend into the first child that passes; stop where none does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from specgen.config import AcceptanceMode, SamplingConfig


class ProposalKind(enum.Enum):
    """What a drafter's tokens are, which decides the acceptance rule (and how a drafter drafts:
    `drafting` gives the kind a row's sampling asks for)."""

    SAMPLED = "sampled"  # drawn from the reported distribution p
    GREEDY = "greedy"  # the draft's argmax (a greedy row): point masses, no law reported
    DETERMINISTIC = "deterministic"  # other point masses: lookup, text drafts, scripted drafters

    @staticmethod
    def drafting(sampling: SamplingConfig) -> "ProposalKind":
        """How a draft model drafts for a row with these settings: greedily, or by sampling."""
        return ProposalKind.GREEDY if sampling.greedy else ProposalKind.SAMPLED


class Rule(enum.Enum):
    TARGET_ONLY = "target-only"  # nothing proposed: the target's own token
    GREEDY_MATCH = "greedy-match"  # accept while x_i equals the target's choice (argmax or keyed draw)
    SPECULATIVE_SAMPLING = "speculative-sampling"  # min(1, q/p), residual norm(max(0, q - p))
    POINT_MASS_SAMPLING = "point-mass-sampling"  # the same with p = one-hot(x_i)
    GREEDY_TREE = "greedy-tree"  # descend into the child equal to the target's choice
    RECURSIVE_REJECTION = "recursive-rejection"  # siblings tried in draw order (section 3)
    POINT_MASS_TREE = "point-mass-tree"  # the same with p = one-hot(child): siblings of copied text
    SYNTHETIC = (
        "synthetic"  # benchmarks only: a recorded accepted length, then the target's token (synthetic.py)
    )


def select_rule(
    greedy: bool, kind: ProposalKind, size: int, chain: bool, mode: AcceptanceMode = AcceptanceMode.REAL
) -> Rule:
    """The rule for one row's proposal, from the sampling settings (`greedy`: argmax or keyed
    choices) and what was proposed: how many tokens, a chain or a tree, and their kind; in
    SYNTHETIC mode (benchmarks) every chain takes the replayed rule."""
    if size == 0:
        return Rule.TARGET_ONLY
    if mode is AcceptanceMode.SYNTHETIC:
        if not chain:
            raise ValueError("synthetic acceptance replays chains; GenerationConfig refuses tree methods")
        return Rule.SYNTHETIC
    if not chain:
        if greedy:
            return Rule.GREEDY_TREE
        return Rule.RECURSIVE_REJECTION if kind is ProposalKind.SAMPLED else Rule.POINT_MASS_TREE
    if greedy:
        return Rule.GREEDY_MATCH
    return Rule.SPECULATIVE_SAMPLING if kind is ProposalKind.SAMPLED else Rule.POINT_MASS_SAMPLING


@dataclass(frozen=True)
class Verdict:
    """What a rule decided for one row's proposal of n nodes, on the device (nodes as in
    `Proposal`: 0 is the root, j >= 1 the proposal's j-th token)."""

    passed: torch.Tensor  # [n] bool: node j + 1 passes its test once the walk reaches its parent
    token: torch.Tensor  # [n + 1] int64: the target's token when the walk stops at node i

    @classmethod
    def chain(cls, accepted: torch.Tensor, token: torch.Tensor, k: int) -> "Verdict":
        """A chain rule's outcome: the first `accepted` (0-dim) of k nodes pass, then `token`."""
        return cls(torch.arange(k, device=token.device) < accepted, token.expand(k + 1))

    @property
    def accepted(self) -> torch.Tensor:
        """0-dim int64, for a chain: how many nodes the walk accepts (the passing prefix)."""
        return self.passed.to(torch.int64).cumprod(dim=0).sum()

    @property
    def chosen(self) -> torch.Tensor:
        """0-dim int64, for a chain: the target's token where the walk stops."""
        return self.token.index_select(0, self.accepted.view(1))[0]


def walk(
    children: tuple[tuple[int, ...], ...], passed: list, token: list[int]
) -> tuple[list[int], int, list[int]]:
    """A verdict read to the host, walked from the root: (the accepted path, root excluded; the
    target's token where it stops; the children tried and rejected on the way, in order)."""
    node, path, tried = 0, [], []
    while True:
        for child in children[node]:
            if passed[child - 1]:
                path.append(child)
                node = child
                break
            tried.append(child)
        else:
            return path, token[node], tried


def greedy_match(draft_tokens: torch.Tensor, target_choice: torch.Tensor) -> Verdict:
    """Accept the longest prefix with x_i == the target's choice c_(i-1); then c at the stop.

    target_choice [k+1] is argmax q under greedy decoding, or the keyed draws of
    deterministic mode (see replay.keyed_choice); draft_tokens [k].
    """
    k = draft_tokens.shape[0]
    return Verdict(draft_tokens == target_choice[:k], target_choice)


def speculative_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Leviathan/Chen rule: accept x_i w.p. min(1, q(x_i)/p(x_i)); residual norm(max(0, q - p)).

    draft_probs [k, V] is the exact distribution each x_i was drawn from; target_probs [k+1, V].
    Always consumes k uniforms and one categorical draw, so the generator's stream does not
    depend on the outcome.
    """
    k, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    rows = torch.arange(k, device=target_probs.device)
    p_x = draft_probs[rows, draft_tokens]
    padded = torch.cat([draft_probs, draft_probs.new_zeros(1, vocab)])  # p_k (after full acceptance) is zero
    return _chain(draft_tokens, p_x, lambda stop: padded.index_select(0, stop)[0], target_probs, generator)


def point_mass_sampling(
    draft_tokens: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> Verdict:
    """The same rule for deterministic proposals (lookup, argmax drafts): p_i = one-hot(x_i), so
    x_i is accepted w.p. q(x_i) and a rejection draws from norm(q - one-hot(x_i))^+."""
    k, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    device = target_probs.device
    padded_tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(1)])

    def p_row(stop: torch.Tensor) -> torch.Tensor:
        row = torch.zeros(vocab, device=device)
        return row.scatter_(0, padded_tokens.index_select(0, stop), (stop < k).to(row.dtype))

    ones = torch.ones(k, device=device, dtype=target_probs.dtype)
    return _chain(draft_tokens, ones, p_row, target_probs, generator)


def _chain(draft_tokens, p_x, p_row, target_probs, generator) -> Verdict:
    """Accept x_i w.p. min(1, q(x_i)/p(x_i)) in order; at the stop, draw from norm(q - p)^+."""
    k = draft_tokens.shape[0]
    device = target_probs.device
    q_x = target_probs[torch.arange(k, device=device), draft_tokens]
    uniforms = torch.rand(k, generator=generator, device=device)
    passed = uniforms * p_x < q_x  # u < q/p without dividing
    accepted = passed.to(torch.int64).cumprod(dim=0).sum()
    stop = accepted.view(1)
    q_row = target_probs.index_select(0, stop)[0]
    residual = (q_row - p_row(stop)).clamp_min(0.0)
    total = residual.sum()
    # sum(r) == 0 only through rounding (q == p on the support): fall back to q itself.
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), q_row)
    token = torch.multinomial(residual, 1, generator=generator)[0]
    return Verdict(passed, token.expand(k + 1))


# -- trees -------------------------------------------------------------------------------------


def greedy_tree(parents: tuple[int, ...], tokens: torch.Tensor, choice: torch.Tensor) -> Verdict:
    """A chosen target token per node (argmax, or keyed draws): a node passes when it equals
    its parent's choice (the walk takes the first such child); where the walk stops, that
    node's choice. tokens [n] (the proposal's), choice [n + 1] (root first)."""
    parent_index = torch.tensor(parents, dtype=torch.long).to(choice.device)
    return Verdict(tokens == choice.index_select(0, parent_index), choice)


def _siblings(children, inner: list[int], widest: int, tokens: torch.Tensor):
    """The inner nodes' children laid out [m, widest] on the device, every index in ONE copy:
    (the inner nodes; their children's tokens, in draw order; which cells hold a child; for
    each proposed node, its cell; and its index), nodes in BFS order."""
    n, m, cells = tokens.shape[0], len(inner), len(inner) * widest
    kids = torch.full((m, widest), -1, dtype=torch.int64)
    for row, node in enumerate(inner):
        kids[row, : len(children[node])] = torch.tensor(children[node])
    flat = kids.view(-1)
    slots = (flat >= 0).nonzero().squeeze(1)  # the cells that hold a child, in node order
    packed = torch.cat(
        [torch.tensor(inner), flat.clamp_min(1) - 1, (flat >= 0).long(), slots, flat[slots] - 1]
    )
    packed = packed.to(tokens.device)
    index, kid_index = packed[:m], packed[m : m + cells]
    valid = packed[m + cells : m + 2 * cells].view(m, widest) > 0
    cell_index, child_index = packed[m + 2 * cells : m + 2 * cells + n], packed[m + 2 * cells + n :]
    return index, tokens.index_select(0, kid_index).view(m, widest), valid, cell_index, child_index


def recursive_rejection(
    children: tuple[tuple[int, ...], ...],
    tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    *,
    replacement: bool,
) -> Verdict:
    """Recursive rejection sampling over a tree (ALGORITHMS.md section 3).

    At each node the children are tried in draw order: accept x_k w.p. min(1, q_k(x_k)/p_k(x_k));
    on rejection q_(k+1) = norm(max(q_k - p_k, 0)) and, without replacement,
    p_(k+1) = p_k with x_k removed and renormalised (with replacement p is left alone).
    If every child is rejected (or there are none) the node emits y ~ q_(K+1).
    tokens [n] (the proposal's); draft_probs [N, V]: p(.|node) for nodes with children;
    target_probs [N, V]: q(.|node), N = n + 1 nodes, root first. Everything is computed for all
    nodes at once, on the device (the tree's indices copied there once), and the number of
    random draws does not depend on the outcomes.
    """
    size, vocab = target_probs.shape
    n, widest = size - 1, max(len(c) for c in children)
    device = target_probs.device
    inner = [i for i in range(size) if children[i]]
    passed = torch.zeros(n, dtype=torch.bool, device=device)
    final = target_probs.clone()  # q_(K+1) per node; leaves keep q (the bonus distribution)
    if inner:
        index, kid_tokens, valid, cell_index, child_index = _siblings(children, inner, widest, tokens)
        m = len(inner)
        q = target_probs.index_select(0, index)
        p = draft_probs.index_select(0, index).float()
        uniforms = torch.rand(m, widest, generator=generator, device=device)
        tests = []
        for k in range(widest):
            x = kid_tokens[:, k : k + 1]
            q_x, p_x = q.gather(1, x), p.gather(1, x)
            tests.append((uniforms[:, k : k + 1] * p_x < q_x).squeeze(1))
            residual = (q - p).clamp_min(0.0)
            total = residual.sum(dim=1, keepdim=True)
            step = valid[:, k : k + 1]
            q = torch.where(step & (total > 0), residual / total.clamp_min(1e-30), q)
            if not replacement:
                removed = p.scatter(1, x, 0.0)
                p = torch.where(step, removed / (1.0 - p_x).clamp_min(1e-30), p)
        final.index_copy_(0, index, q)
        passed.index_copy_(0, child_index, torch.stack(tests, dim=1).view(-1).index_select(0, cell_index))
    draws = torch.multinomial(final, 1, generator=generator).squeeze(1)  # [N]
    return Verdict(passed, draws)


def point_mass_tree(
    children: tuple[tuple[int, ...], ...],
    tokens: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Recursive rejection over a tree of point masses (a suffix memory's branches): at each node
    the children, distinct tokens, are tried in order, child x with p = one-hot(x): accepted
    w.p. q(x); on rejection q = norm(q with x removed). If every child is rejected (or there
    are none) the node emits y ~ q with every child removed. The token the walk leaves a node
    with is thus a draw from q itself, whatever the children (ALGORITHMS.md section 3 with
    one-hot p). tokens [n]; target_probs [N, V], N = n + 1 nodes, root first. The number of
    random draws does not depend on the outcomes."""
    size, _ = target_probs.shape
    n, widest = size - 1, max(len(c) for c in children)
    device = target_probs.device
    inner = [i for i in range(size) if children[i]]
    passed = torch.zeros(n, dtype=torch.bool, device=device)
    final = target_probs.clone()
    if inner:
        index, kid_tokens, valid, cell_index, child_index = _siblings(children, inner, widest, tokens)
        q = target_probs.index_select(0, index)
        uniforms = torch.rand(len(inner), widest, generator=generator, device=device)
        tests = []
        for k in range(widest):
            x, step = kid_tokens[:, k : k + 1], valid[:, k : k + 1]
            tests.append((uniforms[:, k : k + 1] < q.gather(1, x)).squeeze(1))
            removed = q.scatter(1, x, 0.0)
            total = removed.sum(dim=1, keepdim=True)
            q = torch.where(step & (total > 0), removed / total.clamp_min(1e-30), q)
        final.index_copy_(0, index, q)
        passed.index_copy_(0, child_index, torch.stack(tests, dim=1).view(-1).index_select(0, cell_index))
    draws = torch.multinomial(final, 1, generator=generator).squeeze(1)  # [N]
    return Verdict(passed, draws)

"""The acceptance rules, and the one place that chooses between them.

Notation (docs/ALGORITHMS.md): p = draft distribution, q = target distribution, both warped.
A chain rule takes the draft tokens x1..xk, what the draft reported for them, and the target's
q0..qk from one forward over [root, x1..xk]; it returns how many draft tokens are accepted and
the one token the target contributes (the correction at the first rejection, or the bonus),
as 0-dim tensors on the device, so the engine reads every row's in one sync. A tree rule walks
the tree on the host after one sync per row.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from specgen.config import AcceptanceMode


class ProposalKind(enum.Enum):
    """What a drafter's tokens are, which decides the acceptance rule."""

    SAMPLED = "sampled"  # drawn from the reported distribution p
    DETERMINISTIC = "deterministic"  # point masses: argmax drafts, lookup, scripted drafters


class Rule(enum.Enum):
    TARGET_ONLY = "target-only"  # nothing proposed: the target's own token
    GREEDY_MATCH = "greedy-match"  # accept while x_i equals the target's choice (argmax or keyed draw)
    SPECULATIVE_SAMPLING = "speculative-sampling"  # min(1, q/p), residual norm(max(0, q - p))
    POINT_MASS_SAMPLING = "point-mass-sampling"  # the same with p = one-hot(x_i)
    GREEDY_TREE = "greedy-tree"  # descend into the child equal to the target's choice
    RECURSIVE_REJECTION = "recursive-rejection"  # siblings tried in draw order (section 3)
    SYNTHETIC = "synthetic"  # benchmarks only: a recorded accepted length, then the target's token (synthetic.py)


def select_rule(greedy: bool, kind: ProposalKind, size: int, chain: bool,
                mode: AcceptanceMode = AcceptanceMode.REAL) -> Rule:
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
        return Rule.GREEDY_TREE if greedy else Rule.RECURSIVE_REJECTION
    if greedy:
        return Rule.GREEDY_MATCH
    return Rule.SPECULATIVE_SAMPLING if kind is ProposalKind.SAMPLED else Rule.POINT_MASS_SAMPLING


@dataclass(frozen=True)
class ChainVerdict:
    accepted: torch.Tensor  # 0-dim int64: number of draft tokens accepted
    token: torch.Tensor  # 0-dim int64: the target's own token after them


def greedy_match(draft_tokens: torch.Tensor, target_choice: torch.Tensor) -> ChainVerdict:
    """Accept the longest prefix with x_i == the target's choice c_(i-1); then c at the stop.

    target_choice [k+1] is argmax q under greedy decoding, or the keyed draws of
    deterministic mode (see replay.keyed_choice); draft_tokens [k].
    """
    k = draft_tokens.shape[0]
    matches = (draft_tokens == target_choice[:k]).to(torch.int64)
    accepted = matches.cumprod(dim=0).sum()
    return ChainVerdict(accepted, target_choice[accepted])


def speculative_sampling(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                         generator: torch.Generator | None) -> ChainVerdict:
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


def point_mass_sampling(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                        generator: torch.Generator | None) -> ChainVerdict:
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


def _chain(draft_tokens, p_x, p_row, target_probs, generator) -> ChainVerdict:
    """Accept x_i w.p. min(1, q(x_i)/p(x_i)) in order; at the stop, draw from norm(q - p)^+."""
    k = draft_tokens.shape[0]
    device = target_probs.device
    q_x = target_probs[torch.arange(k, device=device), draft_tokens]
    uniforms = torch.rand(k, generator=generator, device=device)
    accept = (uniforms * p_x < q_x).to(torch.int64)  # u < q/p without dividing
    accepted = accept.cumprod(dim=0).sum()
    stop = accepted.view(1)
    q_row = target_probs.index_select(0, stop)[0]
    residual = (q_row - p_row(stop)).clamp_min(0.0)
    total = residual.sum()
    # sum(r) == 0 only through rounding (q == p on the support): fall back to q itself.
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), q_row)
    token = torch.multinomial(residual, 1, generator=generator)[0]
    return ChainVerdict(accepted, token)


# -- trees -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted node indices, root excluded, root-to-leaf order
    token: int  # the target's own token after the path (residual or bonus draw)
    tried: list[int]  # candidates tried and rejected, in the order they were tried
    node_tokens: list[int]  # every node's token, read in the same sync


def greedy_tree(children: tuple[tuple[int, ...], ...], tokens: torch.Tensor,
                choice: torch.Tensor) -> TreeVerdict:
    """A chosen target token per node (argmax, or keyed draws): accept the first child equal
    to it, else emit it."""
    tokens_list, choice_list = torch.stack([tokens, choice]).tolist()  # the one sync
    return _walk(children, lambda node, k, child: tokens_list[child] == choice_list[node],
                 lambda node: choice_list[node], tokens_list)


def recursive_rejection(children: tuple[tuple[int, ...], ...], tokens: torch.Tensor,
                        draft_probs: torch.Tensor, target_probs: torch.Tensor,
                        generator: torch.Generator | None, *, replacement: bool) -> TreeVerdict:
    """Recursive rejection sampling over a tree (ALGORITHMS.md section 3).

    At each node the children are tried in draw order: accept x_k w.p. min(1, q_k(x_k)/p_k(x_k));
    on rejection q_(k+1) = norm(max(q_k - p_k, 0)) and, without replacement,
    p_(k+1) = p_k with x_k removed and renormalised (with replacement p is left alone).
    If every child is rejected (or there are none) the node emits y ~ q_(K+1).
    draft_probs [N, V]: p(.|node) for nodes with children; target_probs [N, V]: q(.|node).
    Everything is computed for all nodes at once; one sync reads the outcomes, and the number
    of random draws does not depend on them.
    """
    size, vocab = target_probs.shape
    widest = max(len(c) for c in children)
    device = target_probs.device
    inner = [i for i in range(size) if children[i]]
    accept_rows = torch.zeros(size, max(widest, 1), dtype=torch.bool, device=device)
    final = target_probs.clone()  # q_(K+1) per node; leaves keep q (the bonus distribution)
    if inner:
        index = torch.tensor(inner, device=device)
        kids = torch.full((len(inner), widest), -1, dtype=torch.int64)
        for row, node in enumerate(inner):
            kids[row, : len(children[node])] = torch.tensor(children[node])
        valid = (kids >= 0).to(device)
        kid_tokens = tokens.index_select(0, kids.clamp_min(0).view(-1).to(device)).view(len(inner), widest)
        q = target_probs.index_select(0, index)
        p = draft_probs.index_select(0, index).float()
        uniforms = torch.rand(len(inner), widest, generator=generator, device=device)
        for k in range(widest):
            x = kid_tokens[:, k : k + 1]
            q_x, p_x = q.gather(1, x), p.gather(1, x)
            accept_rows[index, k] = (uniforms[:, k : k + 1] * p_x < q_x).squeeze(1) & valid[:, k]
            residual = (q - p).clamp_min(0.0)
            total = residual.sum(dim=1, keepdim=True)
            step = valid[:, k : k + 1]
            q = torch.where(step & (total > 0), residual / total.clamp_min(1e-30), q)
            if not replacement:
                removed = p.scatter(1, x, 0.0)
                p = torch.where(step, removed / (1.0 - p_x).clamp_min(1e-30), p)
        final.index_copy_(0, index, q)
    draws = torch.multinomial(final, 1, generator=generator).squeeze(1)  # [N]
    width = accept_rows.shape[1]
    flat = torch.cat([accept_rows.to(torch.int64).view(-1), draws, tokens]).tolist()  # the sync
    accept_list = [flat[i * width:(i + 1) * width] for i in range(size)]
    draw_list, token_list = flat[size * width: size * width + size], flat[size * width + size:]
    return _walk(children, lambda node, k, child: accept_list[node][k] == 1,
                 lambda node: draw_list[node], token_list)


def _walk(children, accepted, emit, node_tokens) -> TreeVerdict:
    """Walk from the root: descend into the first accepted child; stop where none is."""
    node, path, tried = 0, [], []
    while True:
        for k, child in enumerate(children[node]):
            if accepted(node, k, child):
                path.append(child)
                node = child
                break
            tried.append(child)
        else:
            return TreeVerdict(path, emit(node), tried, node_tokens)

"""Distribution tests for tree verification: the emitted tokens must follow q exactly.

p = draft, q = target (ALGORITHMS.md). Tree-level tests use a Markov "model": p and q are
tables indexed by the previous token, so the exact law of the first two generated tokens is
q[root][x1] * q[x1][x2]. Trees are built with the real child selection (Gumbel-top-k for
RSD-C, i.i.d. draws for multi-draft, stochastic beam search for RSD-S) and verified with the
real `recursive_rejection`. Every test fixes its generator seed, so it is reproducible; the
stated false-failure probability is its significance level alpha. Power of the controls,
measured at these sizes: p-values 4e-76 (re-sorted siblings), 2e-70 (draft not updated),
7e-40 (without-replacement rule on i.i.d. draws), 1e-127 (re-sorted RSD-C trees), 2e-60
(leaves dropped by their own draft probability, the law of three tokens).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specgen.decoding.acceptance import (
    ProposalKind,
    Rule,
    point_mass_tree,
    recursive_rejection,
    select_rule,
    speculative_sampling,
    walk,
)
from specgen.decoding.drafters.base import Proposal, node_laws
from specgen.decoding.drafters.tree import MultiDraft, RSDConstant, RSDStochasticBeam
from specgen.decoding.length import level_stop
from specgen.decoding.sampling import gumbel_top_k
from specgen.decoding.shapes import fit_tree


def as_tree(tokens: list[int], parents: list[int]) -> tuple[list[int], Proposal]:
    """Node tokens (the root first) and the proposal of the nodes after the root, whose
    parents were written with the root's own -1 first."""
    return tokens, Proposal(
        torch.tensor(tokens[1:], dtype=torch.int64), tuple(parents[1:]), ProposalKind.SAMPLED
    )


def walked(tree: Proposal, verdict) -> tuple[list[int], int]:
    """A verdict read and walked as the engine does: (the accepted path, the target's token)."""
    path, token, _ = walk(tree.children, verdict.passed.tolist(), verdict.token.tolist())
    return path, token


pytestmark = pytest.mark.statistical
ALPHA = 1e-3
P1 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
Q1 = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15])


def chi2_pvalue(samples: list[int] | torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.as_tensor(samples), minlength=expected_probs.numel()).double()
    expected = expected_probs.double() / expected_probs.double().sum() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue


def one_node(children: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator, replacement: bool) -> int:
    """Verify one node with the given children; return the first emitted token."""
    k = children.numel()
    tree = Proposal(children.to(torch.int64), (0,) * k, ProposalKind.SAMPLED)
    verdict = recursive_rejection(
        tree.children,
        tree.tokens,
        p.expand(k + 1, -1),
        q.expand(k + 1, -1),
        generator,
        replacement=replacement,
    )
    path, token = walked(tree, verdict)
    return int(children[path[0] - 1]) if path else token


def sample_node(
    n: int, k: int, *, replacement_draws: bool, replacement_rule: bool, resort: bool = False, seed: int = 0
) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if replacement_draws:
            children = torch.multinomial(P1, k, replacement=True, generator=generator)
        else:
            children = gumbel_top_k(P1[None], k, generator)[0][0]
        if resort:  # the classic mistake: verify siblings sorted by draft probability
            children = children[torch.argsort(P1[children], descending=True, stable=True)]
        out.append(one_node(children, P1, Q1, generator, replacement_rule))
    return out


def test_rrs_without_replacement_emits_q():
    """RRSw, one node with 3 children drawn without replacement. False-failure probability: 1e-3."""
    assert chi2_pvalue(sample_node(6000, 3, replacement_draws=False, replacement_rule=False), Q1) > ALPHA


def test_rrs_with_replacement_emits_q():
    """SpecInfer-style multi-draft: 3 i.i.d. children, p kept after rejections. False failure: 1e-3."""
    assert chi2_pvalue(sample_node(6000, 3, replacement_draws=True, replacement_rule=True), Q1) > ALPHA


def test_control_resorted_siblings_fail():
    """Negative control: the same draws verified in draft-probability order must be rejected."""
    assert (
        chi2_pvalue(sample_node(6000, 2, replacement_draws=False, replacement_rule=False, resort=True), Q1)
        < ALPHA
    )


def test_control_draft_not_updated_after_rejection_fails():
    """Negative control: draws without replacement verified with p left unchanged (wrong rule)."""
    assert chi2_pvalue(sample_node(6000, 3, replacement_draws=False, replacement_rule=True), Q1) < ALPHA


def test_control_without_replacement_rule_on_iid_draws_fails():
    """Negative control: i.i.d. draws verified with the without-replacement update (wrong rule)."""
    assert chi2_pvalue(sample_node(6000, 3, replacement_draws=True, replacement_rule=False), Q1) < ALPHA


# -- tree level: a Markov model over 4 tokens --------------------------------------------------

V = 4
P_TABLE = torch.tensor(
    [[0.55, 0.25, 0.15, 0.05], [0.1, 0.6, 0.2, 0.1], [0.3, 0.1, 0.1, 0.5], [0.25, 0.25, 0.25, 0.25]]
)
Q_TABLE = torch.tensor(
    [[0.2, 0.3, 0.1, 0.4], [0.35, 0.15, 0.35, 0.15], [0.1, 0.45, 0.25, 0.2], [0.6, 0.1, 0.1, 0.2]]
)
EXPECTED_PAIRS = (Q_TABLE[0][:, None] * Q_TABLE).reshape(-1)  # root token 0: law of (x1, x2)


def build_constant(root: int, branching, generator, iid: bool):
    tokens, parents, frontier = [root], [-1], [0]
    for b in branching:
        probs = P_TABLE[torch.tensor([tokens[f] for f in frontier])]
        if iid:
            kids = torch.multinomial(probs, b, replacement=True, generator=generator)
        else:
            kids = gumbel_top_k(probs, b, generator)[0]
        start = len(tokens)
        for row, f in enumerate(frontier):
            tokens.extend(kids[row].tolist())
            parents.extend([f] * b)
        frontier = list(range(start, len(tokens)))
    return as_tree(tokens, parents)


def build_beam(root: int, width: int, depth: int, generator):
    drafter = RSDStochasticBeam.__new__(RSDStochasticBeam)
    tokens, parents, frontier, scores = [root], [-1], [0], None
    for level in range(depth):
        probs = P_TABLE[torch.tensor([tokens[f] for f in frontier])]
        new_parents, new_tokens, scores = drafter._children(
            level, frontier, probs, scores, ProposalKind.SAMPLED, generator, width
        )
        start = len(tokens)
        tokens.extend(new_tokens.tolist())
        parents.extend(new_parents)
        frontier = list(range(start, len(tokens)))
    return as_tree(tokens, parents)


def first_two_tokens(
    build,
    n: int,
    seed: int,
    resort: bool = False,
    replacement: bool = False,
    verify=None,
    count: int = 2,
) -> list[int]:
    """Run rounds from root token 0 until two tokens are out; return x1 * V + x2 per trial
    (`count` tokens: x1 * V**(count-1) + ... + x_count). `verify(tree, rows, generator)`: the
    rule a round's tree is verified by (recursive rejection with P_TABLE's laws by default;
    `rows` the nodes' tokens)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        emitted = []
        while len(emitted) < count:
            root = emitted[-1] if emitted else 0
            nodes, tree = build(root, generator)
            if resort:
                nodes, tree = resort_siblings(nodes, tree)
            rows = torch.tensor(nodes)
            if verify is not None:
                verdict = verify(tree, rows, generator)
            else:
                verdict = recursive_rejection(
                    tree.children,
                    tree.tokens,
                    P_TABLE[rows],
                    Q_TABLE[rows],
                    generator,
                    replacement=replacement,
                )
            path, token = walked(tree, verdict)
            emitted += [nodes[i] for i in path] + [token]
        code = 0
        for token in emitted[:count]:
            code = code * V + token
        out.append(code)
    return out


def resort_siblings(nodes: list[int], tree: Proposal) -> tuple[list[int], Proposal]:
    """Rebuild the tree with each node's children ordered by draft probability (descending)."""
    new_index = {0: 0}
    tokens, parents = [nodes[0]], [-1]
    queue = [0]
    while queue:
        node = queue.pop(0)
        kids = sorted(tree.children[node], key=lambda c: -float(P_TABLE[nodes[node], nodes[c]]))
        for child in kids:
            new_index[child] = len(tokens)
            tokens.append(nodes[child])
            parents.append(new_index[node])
            queue.append(child)
    return as_tree(tokens, parents)


def test_rsd_c_tree_emits_q():
    """RSD-C with branching (2, 2): law of the first two tokens. False-failure probability: 1e-3."""
    samples = first_two_tokens(lambda r, g: build_constant(r, (2, 2), g, iid=False), 3000, seed=1)
    assert chi2_pvalue(samples, EXPECTED_PAIRS) > ALPHA


def test_multi_draft_tree_emits_q():
    """Multi-draft (i.i.d. children, with-replacement rule), branching (2, 2). False failure: 1e-3."""
    samples = first_two_tokens(
        lambda r, g: build_constant(r, (2, 2), g, iid=True), 3000, seed=2, replacement=True
    )
    assert chi2_pvalue(samples, EXPECTED_PAIRS) > ALPHA


def test_rsd_s_tree_emits_q():
    """RSD-S, beam width 3, depth 2 (truncated Gumbel keys). False-failure probability: 1e-3."""
    samples = first_two_tokens(lambda r, g: build_beam(r, 3, 2, g), 3000, seed=3)
    assert chi2_pvalue(samples, EXPECTED_PAIRS) > ALPHA


def test_control_rsd_c_with_resorted_siblings_fails():
    """Negative control: RSD-C trees verified with siblings re-sorted by draft probability."""
    samples = first_two_tokens(
        lambda r, g: build_constant(r, (2, 2), g, iid=False), 3000, seed=4, resort=True
    )
    assert chi2_pvalue(samples, EXPECTED_PAIRS) < ALPHA


# -- point-mass trees: a suffix memory's branches ----------------------------------------------


def point_mass_pairs(n: int, seed: int, rule) -> list[int]:
    """The first two tokens under point-mass trees of distinct siblings at two levels (any tokens:
    here drawn from P_TABLE without replacement, then fixed, as copied text is), verified by `rule`;
    x1 * V + x2 per trial."""
    return first_two_tokens(
        lambda r, g: build_constant(r, (2, 2), g, iid=False),
        n,
        seed,
        verify=lambda tree, rows, g: rule(tree.children, tree.tokens, Q_TABLE[rows], g),
    )


def point_mass_tree_without_removal(children, tokens, target_probs, generator):
    """BROKEN on purpose: a rejected child is not removed from q, so a node that rejects every
    child draws from q itself and may emit a rejected token again (too often)."""
    from specgen.decoding.acceptance import Verdict

    size = target_probs.shape[0]
    passed = torch.zeros(size - 1, dtype=torch.bool)
    for node in range(size):
        for child in children[node]:
            token = tokens[child - 1]
            passed[child - 1] = torch.rand(1, generator=generator)[0] < target_probs[node, token]
    return Verdict(passed, torch.multinomial(target_probs, 1, generator=generator).squeeze(1))


def test_point_mass_tree_emits_q():
    """A suffix memory's tree (point masses, two siblings per node, two levels): the law of the
    first two tokens is the target's. False-failure probability: 1e-3."""
    assert chi2_pvalue(point_mass_pairs(3000, seed=5, rule=point_mass_tree), EXPECTED_PAIRS) > ALPHA


def test_control_point_mass_tree_without_removing_rejected_children_fails():
    """Negative control: rejected siblings left in q."""
    samples = point_mass_pairs(3000, seed=6, rule=point_mass_tree_without_removal)
    assert chi2_pvalue(samples, EXPECTED_PAIRS) < ALPHA


# -- trees cut to a floor's budget: fewer levels, fewer children per node, a narrower beam, one node


def build_cut(
    drafter, budget: int, root: int, generator, keep_likeliest: bool = False, drop_unlikely: float = 0.0
):
    """A round's tree as `drafter` (its `_children`, on P_TABLE's laws) builds it within `budget`
    nodes (shapes.fit_tree), with the laws its nodes were drawn from, as the engine verifies it,
    and where the drafter has a confidence stop, no deeper than `length.level_stop` allows.
    `keep_likeliest` (BROKEN on purpose): a root level cut after the draw, keeping the children
    the draft likes best, instead of drawing fewer. `drop_unlikely` (BROKEN on purpose): drawn
    leaves whose own draft probability is under it dropped from the tree."""
    levels = fit_tree(drafter.levels, budget)
    tokens, parents, frontier, scores, laws, reach = [root], [-1], [0], None, [], None
    for level, size in enumerate(levels):
        probs = P_TABLE[torch.tensor([tokens[f] for f in frontier])]
        laws.append(probs)
        draw = drafter.levels[0] if keep_likeliest and level == 0 else size
        new_parents, new_tokens, scores = drafter._children(
            level, frontier, probs, scores, ProposalKind.SAMPLED, generator, draw
        )
        if keep_likeliest and level == 0:
            order = torch.argsort(P_TABLE[root][new_tokens], descending=True, stable=True)[:size]
            new_parents, new_tokens = new_parents[:size], new_tokens[order]
        if drop_unlikely and level == len(levels) - 1:
            kept = [
                j
                for j, (f, t) in enumerate(zip(new_parents, new_tokens.tolist()))
                if P_TABLE[tokens[f], t] >= drop_unlikely
            ]
            new_parents, new_tokens = [new_parents[j] for j in kept], new_tokens[kept]
        start = len(tokens)
        tokens.extend(new_tokens.tolist())
        parents.extend(new_parents)
        last = level == len(levels) - 1 or not new_parents
        if getattr(drafter, "confidence", 0.0) > 0 and not last:
            reach, last = level_stop(drafter.confidence, frontier, new_parents, probs.log(), probs, reach)
        frontier = list(range(start, len(tokens)))
        if last:
            break
    nodes, tree = as_tree(tokens, parents)
    return nodes, Proposal(
        tree.tokens, tree.parents, ProposalKind.SAMPLED, node_laws(laws, len(nodes)), drafter.replacement
    )


def engine_rule(tree: Proposal, rows: torch.Tensor, generator):
    """The rule the engine picks for a sampled proposal (a one-node tree is a chain) and its call."""
    rule = select_rule(False, tree.kind, tree.size, tree.is_chain)
    if rule is Rule.SPECULATIVE_SAMPLING:
        return speculative_sampling(tree.tokens, tree.probs, Q_TABLE[rows], generator)
    assert rule is Rule.RECURSIVE_REJECTION
    return recursive_rejection(
        tree.children, tree.tokens, tree.probs, Q_TABLE[rows], generator, replacement=tree.replacement
    )


def drafter_of(kind: str):
    """A tree drafter with only its shape (no model): RSD-C (2, 2), multi-draft (2, 2), RSD-S 3 x 2."""
    if kind == "rsd-s":
        drafter = RSDStochasticBeam.__new__(RSDStochasticBeam)
        drafter.levels = (3, 3)
    else:
        cls = RSDConstant if kind == "rsd-c" else MultiDraft
        drafter = cls.__new__(cls)
        drafter.levels = (2, 4)
    return drafter


CUTS = [
    ("rsd-c", 4),
    ("rsd-c", 2),
    ("rsd-c", 1),
    ("multi-draft", 4),
    ("multi-draft", 2),
    ("multi-draft", 1),
    ("rsd-s", 4),
    ("rsd-s", 3),
    ("rsd-s", 2),
    ("rsd-s", 1),
]


@pytest.mark.parametrize("kind, budget", CUTS, ids=[f"{kind}-{budget}" for kind, budget in CUTS])
def test_a_tree_cut_to_a_budget_emits_q(kind, budget):
    """The first two tokens under trees cut to `budget` nodes (shapes.fit_tree): at 4, two levels
    of 2 (RSD-C's and multi-draft's second level narrowed to one child a node, RSD-S's beam to
    2); at 3, RSD-S's root level alone; at 2 and 1, a chain of two and a single node, verified as
    chains. Each round's tree is drawn by the method's own child selection. False-failure
    probability: 1e-3 each."""
    drafter = drafter_of(kind)
    samples = first_two_tokens(
        lambda r, g: build_cut(drafter, budget, r, g), 3000, seed=11 + budget, verify=engine_rule
    )
    assert chi2_pvalue(samples, EXPECTED_PAIRS) > ALPHA


def test_control_a_root_level_cut_after_the_draw_fails():
    """Negative control: RSD-S's root level drawn whole (3 children) and cut to the 2 the draft
    likes best, instead of drawing 2: no longer a draw without replacement."""
    drafter = drafter_of("rsd-s")
    samples = first_two_tokens(
        lambda r, g: build_cut(drafter, 2, r, g, keep_likeliest=True), 3000, seed=21, verify=engine_rule
    )
    assert chi2_pvalue(samples, EXPECTED_PAIRS) < ALPHA


# -- trees under a confidence stop: no deeper once every path's reach is under it ---------------

EXPECTED_TRIPLES = (EXPECTED_PAIRS[:, None] * Q_TABLE.repeat(V, 1)).reshape(-1)  # (x1, x2, x3)
STOP = 0.32  # from root 0: a third level only when token 1 is among the first level's


def stopped_drafter(kind: str):
    """A three-level tree drafter on P_TABLE's laws with the confidence stop STOP: whether the
    third level is drafted depends on which tokens the first level drew (siblings' included)."""
    drafter = drafter_of(kind)
    drafter.levels = (3, 3, 3) if kind == "rsd-s" else (2, 4, 8)
    drafter.confidence = STOP
    return drafter


@pytest.mark.parametrize("kind", ["rsd-c", "multi-draft", "rsd-s"])
def test_a_tree_under_a_confidence_stop_emits_q(kind):
    """The first three tokens under trees whose depth the confidence stop decides: the law is the
    target's. False-failure probability: 1e-3 each."""
    drafter = stopped_drafter(kind)
    depths = set()

    def build(root, generator):
        nodes, tree = build_cut(drafter, 99, root, generator)
        depths.add(max(tree.depth))
        return nodes, tree

    samples = first_two_tokens(build, 4000, seed=31, verify=engine_rule, count=3)
    assert depths >= {2, 3}  # the stop cut some trees and not others
    assert chi2_pvalue(samples, EXPECTED_TRIPLES) > ALPHA


def test_control_a_tree_that_drops_unlikely_draws_fails():
    """Negative control: RSD-C (2, 2) trees whose leaves are dropped after the draw when their own
    draft probability is low (what the stop must never do: it decides from the laws the next
    level would be drawn from, and keeps every node drawn)."""
    drafter = drafter_of("rsd-c")
    samples = first_two_tokens(
        lambda r, g: build_cut(drafter, 99, r, g, drop_unlikely=0.2),
        4000,
        seed=32,
        verify=engine_rule,
        count=3,
    )
    assert chi2_pvalue(samples, EXPECTED_TRIPLES) < ALPHA

"""Trees: derived structure, one-pass verification with a 4D mask, tree rounds in the engine."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPT, reference_greedy
from tiny import decode, engine_with

from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.acceptance import ProposalKind
from specgen.decoding.drafters.base import Proposal
from specgen.runtime import kvcache
from specgen.runtime.compiled import Steps

NODES = torch.tensor([11, 12, 13, 14, 15, 16, 17])  # the root's token first
TREE = Proposal(NODES[1:], (0, 0, 1, 1, 2, 3), ProposalKind.DETERMINISTIC)


def test_structure_is_derived_from_parents():
    assert TREE.depth == (0, 1, 1, 2, 2, 2, 3)
    assert TREE.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    assert sorted(TREE.paths()) == [[0, 1, 3, 6], [0, 1, 4], [0, 2, 5]]
    mask = TREE.ancestor_mask
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert TREE.position_ids(10).tolist() == [[10, 11, 11, 12, 12, 12, 13]]
    assert TREE.attention_mask(10).shape == (1, 1, 7, 17)


def test_bad_trees_are_refused():
    with pytest.raises(ValueError):
        Proposal(torch.tensor([1, 2]), (0, 2), ProposalKind.DETERMINISTIC)  # a parent after its child
    with pytest.raises(ValueError):
        Proposal(torch.tensor([1, 2, 3]), (0, -1, 0), ProposalKind.DETERMINISTIC)
    with pytest.raises(ValueError):
        Proposal(torch.tensor([1, 2, 3]), (0, 0), ProposalKind.DETERMINISTIC)  # a parent per token


def test_tree_logits_equal_chain_logits_and_step_by_step(tiny_pair):
    model = tiny_pair[0].model
    prefix = torch.tensor([PROMPT])
    cached = prefix.shape[1]
    with torch.no_grad():
        cache = kvcache.new_cache(model)
        kvcache.forward(model, cache, prefix)
        tree_logits = Steps(model).tree(cache, NODES, TREE)[0]
        for path in TREE.paths():
            chain = model(torch.cat([prefix[0], NODES[path]])[None]).logits[0, cached:]
            torch.testing.assert_close(tree_logits[path], chain, atol=1e-4, rtol=1e-4)
            step_cache = kvcache.new_cache(model)
            kvcache.forward(model, step_cache, prefix)
            for depth, node in enumerate(path):
                step = kvcache.forward(model, step_cache, NODES[node].view(1, 1))[0, -1]
                torch.testing.assert_close(tree_logits[node], step, atol=1e-4, rtol=1e-4)


def tree_engine(pair, config):
    return engine_with(pair, config, stop_ids=frozenset())


CONFIGS = [
    GenerationConfig(method=Method.RSD_C, max_new_tokens=30, branching=(2, 2, 1)),
    GenerationConfig(method=Method.RSD_C, max_new_tokens=30, branching=(3, 1)),
    GenerationConfig(method=Method.MULTI_DRAFT, max_new_tokens=30, branching=(2, 2)),
    GenerationConfig(method=Method.RSD_S, max_new_tokens=30, beam_width=3, depth=3),
    GenerationConfig(method=Method.RSD_S, max_new_tokens=30, beam_width=2, depth=5),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.method.value}-{c.tree_budget}")
def test_greedy_tree_methods_reproduce_plain_greedy(tiny_pair, config):
    reference = reference_greedy(tiny_pair[0].model, PROMPT, 30)
    rounds, _ = decode(tree_engine(tiny_pair, config), PROMPT, config)
    assert [t for r in rounds for t in r.emitted] == reference
    assert any(r.tree is not None for r in rounds)


@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: str(c.branching))
def test_target_as_its_own_draft_accepts_whole_paths(tiny_pair, config):
    """RSD-C's top-b children contain the draft's argmax, so a perfect draft's path survives.
    (Beam search may drop the greedy path for a higher cumulative score, so not RSD-S.) Near the
    end a round's tree has fewer levels, and its whole path survives too."""
    target, _ = tiny_pair
    rounds, _ = decode(engine_with((target, target), config, stop_ids=frozenset()), PROMPT, config)
    assert [t for r in rounds for t in r.emitted] == reference_greedy(target.model, PROMPT, 30)
    depths = [Proposal(torch.tensor(r.draft_tokens), r.parents, ProposalKind.GREEDY).depth for r in rounds]
    trees = [(r.accepted, max(depth)) for r, depth in zip(rounds, depths) if r.draft_tokens]
    assert all(accepted == deepest for accepted, deepest in trees)
    assert sum(deepest == config.tree_depth for _, deepest in trees) >= len(trees) - 1


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[3]], ids=lambda c: c.method.value)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_commit_after_tree_rounds_equals_fresh_prefill(tiny_pair, config, temperature):
    from dataclasses import replace

    target, draft = tiny_pair
    config = replace(config, sampling=SamplingConfig(temperature=temperature, seed=3), max_new_tokens=17)
    engine = tree_engine(tiny_pair, config)
    _, state = decode(engine, PROMPT, config)
    ids = state.ids
    with torch.no_grad():
        cached = kvcache.forward(target.model, state.cache, torch.tensor([ids[-1:]]))[0, -1]
        fresh = target.model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)
        drafter = engine.drafter.rows[0]  # the row's tree drafter
        assert kvcache.cache_length(drafter.cache) == drafter.cached <= len(ids) - 1
        # top the cache up to the committed sequence (start keeps the cache; propose feeds the rest)
        kvcache.forward(draft.model, drafter.cache, torch.tensor([ids[drafter.cached : -1]]))
        d_cached = kvcache.forward(draft.model, drafter.cache, torch.tensor([ids[-1:]]))[0, -1]
        d_fresh = draft.model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(d_cached, d_fresh, atol=1e-4, rtol=1e-4)


def test_tree_budgets():
    assert GenerationConfig(method=Method.RSD_C, branching=(2, 2, 2)).tree_budget == 14
    assert GenerationConfig(method=Method.RSD_S, beam_width=3, depth=4).tree_budget == 12


def test_a_tree_cut_to_a_budget_is_the_deepest_of_the_largest_narrowed_trees():
    from specgen.decoding.shapes import fit_tree

    assert fit_tree((2, 4, 4), 1 << 30) == fit_tree((2, 4, 4), 10) == (2, 4, 4)
    # 6 nodes: branching 2,1,1 (three levels), not 2,2 (two)
    assert fit_tree((2, 4, 4), 9) == fit_tree((2, 4, 4), 6) == (2, 2, 2)
    assert fit_tree((2, 4, 4), 5) == (2, 2) and fit_tree((2, 4, 4), 3) == (1, 1, 1)
    assert fit_tree((2, 4, 4), 2) == (1, 1) and fit_tree((2, 4, 4), 1) == (1,)
    # RSD-S: a narrower beam, as deep as the budget allows
    assert fit_tree((3, 3, 3, 3), 9) == (3, 3, 3) and fit_tree((3, 3, 3, 3), 6) == (2, 2, 2)
    assert fit_tree((3, 3, 3, 3), 3) == (1, 1, 1) and fit_tree((3, 3, 3, 3), 1) == (1,)
    # each level a whole number of children per node of the one above
    assert fit_tree((1, 4), 3) == (1, 2) and fit_tree((3, 9), 8) == (3, 3)
    assert fit_tree((2, 4, 4), 0) == () and fit_tree((), 5) == ()
    assert GenerationConfig(method=Method.RSD_C, branching=(2, 2, 1)).tree_levels == (2, 4, 4)
    assert GenerationConfig(method=Method.RSD_S, beam_width=3, depth=4).tree_levels == (3, 3, 3, 3)


def test_every_cut_tree_is_a_shape_its_method_builds():
    """For every budget: at most the budget's nodes, each level a whole number (at least one) of
    children per node above, no level wider than the whole tree's, no deeper than it."""
    from specgen.decoding.shapes import fit_tree

    for levels in ((2, 4, 4), (3, 3, 3, 3), (1, 4, 8), (4, 4, 8, 8), (2, 2, 2, 2, 2)):
        for budget in range(0, sum(levels) + 2):
            cut = fit_tree(levels, budget)
            assert sum(cut) <= budget and len(cut) <= len(levels)
            above = 1
            for size, whole in zip(cut, levels):
                assert above <= size <= whole and size % above == 0
                above = size
            assert (sum(cut) == sum(levels)) == (budget >= sum(levels))


def test_a_row_near_its_end_asks_for_a_tree_no_deeper_than_it_may_commit():
    """tree_nodes gives the nodes whose fit_tree (what the drafter builds from that count alone)
    is at most `depth` levels deep."""
    from specgen.decoding.shapes import fit_tree, tree_nodes

    assert tree_nodes((2, 4, 4), 10, 3) == 10 and tree_nodes((2, 4, 4), 6, 5) == 6
    assert tree_nodes((2, 4, 4), 10, 2) == 4  # (2, 2): 6 nodes would be (2, 2, 2)
    assert tree_nodes((2, 4, 4), 1 << 30, 5) == 10 and tree_nodes((2, 4, 4), 1 << 30, 2) == 4
    # one level: one node, since 2 nodes make the chain (1, 1), never two children of the root
    assert tree_nodes((2, 4, 4), 10, 1) == 1 and tree_nodes((2, 4, 4), 10, 0) == 0
    for levels in ((2, 4, 4), (3, 3, 3, 3)):
        for budget in range(0, 14):
            for depth in range(0, 5):
                nodes = tree_nodes(levels, budget, depth)
                tree = fit_tree(levels, nodes)
                assert nodes == sum(tree) <= budget and len(tree) <= depth


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.method.value}-{c.tree_budget}")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_tree_drafters_draft_the_cut_tree(tiny_pair, config, temperature):
    """Each drafter's proposal at budget k has the shape fit_tree gives: its levels' sizes, each
    node's parent one level up, a tree of one node a level a chain."""
    from specgen.decoding.shapes import fit_tree

    engine = tree_engine(tiny_pair, config)
    sampling = SamplingConfig(temperature=temperature, seed=5)
    for k in (1, 2, 3, 5, config.tree_budget):
        engine.drafter.join(0, PROMPT, torch.Generator().manual_seed(5), 256, config)
        proposal = engine.drafter.propose([PROMPT], [k], [sampling])[0]
        levels = fit_tree(config.tree_levels, k)
        depths = proposal.depth[1:]
        assert [depths.count(d) for d in range(1, len(levels) + 1)] == list(levels)
        assert proposal.size == sum(levels) <= k and proposal.is_chain == (max(levels) == 1)
        if temperature:  # the laws the nodes were drawn from, a zero row for each leaf
            assert proposal.probs.shape[0] == proposal.size + 1


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.method.value}-{c.tree_budget}")
def test_greedy_trees_cut_by_a_floor_reproduce_plain_greedy(tiny_pair, config, monkeypatch):
    """Whatever budget a row's floor allows round by round, the output is plain greedy's."""
    from dataclasses import replace

    from specgen.decoding import floor

    budgets = iter([floor.NONE, 1, 5, 0, 2, 3, 0, 7] * 20)
    monkeypatch.setattr(floor.Floor, "limit", lambda self: next(budgets))
    config = replace(config, floor=True)
    reference = reference_greedy(tiny_pair[0].model, PROMPT, 30)
    rounds, _ = decode(tree_engine(tiny_pair, config), PROMPT, config)
    assert [t for r in rounds for t in r.emitted] == reference
    assert {len(r.draft_tokens) for r in rounds} >= {0, 1, 2}


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[3]], ids=lambda c: c.method.value)
def test_on_a_cpu_a_tree_row_starts_at_a_chain_s_longest_verify(tiny_pair, config):
    """An engine that knows the device's verify cost (a CPU's) starts a tree row at the largest
    tree within costs.BEND nodes; without it (a GPU) the whole tree. The output stays plain
    greedy's either way."""
    from dataclasses import replace

    from specgen.decoding.costs import BEND, VerifyCost
    from specgen.decoding.shapes import fit_tree

    config = replace(config, floor=True)
    reference = reference_greedy(tiny_pair[0].model, PROMPT, 30)
    cpu = VerifyCost(0.0, 0.02, 0.08)
    for verify, nodes in ((cpu, sum(fit_tree(config.tree_levels, BEND))), (None, config.tree_budget)):
        engine = tree_engine(tiny_pair, config)
        engine.verify_cost = verify
        rounds, _ = decode(engine, PROMPT, config)
        assert [t for r in rounds for t in r.emitted] == reference
        assert len(next(r for r in rounds if r.draft_tokens).draft_tokens) == nodes


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2], CONFIGS[3]], ids=lambda c: c.method.value)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_confidence_stop_ends_a_tree_where_its_likeliest_path_is_unsure(tiny_pair, config, temperature):
    """Under the draft's confidence stop a tree grows no deeper once every path's product of top
    probabilities is under it: a random tiny draft is unsure of everything, so a stop of 0.99
    leaves one level and one of 1e-12 the whole tree. Greedy output stays plain greedy's, and
    the draft's cache holds exactly the committed tokens it fed, as after whole trees."""
    from dataclasses import replace

    target, draft = tiny_pair
    sampling = SamplingConfig(temperature=temperature, seed=3)
    for stop, deepest in ((0.99, 1), (1e-12, config.tree_depth)):
        stopped = replace(config, draft_confidence=stop, sampling=sampling, max_new_tokens=17)
        engine = tree_engine(tiny_pair, stopped)
        rounds, state = decode(engine, PROMPT, stopped)
        if not temperature:
            assert [t for r in rounds for t in r.emitted] == reference_greedy(target.model, PROMPT, 17)
        depths = [
            max(Proposal(torch.tensor(r.draft_tokens), r.parents, ProposalKind.GREEDY).depth)
            for r in rounds
            if r.draft_tokens
        ]
        assert depths[0] == deepest and max(depths) == deepest
        drafter, ids = engine.drafter.rows[0], state.ids
        with torch.no_grad():
            kvcache.forward(draft.model, drafter.cache, torch.tensor([ids[drafter.cached : -1]]))
            cached = kvcache.forward(draft.model, drafter.cache, torch.tensor([ids[-1:]]))[0, -1]
            torch.testing.assert_close(
                cached, draft.model(torch.tensor([ids])).logits[0, -1], atol=1e-4, rtol=1e-4
            )

"""Prompt lookup: exact proposals on hand-made sequences, an index checked against a slow scan,
O(1) index work per round, greedy equivalence in the real engine, and (statistical) the
output law under sampling with point-mass proposals, with negative controls."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine import reference_greedy
from test_statistical import gof_pvalue
from tiny import RowDrafterBase, assert_cache_agrees, decode, per_row

import specgen.decoding.verify as engine_module
from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.acceptance import ProposalKind, Verdict, speculative_sampling
from specgen.decoding.build import make_drafter
from specgen.decoding.costs import VerifyCost
from specgen.decoding.drafters.base import Proposal
from specgen.decoding.drafters.lookup import MatchOdds, PromptLookupDrafter
from specgen.decoding.drafters.lookup_chain import LookupChain, Source
from specgen.decoding.drafters.model import ChainDrafter
from specgen.decoding.engine import Engine
from specgen.decoding.sampling import make_generator
from specgen.runtime.pair import Pair
from specgen.text import common_prefix, special_ids

GREEDY = SamplingConfig()


def proposed(drafter: PromptLookupDrafter, context: list[int], k: int) -> list[int]:
    proposal = drafter.propose(context, k, GREEDY)
    assert proposal.kind is ProposalKind.DETERMINISTIC and proposal.probs is None
    assert proposal.tokens.dtype == torch.int64 and proposal.tokens.dim() == 1
    return proposal.tokens.tolist()


def reference_lookup(context: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Obviously correct and slow: scan every earlier position, longest n first, latest first."""
    length = len(context)
    for n in range(max_ngram, min_ngram - 1, -1):
        tail = context[length - n :] if n <= length else None
        for start in range(length - 1, n - 1, -1):
            if tail is not None and context[start - n : start] == tail:
                out = []
                for i in range(k):  # an overlapping copy: the proposal extends the text
                    out.append((context + out)[start + i])
                return out
    return []


# -- hand-made sequences --------------------------------------------------------------------------


def test_prefers_the_longest_ngram_over_a_more_recent_shorter_one():
    # tail (1, 2, 3): the 3-gram matched at 0..2 beats the later 1-gram "3" followed by 7
    context = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]
    assert proposed(PromptLookupDrafter(), context, 3) == [9, 5, 3]
    assert proposed(PromptLookupDrafter(max_ngram=1), context, 3) == [7, 1, 2]


def test_takes_the_most_recent_occurrence():
    assert proposed(PromptLookupDrafter(), [1, 2, 5, 1, 2, 6, 1, 2], 3) == [6, 1, 2]


def test_no_match_proposes_nothing():
    drafter = PromptLookupDrafter()
    assert proposed(drafter, [1, 2, 3, 4], 4) == []
    assert proposed(drafter, [1], 4) == []
    assert drafter.matched == 0


def test_min_ngram_ignores_shorter_matches():
    context = [4, 8, 1, 9, 2, 1]  # only the 1-gram "1" was seen before
    assert proposed(PromptLookupDrafter(min_ngram=1), context, 2) == [9, 2]
    assert proposed(PromptLookupDrafter(min_ngram=2), context, 2) == []


def test_proposal_is_truncated_to_k():
    context = [10, 11, 12, 13, 14, 15, 10, 11]
    for k in range(1, 6):
        assert proposed(PromptLookupDrafter(), context, k) == [12, 13, 14, 15, 10][:k]


def test_a_short_period_continues_periodically():
    assert proposed(PromptLookupDrafter(), [5, 7, 7, 7], 4) == [7, 7, 7, 7]
    assert proposed(PromptLookupDrafter(), [9, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_invalid_ngram_bounds_are_rejected():
    with pytest.raises(ValueError):
        PromptLookupDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError):
        PromptLookupDrafter(min_ngram=0)


# -- the incremental index ------------------------------------------------------------------------


def test_incremental_index_matches_a_fresh_scan_through_appends_and_rollbacks():
    """A random walk of appends, rollbacks and same-length edits near the tail, over 4 symbols
    (so matches of every length are common): every proposal equals the slow scan's."""
    generator = make_generator(0)
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    context = torch.randint(0, 4, (5,), generator=generator).tolist()
    drafter.start(context)
    for step in range(400):
        action = int(torch.randint(0, 10, (1,), generator=generator))
        if action < 6:  # a round committed 1..5 tokens
            count = int(torch.randint(1, 6, (1,), generator=generator))
            context = context + torch.randint(0, 4, (count,), generator=generator).tolist()
        elif action < 8 and len(context) > 2:  # rolled back
            context = context[: int(torch.randint(1, len(context), (1,), generator=generator))]
        elif len(context) > 2:  # one of the last tokens changed, same length
            at = len(context) - 1 - int(torch.randint(0, min(3, len(context)), (1,), generator=generator))
            context = context[:at] + [(context[at] + 1) % 4] + context[at + 1 :]
        k = int(torch.randint(1, 7, (1,), generator=generator))
        assert proposed(drafter, context, k) == reference_lookup(context, k, 3, 1), f"step {step}"
    assert drafter.removals > 0 and drafter.rebuilds > 0


def test_rollback_to_a_different_text_of_the_same_length_is_detected():
    drafter = PromptLookupDrafter()
    assert proposed(drafter, [5, 1, 2, 9, 1, 2], 1) == [9]
    assert proposed(drafter, [5, 1, 2, 8, 1, 2], 1) == [8]  # same length, same last token
    assert proposed(drafter, [5, 1, 2], 1) == []  # shorter: nothing was seen twice
    assert proposed(drafter, [5, 1, 2, 7, 1, 2], 2) == [7, 1]


def test_rewind_and_begin_as_the_engine_calls_them_between_turns():
    drafter = PromptLookupDrafter()
    first = [3, 4, 5, 6, 3, 4]
    drafter.start(first)
    assert proposed(drafter, first, 2) == [5, 6]
    second = [3, 4, 0, 6, 3, 4]  # a re-rendered earlier turn
    drafter.rewind(common_prefix(first, second))
    drafter.start(second)
    assert proposed(drafter, second, 2) == [0, 6]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix([], [1]) == 0
    assert common_prefix([4] * 100 + [1], [4] * 100 + [2]) == 100


def test_index_work_per_round_does_not_grow_with_the_context():
    """O(max_ngram) dictionary operations per committed token and per lookup, at any length.

    A round that committed c tokens costs at most 3c inserts (one per n-gram size) and at
    most 3 lookups, whether the context holds 100 tokens or 20,000.
    """
    generator = make_generator(1)
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    context = torch.randint(0, 50, (100,), generator=generator).tolist()
    drafter.start(context)
    per_round = []
    while len(context) < 20_000:
        committed = int(torch.randint(1, 6, (1,), generator=generator))
        context.extend(torch.randint(0, 50, (committed,), generator=generator).tolist())
        before = drafter.operations
        drafter.propose(context, 4, GREEDY)
        drafter.observe([1, 2])
        per_round.append(drafter.operations - before)
        assert per_round[-1] <= 3 * committed + 3
    assert drafter.removals == 0 and drafter.rebuilds == 0
    # unseen tail -> all three sizes are looked up, nothing else
    before = drafter.operations
    assert drafter.find(context + [999], 4) is None
    assert drafter.operations - before == 3 + 3  # 3 inserts for the new token, 3 lookups


# -- the real engine on tiny models ---------------------------------------------------------------

# On the tiny random target, a run of one token is often continued by runs of another
# (190 x6 -> 37 x14, 12 x12, 163 x2, then no repeats), so lookups are accepted in full, in
# part and not at all within one generation.
LOOP_PROMPTS = {"runs-of-37": [190] * 6, "runs-of-180": [159] * 6}


def lookup_engine(pair, drafter) -> Engine:
    target, _ = pair
    if isinstance(drafter, PromptLookupDrafter):
        drafter = per_row(drafter)
    return Engine(target.model, target.device, frozenset(), target.context_length, drafter)


def combined_drafter(model, min_match: int = 2, model_tokens: int | None = None, lookup=PromptLookupDrafter):
    """lookup-chain's drafter over a model drafter (a single-row test stand-in is served per row)."""
    if isinstance(model, RowDrafterBase):
        model = per_row(model)
    return LookupChain(model, min_match=min_match, model_tokens=model_tokens, make_lookup=lookup)


def generate(engine: Engine, prompt: list[int], **kwargs) -> tuple[list[int], list]:
    rounds, _ = decode(engine, prompt, GenerationConfig(method=Method.CHAIN, **kwargs))
    return [t for r in rounds for t in r.emitted], rounds


@pytest.fixture(scope="module")
def references(tiny_pair):
    return {name: reference_greedy(tiny_pair[0].model, prompt, 40) for name, prompt in LOOP_PROMPTS.items()}


@pytest.mark.parametrize("name", list(LOOP_PROMPTS))
@pytest.mark.parametrize("k", [1, 3, 4, 8])
def test_lookup_in_the_engine_matches_plain_greedy(tiny_pair, references, name, k):
    drafter = PromptLookupDrafter()
    out, rounds = generate(
        lookup_engine(tiny_pair, drafter), LOOP_PROMPTS[name], max_new_tokens=40, draft_tokens=k
    )
    assert out == references[name]
    drafted = [r for r in rounds if r.draft_tokens]
    assert any(r.accepted == len(r.draft_tokens) for r in drafted)  # fully accepted rounds
    assert any(r.accepted < len(r.draft_tokens) for r in drafted)  # and rejections
    assert any(not r.draft_tokens for r in rounds)  # and rounds without a match
    assert len(rounds) < 40


def test_lookup_resume_matches_a_fresh_start(tiny_pair):
    """A second turn (a resumed row: rewind + join) and a re-rendered one: same as fresh."""
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=16, draft_tokens=4)
    engine = lookup_engine(tiny_pair, PromptLookupDrafter())
    _, state = decode(engine, LOOP_PROMPTS["runs-of-37"], config)
    for turn in (state.ids + [190, 190, 190], [159] * 3 + state.ids[3:] + [190]):
        rounds, state = decode(engine, turn, config, resume=state)
        again = [t for r in rounds for t in r.emitted]
        fresh = [
            t
            for r in decode(lookup_engine(tiny_pair, PromptLookupDrafter()), turn, config)[0]
            for t in r.emitted
        ]
        assert again == fresh


def test_lookup_under_sampling_is_reproducible(tiny_pair):
    sampling = SamplingConfig(temperature=0.8, seed=3)
    outs = [
        generate(
            lookup_engine(tiny_pair, PromptLookupDrafter()),
            LOOP_PROMPTS["runs-of-37"],
            max_new_tokens=30,
            draft_tokens=4,
            sampling=sampling,
        )[0]
        for _ in range(2)
    ]
    assert outs[0] == outs[1] and len(outs[0]) == 30


# -- lookup next to a draft model -----------------------------------------------------------------


class RecordingDrafter(RowDrafterBase):
    """A model drafter stand-in: proposes k copies of 0 and records the calls it gets."""

    def __init__(self):
        self.calls: list[tuple] = []

    def start(self, prompt_ids, generator=None, capacity=0):
        self.calls.append(("begin", len(prompt_ids)))

    def rewind(self, valid):
        self.calls.append(("rewind", valid))

    def propose(self, context, k, sampling):
        self.calls.append(("propose", len(context), k))
        return Proposal.chain(torch.zeros(k, dtype=torch.int64), ProposalKind.DETERMINISTIC)

    def observe(self, path):
        self.calls.append(("observe", len(path)))


def test_combined_uses_lookup_for_long_matches_and_the_model_otherwise():
    model = RecordingDrafter()
    combined = combined_drafter(model, min_match=2)
    combined.join(0, [1, 2, 3, 4], None, 64, GenerationConfig())
    # a 2-gram match: lookup; the model is neither asked nor told
    proposal = combined.propose([[1, 2, 3, 4, 1, 2]], [3], [GREEDY])[0]
    assert proposal.tokens.tolist() == [3, 4, 1] and combined.sources[0] is Source.LOOKUP
    combined.observe(0, [1])
    # only a 1-gram match ("4"): the model
    proposal = combined.propose([[1, 2, 3, 4, 1, 2, 3, 9, 4]], [3], [GREEDY])[0]
    assert proposal.tokens.tolist() == [0, 0, 0] and combined.sources[0] is Source.MODEL
    combined.observe(0, [1, 2])
    assert model.calls == [("begin", 4), ("propose", 9, 3), ("observe", 2)]
    assert combined.rounds == {Source.LOOKUP: 1, Source.MEMORY: 0, Source.MODEL: 1}
    with pytest.raises(ValueError):
        combined_drafter(model, min_match=4, lookup=lambda: PromptLookupDrafter(max_ngram=3))


def test_lookup_rounds_may_propose_the_rounds_whole_k_and_model_rounds_keep_theirs():
    from specgen.config import LOOKUP_TOKENS, Schedule

    model = RecordingDrafter()
    combined = combined_drafter(model, min_match=2, model_tokens=2)
    combined.join(0, [1, 2, 3, 4, 5, 6], None, 64, GenerationConfig())
    proposal = combined.propose([[1, 2, 3, 4, 5, 6, 1, 2]], [4], [GREEDY])[0]
    assert proposal.tokens.tolist() == [3, 4, 5, 6] and combined.sources[0] is Source.LOOKUP
    combined.observe(0, [])
    proposal = combined.propose([[1, 2, 3, 4, 5, 6, 1, 2, 9]], [4], [GREEDY])[0]
    assert combined.sources[0] is Source.MODEL and model.calls[-1] == ("propose", 9, 2)
    assert len(proposal.tokens) == 2
    # the engine's k per round: lookup-chain's round may reach LOOKUP_TOKENS; every other method keeps k
    assert GenerationConfig(method=Method.LOOKUP_CHAIN, draft_tokens=2).round_tokens == LOOKUP_TOKENS == 4
    assert GenerationConfig(method=Method.LOOKUP_CHAIN, draft_tokens=6).round_tokens == 6
    assert (
        GenerationConfig(method=Method.LOOKUP_CHAIN, draft_tokens=2, schedule=Schedule.ADDITIVE).round_tokens
        == 2
    )
    assert GenerationConfig(method=Method.CHAIN, draft_tokens=2).round_tokens == 2


def test_combined_with_a_draft_model_matches_plain_greedy_and_keeps_its_cache(tiny_pair, references):
    """Both sources are used; after the lookup rounds the draft cache still holds a committed
    prefix, and topping it up gives the logits of a fresh draft prefill."""
    target, draft = tiny_pair
    model_drafter = ChainDrafter(draft.model, draft.device)
    combined = combined_drafter(model_drafter, min_match=1)
    engine = lookup_engine(tiny_pair, combined)
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=40, draft_tokens=4)
    rounds, state = decode(engine, LOOP_PROMPTS["runs-of-37"], config)
    out = [t for r in rounds for t in r.emitted]
    assert out == references["runs-of-37"]
    assert combined.rounds[Source.LOOKUP] > 0 and combined.rounds[Source.MODEL] > 0
    assert_cache_agrees(draft.model, model_drafter.cache, state.ids)


def test_combined_under_sampling_is_reproducible(tiny_pair):
    _, draft = tiny_pair
    sampling = SamplingConfig(temperature=1.0, seed=9)

    def once():
        combined = combined_drafter(ChainDrafter(draft.model, draft.device), 1)
        out, _ = generate(
            lookup_engine(tiny_pair, combined),
            LOOP_PROMPTS["runs-of-180"],
            max_new_tokens=24,
            draft_tokens=3,
            sampling=sampling,
        )
        return out, combined.rounds

    first, rounds = once()
    assert once()[0] == first and len(first) == 24
    assert rounds[Source.LOOKUP] > 0 and rounds[Source.MODEL] > 0


# -- statistical: point-mass proposals keep the target's law --------------------------------------

# Prompt [3, 3]: the tail "3" was seen, so lookup proposes 3, 3, ... (period 1). Under
# temperature 1 the tiny target gives the proposed token q(3 | 3, 3) = 0.29 (its top token;
# ~9 effective tokens), so a point mass is accepted often enough for the controls to show.
# max_new_tokens 3 and draft_tokens 2: the first round drafts 2 tokens, so the first two
# emitted tokens come from accepted point masses, residual draws and bonus draws.
STAT_PROMPT = [3, 3]
STAT_SAMPLING = SamplingConfig(temperature=1.0)
STAT_GENERATIONS = 800
CONTROL_GENERATIONS = 400
ALPHA = 1e-3


def assert_two_token_law(tokens: torch.Tensor, q0: torch.Tensor, joint: torch.Tensor) -> None:
    """First tokens ~ q0 and pairs ~ joint: two chi-square tests at ALPHA each."""
    pvalue = gof_pvalue(tokens[:, 0], q0)
    assert pvalue > ALPHA, f"first token: p-value {pvalue:.3g}"
    vocab = joint.shape[0]
    pvalue = gof_pvalue(tokens[:, 0] * vocab + tokens[:, 1], joint.flatten())
    assert pvalue > ALPHA, f"pairs: p-value {pvalue:.3g}"


def first_two(pair, seeds: range) -> torch.Tensor:
    """First two tokens of one lookup-drafted generation per seed -> [len(seeds), 2]."""
    engine = lookup_engine(pair, PromptLookupDrafter())
    out, lookups = [], 0
    for seed in seeds:
        config = GenerationConfig(
            method=Method.CHAIN,
            max_new_tokens=3,
            draft_tokens=2,
            sampling=dataclasses.replace(STAT_SAMPLING, seed=seed),
        )
        rounds, _ = decode(engine, STAT_PROMPT, config)
        lookups += len(rounds[0].draft_tokens) == 2
        out.append([t for r in rounds for t in r.emitted][:2])
    assert lookups == len(seeds)  # every first round drafted [3, 3]
    return torch.tensor(out)


@pytest.fixture(scope="module")
def stat_law(tiny_pair):
    """Exact plain-sampling laws: q0 of the first token [V] and of the first two tokens [V, V]."""
    from tiny import two_token_law

    return two_token_law(tiny_pair[0].model, STAT_PROMPT, STAT_SAMPLING)


def rule_without_residual(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """BROKEN on purpose: at the first rejection draw from q instead of norm(max(q - p, 0))."""
    k = draft_tokens.shape[0]
    q_x = target_probs[torch.arange(k), draft_tokens]
    uniforms = torch.rand(k, generator=generator)
    accepted = (uniforms < q_x).to(torch.int64).cumprod(dim=0).sum()
    token = torch.multinomial(target_probs[accepted], 1, generator=generator)[0]
    return Verdict.chain(accepted, token, k)


def rule_with_p_equal_to_q(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """BROKEN on purpose: the point mass reported as if its p were the target's own q."""
    k = draft_tokens.shape[0]
    return speculative_sampling(draft_tokens, target_probs[:k], target_probs, generator)


@pytest.mark.statistical
def test_lookup_first_two_tokens_follow_the_target_law(tiny_pair, stat_law):
    """800 generations with point-mass lookup drafts [3, 3], temperature 1: the first token
    ~ q0 and the pair ~ q0(t1) q1(t2 | t1) (exact laws; rare cells pooled).

    Two chi-square tests at alpha = 1e-3 each: false-failure probability <= 2e-3.
    """
    tokens = first_two(tiny_pair, range(STAT_GENERATIONS))
    q0, joint = stat_law
    assert 0.2 < float((tokens[:, 0] == 3).double().mean()) < 0.4  # q0(3) = 0.29
    assert_two_token_law(tokens, q0, joint)


@pytest.mark.statistical
def test_control_lookup_without_residual_fails(tiny_pair, stat_law, monkeypatch):
    """Negative control: re-drawing from q after a rejected point mass must fail.

    The broken first-token law is q(3) d_3 + (1 - q(3)) q, whose chi-square noncentrality is
    N q(3)(1 - q(3)) = 0.206 N = 82 at N = 400 (df 13 after pooling): against the
    alpha = 1e-3 critical value (34.5) the control fails with probability 0.99997
    (noncentral chi-square).
    """
    monkeypatch.setattr(
        engine_module, "point_mass_sampling", lambda d, q, g: rule_without_residual(d, None, q, g)
    )
    tokens = first_two(tiny_pair, range(10_000, 10_000 + CONTROL_GENERATIONS))
    pvalue = gof_pvalue(tokens[:, 0], stat_law[0])
    assert pvalue < ALPHA, f"the broken rule passed: p-value {pvalue:.3g}"


@pytest.mark.statistical
def test_control_point_mass_as_if_p_were_q_fails(tiny_pair, stat_law, monkeypatch):
    """Negative control: p taken as q makes every lookup token accepted (first token always 3,
    against q0(3) = 0.29): p-value ~ 0 at 100 generations, power 1."""
    monkeypatch.setattr(
        engine_module, "point_mass_sampling", lambda d, q, g: rule_with_p_equal_to_q(d, None, q, g)
    )
    tokens = first_two(tiny_pair, range(20_000, 20_100))
    assert (tokens[:, 0] == 3).all()
    pvalue = gof_pvalue(tokens[:, 0], stat_law[0])
    assert pvalue < ALPHA, f"the broken rule passed: p-value {pvalue:.3g}"


# -- a model proposal extended by lookup: sampled rows and point-mass rows in one proposal --------
class TwoTokenDrafter(RowDrafterBase):
    """A 'model' drafter that samples one token from q = 1/2 on 3, 1/2 on 5 (reported exactly)."""

    def __init__(self, vocab: int):
        self.q = torch.zeros(vocab)
        self.q[[3, 5]] = 0.5
        self.generator = None

    def start(self, prompt_ids, generator=None, capacity=0):
        self.generator = generator

    def propose(self, context, k, sampling):
        token = torch.multinomial(self.q, 1, generator=self.generator)
        return Proposal.chain(token, ProposalKind.SAMPLED, self.q[None].clone())


def extended_first_two(pair, seeds: range) -> torch.Tensor:
    """First two tokens per seed; the model proposes x1 in {3, 5} and when x1 = 3 the lookup
    extends it with 3 (the tail [3, 3] was seen): proposals [x1] or [3, 3] (sampled + point mass)."""
    vocab = pair[0].model.config.vocab_size
    out, extended = [], 0
    for seed in seeds:
        combined = combined_drafter(TwoTokenDrafter(vocab), min_match=2, model_tokens=1)
        config = GenerationConfig(
            method=Method.CHAIN,
            max_new_tokens=3,
            draft_tokens=2,
            sampling=dataclasses.replace(STAT_SAMPLING, seed=seed),
        )
        rounds, _ = decode(lookup_engine(pair, combined), [3, 3], config)
        extended += combined.extended
        out.append([t for r in rounds for t in r.emitted][:2])
    assert 0.3 * len(seeds) < extended < 0.7 * len(seeds)  # about half the first rounds
    return torch.tensor(out)


def test_an_extended_model_proposal_carries_point_mass_rows():
    vocab = 16
    combined = combined_drafter(TwoTokenDrafter(vocab), min_match=2, model_tokens=1)
    combined.join(0, [3, 3], torch.Generator().manual_seed(0), 64, GenerationConfig())
    seen = set()
    for _ in range(20):
        proposal = combined.propose([[3, 3]], [3], [STAT_SAMPLING])[0]
        first = int(proposal.tokens[0])
        seen.add(first)
        if first == 3:  # extended by the periodic continuation of [3, 3]: [3, 3, 3]
            assert proposal.tokens.tolist() == [3, 3, 3] and proposal.probs.shape == (3, vocab)
            assert torch.equal(
                proposal.probs[1:], torch.nn.functional.one_hot(torch.tensor([3, 3]), vocab).float()
            )
        else:
            assert proposal.tokens.tolist() == [5] and proposal.probs.shape == (1, vocab)
        combined.observe(0, [])
    assert seen == {3, 5}


@pytest.mark.statistical
def test_extended_proposals_keep_the_target_law(tiny_pair, stat_law):
    """800 generations whose first proposal is a sampled token, extended by a lookup point mass
    about half the time: the first token ~ q0 and the pair ~ the exact two-token law."""
    tokens = extended_first_two(tiny_pair, range(STAT_GENERATIONS))
    q0, joint = stat_law
    assert_two_token_law(tokens, q0, joint)


@pytest.mark.statistical
def test_extended_proposals_with_the_models_row_for_the_lookup_token_break_the_law(
    tiny_pair, stat_law, monkeypatch
):
    """Negative control: report the lookup token's row as the model's q (1/2 on 3) instead of
    its point mass; the accept test then uses p(3)/q(3) = 2 p(3) and the pair law breaks."""
    vocab = tiny_pair[0].model.config.vocab_size
    wrong = torch.zeros(vocab)
    wrong[[3, 5]] = 0.5
    monkeypatch.setattr(torch.nn.functional, "one_hot", lambda t, n: wrong.expand(len(t), n).clone())
    tokens = extended_first_two(tiny_pair, range(CONTROL_GENERATIONS))
    _, joint = stat_law
    pvalue = gof_pvalue(tokens[:, 0] * joint.shape[0] + tokens[:, 1], joint.flatten())
    assert pvalue < ALPHA, f"the broken extension went unnoticed (p-value {pvalue:.3g})"


def test_an_extension_query_is_not_counted_as_another_lookup_round():
    vocab = 16
    combined = combined_drafter(TwoTokenDrafter(vocab), min_match=2, model_tokens=1)
    combined.join(0, [3, 3], torch.Generator().manual_seed(0), 64, GenerationConfig())
    for _ in range(5):
        combined.propose([[3, 3]], [3], [STAT_SAMPLING])
        combined.observe(0, [])
    assert combined.lookups[0].rounds == 5


# -- how long a continuation is proposed: MatchOdds and the verify's cost -------------------------

LINE = VerifyCost(0.07, 0.07)  # every proposed token 0.07 steps
FREE = VerifyCost(0.0, 0.0)
# a Xeon with AMX: 1, 2 and 5 proposed tokens 1.09, 1.19 and 1.20 steps
STEPPED = VerifyCost(0.09, 0.0025, kink=0.0975)


def test_odds_cut_a_continuation_where_its_next_token_is_worth_less_than_its_verify():
    odds = MatchOdds()
    # the priors: a one-token match's copy is accepted less often than a longer match's
    assert (odds.chance(1), odds.chance(2), odds.chance(3), odds.chance(5)) == (0.25, 0.5, 0.75, 0.75)
    assert odds.length(1, 6, LINE) == 1  # 0.25 is worth 0.07; the next 0.0625 is not
    assert odds.length(2, 6, LINE) == 3  # 0.5, 0.25, 0.125 are worth 0.07; 0.0625 is not
    assert odds.length(3, 2, LINE) == 2  # never more than k
    assert odds.length(1, 6, FREE) == 6
    for _ in range(40):
        odds.record(1, 3, 0)  # every one-token match's first token rejected
        odds.record(3, 5, 5)  # every three-token match's five tokens accepted
    assert odds.length(1, 6, LINE) == 0
    assert odds.chance(3) > 0.97 and odds.length(3, 6, LINE) == 6
    assert odds.length(2, 6, LINE) == 3  # a length never seen keeps the prior


def test_odds_price_a_copy_as_a_whole_where_a_verify_steps():
    """Where the second proposed token costs what the next four do together, a copy is worth it
    whole or not past its first token: a token-by-token rule at the mean price would propose
    tokens whose dear second one they do not pay for."""
    odds = MatchOdds()
    # p = 0.25: one token brings 0.25 for 0.09; two or more bring 0.31-0.33 for 0.19-0.20
    assert odds.length(1, 6, STEPPED) == 1
    # p = 0.5: six tokens bring 0.98 for 0.20
    assert odds.length(2, 6, STEPPED) == 6
    # extending a model's draft of 2: the verify has paid for its dear tokens, so the copy runs on
    assert odds.length(1, 4, STEPPED, held=2) == 4
    assert odds.length(1, 4, LINE, held=2) == 1  # on a line, where it is held changes nothing


def test_odds_forget_over_their_halflife():
    odds = MatchOdds()
    for _ in range(40):
        odds.record(2, 3, 0)
    low = odds.chance(2)
    for _ in range(40):
        odds.record(2, 4, 4)
    assert low < 0.1 and odds.chance(2) > 0.9


def test_a_copy_ends_before_a_control_token():
    """The prompt's turn markers are never proposed: a copy stops before the first, and a copy
    that would start with one is no proposal (and no round for the odds to learn from)."""
    end, start = 90, 91  # a chat template's end of turn and start of turn
    drafter = PromptLookupDrafter(never=frozenset({end, start}))
    context = [5, 6, 7, end, start, 8, 9, 6]
    assert proposed(drafter, context, 4) == [7]  # "6" was followed by 7, end, start, 8
    assert proposed(drafter, [5, 7, end, start, 8, 7], 3) == []
    assert drafter.odds.estimates == {} and drafter._pending is None
    assert proposed(PromptLookupDrafter(), [5, 7, end, start, 8, 7], 3) == [end, start, 8]


def test_a_priced_lookup_learns_from_what_was_committed_after_its_proposals():
    """Each proposal's fate is read from the next round's context: rejected one-token matches
    shorten the next ones down to none, with no effect on an unpriced lookup."""
    priced, unpriced = PromptLookupDrafter(cost=LINE), PromptLookupDrafter()
    context = [1, 2, 3, 4, 5, 6, 7, 8]
    lengths = []
    for step in range(30):
        context = context + [1]  # "1" was seen before: a one-token match
        lengths.append(len(proposed(priced, context, 5)))
        assert len(proposed(unpriced, context, 5)) == 5
        context = context + [100 + step]  # the target disagreed at the first token
    assert lengths[0] == 1 and lengths == sorted(lengths, reverse=True) and lengths[-1] == 0
    assert lengths.index(0) <= 8  # the prior's 0.25 under the price within a few rejections
    ones = priced.odds.estimates[1]
    assert ones.failures > 5 and ones.successes < 0.5  # the prior's half, faded: none accepted


def test_a_priced_lookup_keeps_proposing_in_full_where_its_proposals_are_accepted():
    drafter = PromptLookupDrafter(cost=LINE)
    cycle = list(range(7, 14))
    context = cycle * 2 + [7]
    lengths = []
    for _ in range(6):
        tokens = proposed(drafter, context, 6)
        truth = [cycle[(len(context) + i) % len(cycle)] for i in range(len(tokens) + 1)]
        assert tokens == truth[:-1]
        lengths.append(len(tokens))
        context = context + truth  # every token accepted, then the target's own
    # a three-token match starts from its prior's 0.75: its whole k from the first round
    assert lengths == [6] * 6 and drafter.odds.chance(3) > 0.9


def test_a_rewind_drops_the_proposal_whose_fate_it_hid():
    drafter = PromptLookupDrafter(cost=LINE)
    assert proposed(drafter, [1, 2, 3, 1], 4)
    drafter.rewind(2)
    proposed(drafter, [1, 2, 5, 6, 1], 4)
    assert drafter.odds.estimates == {}


@pytest.mark.parametrize("name", list(LOOP_PROMPTS))
def test_a_priced_lookup_in_the_engine_matches_plain_greedy(tiny_pair, references, name):
    out, rounds = generate(
        lookup_engine(tiny_pair, PromptLookupDrafter(cost=VerifyCost(0.3, 0.3))),
        LOOP_PROMPTS[name],
        max_new_tokens=40,
        draft_tokens=6,
    )
    assert out == references[name]
    assert len({len(r.draft_tokens) for r in rounds}) > 1


@pytest.mark.parametrize("method", [Method.LOOKUP, Method.LOOKUP_CHAIN])
def test_a_built_lookup_never_copies_the_target_tokenizers_control_tokens(tiny_pair, method):
    """make_drafter hands every row's lookup the target tokenizer's special tokens: the chat
    template's markers the prompt holds (<|im_start|>, <|im_end|>) and its end of text."""
    target, draft = tiny_pair
    drafter = make_drafter(Pair(target, draft), GenerationConfig(method=method))
    tokenizer = target.tokenizer
    markers = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    assert drafter.make_lookup().never == frozenset(special_ids(tokenizer)) >= markers

"""Draft-length policies on scripted accept sequences, the confidence stop on hand-built logits,
and both driven through the real engine (greedy output unchanged)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from scipy import stats
from test_engine import PROMPT, reference_greedy
from tiny import RowDrafterBase, assert_cache_agrees, decode, per_row

from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.acceptance import ProposalKind
from specgen.decoding.drafters.base import Proposal
from specgen.decoding.drafters.lookup import PromptLookupDrafter
from specgen.decoding.drafters.model import ChainDrafter
from specgen.decoding.engine import Engine
from specgen.decoding.length import (
    AdditiveLength,
    ChainStops,
    ExpectedGainLength,
    Schedule,
    make_policy,
    unsure,
)
from specgen.decoding.sampling import choose, warp


def schedule(policy, rounds: list[tuple[int, int]]) -> list[int]:
    """k before each round, then after the last: [k0, k1, ..., kn]."""
    ks = [policy.next_k()]
    for proposed, accepted in rounds:
        policy.update(proposed, accepted)
        ks.append(policy.next_k())
    return ks


# -- policies on scripted rounds ------------------------------------------------------------------


def test_fixed_length_never_moves():
    assert schedule(make_policy(Schedule.FIXED, 5), [(5, 5), (5, 0), (0, 0), (3, 1)]) == [5] * 5


def test_additive_length_grows_on_full_acceptance_and_drops_to_accepted_plus_one():
    policy = AdditiveLength(start=4, min=1, max=8)
    rounds = [
        (4, 4),  # full -> 5
        (5, 5),  # full -> 6
        (6, 2),  # rejected after 2 -> 3
        (3, 3),  # full -> 4
        (0, 0),  # nothing proposed (lookup without a match): unchanged
        (2, 2),  # a short proposal fully accepted: k was not the limit, unchanged
        (4, 0),  # rejected at once -> 1
        (1, 1),
        (2, 2),
        (3, 3),
        (4, 4),
        (5, 5),
        (6, 6),
        (7, 7),
        (8, 8),  # up to the cap
        (8, 7),  # rejected at the last token -> 8
        (8, 6),  # -> 7
    ]
    assert schedule(policy, rounds) == [4, 5, 6, 3, 4, 4, 4, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 7]


def test_additive_length_respects_its_floor_and_step():
    policy = AdditiveLength(start=3, min=2, max=9, grow=3)
    assert schedule(policy, [(3, 3), (6, 6), (9, 9), (9, 0), (2, 2)]) == [3, 6, 9, 9, 2, 5]
    with pytest.raises(ValueError):
        AdditiveLength(start=9, min=1, max=8)


def best_k_by_brute_force(a: float, cost: float, low: int, high: int) -> int:
    gains = {k: sum(a**i for i in range(k + 1)) / (1 + cost * k) for k in range(low, high + 1)}
    best = max(gains.values())
    return min(k for k, g in gains.items() if math.isclose(g, best, rel_tol=0, abs_tol=1e-12) or g == best)


@pytest.mark.parametrize("cost", [0.0, 0.05, 0.37, 1.0])
def test_expected_gain_picks_the_best_k_for_its_estimate(cost):
    for a in [0.0, 0.2, 0.5, 0.7, 0.8, 0.9, 0.97, 1.0]:
        policy = ExpectedGainLength(
            cost=cost, min=1, max=10, prior_accepted=a * 1000, prior_rejections=(1 - a) * 1000
        )
        assert policy.next_k() == best_k_by_brute_force(a, cost, 1, 10), f"a={a}"


def test_expected_gain_estimate_follows_the_rounds():
    """Each round adds its accepted count as successes and one failure if it was rejected,
    the old counts decaying by 2^(-1/halflife) per round."""
    policy = ExpectedGainLength(cost=0.37, min=1, max=8, halflife=8, prior_accepted=3, prior_rejections=1)
    decay = 0.5 ** (1 / 8)
    successes, failures = 3.0, 1.0
    for proposed, accepted in [(4, 4), (4, 1), (0, 0), (2, 0), (5, 5)]:
        policy.update(proposed, accepted)
        if proposed:
            successes = successes * decay + accepted
            failures = failures * decay + (accepted < proposed)
        assert policy.acceptance == pytest.approx(successes / (successes + failures))
    # long runs move k to the ends of its range
    assert schedule(policy, [(8, 8)] * 60)[-1] == 8
    assert schedule(policy, [(8, 0)] * 60)[-1] == 1


def test_make_policy_by_schedule_name():
    assert make_policy(Schedule("fixed"), 5) == AdditiveLength(start=5, min=5, max=5)
    additive = make_policy(Schedule("additive"), 8)
    assert isinstance(additive, AdditiveLength) and (additive.k, additive.max) == (4, 8)
    assert make_policy(Schedule.ADDITIVE, 2).next_k() == 2
    gain = make_policy(Schedule("expected-gain"), 6, cost=0.05)
    assert isinstance(gain, ExpectedGainLength) and gain.cost == 0.05 and gain.max == 6


# -- the confidence stop --------------------------------------------------------------------------


def stops(*args) -> torch.Tensor:
    return unsure(*args)[0]


def test_confidence_stop_reads_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.35, 0.45]])) + 7.0  # any shift
    assert stops(0.48, logits).tolist() == [False, True]
    assert stops(0.4, logits).tolist() == [False, False]
    assert stops(0.6, logits[0]).item() is True  # 0-dim for one step
    assert stops(0.6, logits[0]).dtype == torch.bool
    # when the drafter sampled, the warped law it drew from decides
    warped = warp(logits[0], SamplingConfig(temperature=0.5))  # top = 0.25/0.38 = 0.658
    assert stops(0.6, logits[0], warped).item() is False
    assert stops(0.7, logits[0], warped).item() is True
    # bf16 logits are read in fp32
    assert stops(0.48, logits.bfloat16()).tolist() == [False, True]


def test_a_batch_s_chains_end_at_each_row_s_first_stop_or_its_k():
    """ChainStops, what a draft model's and a head's chains both stop by: a sure row drafts its
    k, an unsure one ends after the token that fell under the stop, a row with k = 0 or sitting
    the round out is done from the start, and the steps end once every row is done."""
    laws = torch.log(torch.tensor([[0.9, 0.1], [0.45, 0.55], [0.9, 0.1], [0.9, 0.1]]))
    chains = ChainStops(0.5, [3, 3, 0, 2], out=[False, False, False, True])
    assert chains.ends == [3, 3, 0, 0]
    assert not chains.after(0, laws, None) and chains.ends == [3, 3, 0, 0]  # 0.55 is not under 0.5
    assert not chains.after(1, laws, None) and chains.ends == [3, 2, 0, 0]  # 0.55 x 0.55 is
    assert chains.after(2, laws, None) and chains.ends == [3, 2, 0, 0]
    assert chains.reach[0].item() == pytest.approx(0.9**3)
    off = ChainStops(0.0, [2, 1])  # no stop: each row's k alone, and no host read
    assert not off.after(0, laws[:2], None) and off.after(1, laws[:2], None) and off.ends == [2, 1]


def test_confidence_stop_reads_the_chance_the_draft_is_still_right():
    """The product of the round's top probabilities: 0.6 then 0.6 stops after the second token
    (0.36), 0.95 eight times does not (0.66)."""
    lukewarm = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    stop, reach = unsure(0.5, lukewarm)
    assert not stop.item() and reach.item() == pytest.approx(0.6)
    stop, reach = unsure(0.5, lukewarm, None, reach)
    assert stop.item() and reach.item() == pytest.approx(0.36)
    sure, reach = torch.log(torch.tensor([0.95, 0.05])), None
    for _ in range(8):
        stop, reach = unsure(0.5, sure, None, reach)
        assert not stop.item()
    assert reach.item() == pytest.approx(0.95**8, rel=1e-5)


def ConfidentModelDrafter(model, device, stop: float, vocab: int | None = None) -> ChainDrafter:
    """The chain drafter with a confidence stop, as `--draft-confidence` builds it."""
    return ChainDrafter(model, device, vocab, confidence=stop)


class PolicyDrafter(RowDrafterBase):
    """Drives a length policy through the unchanged engine (set draft_tokens to the policy's
    max): asks the inner drafter for min(k, policy.next_k()) and feeds the verdict back.
    The kept count equals the accepted count except when EOS / max_new_tokens cut the last round."""

    def __init__(self, inner, policy):
        self.inner, self.policy = inner, policy
        self.asked: list[int] = []
        self._proposed = 0

    def start(self, prompt_ids, generator=None, capacity=0):
        self.inner.start(prompt_ids, generator, capacity)

    def rewind(self, valid):
        self.inner.rewind(valid)

    def propose(self, context, k, sampling):
        k = min(k, self.policy.next_k())
        self.asked.append(k)
        proposal = self.inner.propose(context, k, sampling)
        self._proposed = proposal.tokens.shape[0]
        return proposal

    def observe(self, path):
        self.policy.update(self._proposed, len(path))
        self.inner.observe(path)


def run(pair, drafter, prompt, **kwargs):
    target, _ = pair
    if isinstance(drafter, RowDrafterBase):
        drafter = per_row(drafter)
    engine = Engine(target.model, target.device, frozenset(), target.context_length, drafter)
    config = GenerationConfig(method=Method.CHAIN, **kwargs)
    rounds, state = decode(engine, prompt, config)
    return [t for r in rounds for t in r.emitted], rounds, state


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return reference_greedy(tiny_pair[0].model, PROMPT, 40)


@pytest.mark.parametrize("threshold", [0.0, 0.05, 1.01])
def test_confidence_stop_in_a_model_drafter_keeps_greedy_output_and_the_cache(
    tiny_pair, reference, threshold
):
    """Threshold 0 never stops (rounds of k), 1.01 always stops (rounds of 1 draft token),
    0.05 (about the product of the tiny draft's top probabilities over three tokens) stops in
    some rounds only."""
    _, draft = tiny_pair
    drafter = ConfidentModelDrafter(draft.model, draft.device, threshold)
    out, rounds, state = run(tiny_pair, drafter, PROMPT, max_new_tokens=40, draft_tokens=4)
    assert out == reference
    assert not rounds[0].draft_tokens  # the first token does not wait for the draft to read the prompt
    lengths, produced = set(), len(rounds[0].emitted)
    for r in rounds[1:]:  # rounds the budget did not cap (the engine drafts at most remaining - 1)
        if 40 - produced > 4:
            lengths.add(len(r.draft_tokens))
        produced += len(r.emitted)
    if threshold == 0.0:
        assert 4 in lengths and 1 not in lengths
    elif threshold > 1:
        assert lengths == {1}
    else:
        assert 4 in lengths and min(lengths) < 4
    assert_cache_agrees(draft.model, drafter.cache, state.ids)  # the draft cache holds a committed prefix


def test_confidence_stop_under_sampling_is_reproducible(tiny_pair):
    _, draft = tiny_pair
    sampling = SamplingConfig(temperature=0.8, seed=4)
    outs = []
    for _ in range(2):
        drafter = ConfidentModelDrafter(draft.model, draft.device, 0.3)
        outs.append(run(tiny_pair, drafter, PROMPT, max_new_tokens=24, draft_tokens=4, sampling=sampling)[0])
    assert outs[0] == outs[1] and len(outs[0]) == 24


@pytest.mark.parametrize(
    "make_policy",
    [
        lambda: make_policy(Schedule.FIXED, 3),
        lambda: AdditiveLength(start=2, min=1, max=8),
        lambda: ExpectedGainLength(cost=0.05, min=1, max=8),
    ],
)
def test_policies_through_the_engine_keep_greedy_output(tiny_pair, make_policy):
    """Lookup drafting on a prompt whose continuation runs in loops (190 x6 -> 37 x14, 12 x12):
    the output is plain greedy's whatever k the policy picks, and adaptive policies move."""
    prompt = [190] * 6
    expected = reference_greedy(tiny_pair[0].model, prompt, 40)
    policy = make_policy()
    drafter = PolicyDrafter(PromptLookupDrafter(), policy)
    out, rounds, _ = run(tiny_pair, drafter, prompt, max_new_tokens=40, draft_tokens=8)
    assert out == expected
    if isinstance(policy, AdditiveLength) and policy.min == policy.max:  # the fixed length
        assert max(drafter.asked) == 3
        return
    assert len(set(drafter.asked)) > 1
    if isinstance(policy, AdditiveLength):
        assert max(drafter.asked) > 2 and min(drafter.asked) < 2


# -- statistical: a confidence stop keeps the target's law; dropping a drawn token does not -------

# Draft = the tiny target with its logits scaled by 0.5 (same top-4 support, flatter), so
# most draft tokens are accepted and a biased proposal shows. Prompt [224], temperature 1,
# top-k 4: q0 = (.383, .340, .151, .125) and p1 = (.318, .300, .200, .182) on the support.
# The confidence of p1 (0.318) is over the 0.3 threshold, so x2 is always drafted; that of
# p2(.|x1) is under it for one x1 in four (p = 0.2), so whether x3 is drafted depends on x1.
STOP_PROMPT = [224]
STOP_SAMPLING = SamplingConfig(temperature=1.0, top_k=4)
STOP_THRESHOLD = 0.3
DROP_THRESHOLD = 0.25  # the broken drafter drops x1 when p1(x1) < 0.25: 2 of the 4 tokens


class ScaledLogits(torch.nn.Module):
    """A draft model that is the target with its logits multiplied by `scale`."""

    def __init__(self, model, scale: float):
        super().__init__()
        self.inner, self.scale, self.config = model, scale, model.config

    def forward(self, **kwargs):
        return SimpleNamespace(logits=self.inner(**kwargs).logits * self.scale)


class DropLowProbabilityDrafter(RowDrafterBase):
    """BROKEN on purpose: a drawn token whose own probability is under DROP_THRESHOLD is
    dropped (and drafting stops), so a proposed x_i is no longer distributed as p_i. It keeps
    no cache: each step runs the draft over the whole sequence."""

    def __init__(self, model, device, stop: float):
        self.model = model
        self.generator = None

    def start(self, prompt_ids, generator=None, capacity=0):
        self.generator = generator

    @torch.inference_mode()
    def propose(self, context, k, sampling) -> Proposal:
        tokens, probs = [], []
        for _ in range(k):
            logits = self.model(input_ids=torch.tensor([context + [int(t) for t in tokens]])).logits[0, -1]
            token, dist = choose(logits, sampling, self.generator)
            if float(dist[token]) < DROP_THRESHOLD:
                break
            tokens.append(token)
            probs.append(dist)
        if not tokens:
            return Proposal.empty()
        return Proposal.chain(torch.stack(tokens), ProposalKind.SAMPLED, torch.stack(probs))


def gof_tuples(samples: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    """Chi-square of tuples against an exact law on few cells (expected < 5 pooled); an
    impossible tuple gives 0."""
    counts = Counter(samples)
    if any(law.get(cell, 0.0) == 0.0 for cell in counts):
        return 0.0
    n = len(samples)
    obs, exp, tail_obs, tail_exp = [], [], 0, 0.0
    for cell, prob in law.items():
        if prob * n >= 5:
            obs.append(counts[cell])
            exp.append(prob * n)
        else:
            tail_obs += counts[cell]
            tail_exp += prob * n
    if tail_exp >= 5 or not obs:
        obs.append(tail_obs)
        exp.append(tail_exp)
    else:
        obs[-1] += tail_obs
        exp[-1] += tail_exp
    exp = [e * n / sum(exp) for e in exp]  # rounding
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.fixture(scope="module")
def three_token_law(tiny_pair):
    """Exact plain-sampling law of the first three tokens after STOP_PROMPT (top-4 supports)."""
    model = tiny_pair[0].model

    def law_after(prefixes):
        with torch.no_grad():
            logits = model(torch.tensor([STOP_PROMPT + list(p) for p in prefixes])).logits[:, -1]
        return warp(logits, STOP_SAMPLING).double()

    law = {(): 1.0}
    for _ in range(3):
        prefixes = list(law)
        rows = law_after(prefixes)
        law = {
            prefix + (t,): law[prefix] * float(row[t])
            for prefix, row in zip(prefixes, rows)
            for t in row.nonzero().flatten().tolist()
        }
    return law


def first_three(pair, drafter_class, seeds: range) -> list[tuple[int, ...]]:
    target, _ = pair
    drafter = drafter_class(ScaledLogits(target.model, 0.5), target.device, STOP_THRESHOLD)
    if isinstance(drafter, RowDrafterBase):
        drafter = per_row(drafter)
    engine = Engine(target.model, target.device, frozenset(), target.context_length, drafter)
    out = []
    for seed in seeds:
        config = GenerationConfig(
            method=Method.CHAIN,
            max_new_tokens=4,
            draft_tokens=3,
            sampling=dataclasses.replace(STOP_SAMPLING, seed=seed),
        )
        out.append(tuple([t for r in decode(engine, STOP_PROMPT, config)[0] for t in r.emitted][:3]))
    return out


@pytest.mark.statistical
def test_confidence_stop_keeps_the_law_of_the_first_three_tokens(tiny_pair, three_token_law):
    """500 generations, drafts ending where the product of the draft's top probabilities so far
    falls below 0.3: of 1 or 2 tokens, by the draws (6 and 63 of 69 rounds in 60 seeds, measured
    once): (t1, t2, t3) ~ the exact
    joint law of plain sampling (64 cells, those expected under 5 pooled).

    False-failure probability alpha = 1e-3.
    """
    samples = first_three(tiny_pair, ConfidentModelDrafter, range(500))
    pvalue = gof_tuples(samples, three_token_law)
    assert pvalue > 1e-3, f"p-value {pvalue:.3g}"


@pytest.mark.statistical
def test_control_dropping_a_low_probability_draw_fails(tiny_pair, three_token_law):
    """Negative control: drop x1 when p1(x1) < 0.25. The first token's law becomes
    0.38 q + min(p, q) on the kept tokens + residual mass, noncentrality 58 at 400
    generations (df 3) against the alpha = 1e-3 critical value 16.3: it fails with
    probability 0.99993 (noncentral chi-square)."""
    samples = first_three(tiny_pair, DropLowProbabilityDrafter, range(30_000, 30_400))
    first = {}
    for cell, prob in three_token_law.items():
        first[cell[:1]] = first.get(cell[:1], 0.0) + prob
    pvalue = gof_tuples([s[:1] for s in samples], first)
    assert pvalue < 1e-3, f"the broken drafter passed: p-value {pvalue:.3g}"

"""Goodness-of-fit tests: speculative sampling must emit exactly the target's warped law q.

Notation as in ALGORITHMS.md: p = draft distribution, q = target distribution (both warped).
Each kind of positive test has negative controls beside it: deliberately broken variants,
run through the same harness, must FAIL the same test, so the positive test has power.

All randomness comes from fixed seeds, so each test is deterministic; the "false-failure
probability" in each docstring is the chance that a correct implementation fails with an
arbitrary seed (the test's alpha).

Rule level: the real `speculative_sampling` is run on >= 100k independent rounds at once
with `torch.func.vmap(randomness="different")`; inside vmap a generator cannot be passed, so
those rounds draw from the global RNG inside `torch.random.fork_rng` with a fixed seed (the
global state is restored afterwards). One smaller looped test drives the explicit-generator
path the engine uses.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy import stats
from tiny import decode

import specgen.decoding.verify as engine_module
from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.acceptance import Verdict, point_mass_sampling, speculative_sampling
from specgen.decoding.drafters.model import ChainDrafter
from specgen.decoding.engine import Engine
from specgen.decoding.events import Finished
from specgen.decoding.sampling import make_generator, sample, warp

pytestmark = [pytest.mark.statistical, pytest.mark.usefixtures("one_thread")]

ALPHA = 1e-4  # rule level: false-failure probability of each positive test
SMALL_ALPHA = 1e-3  # drafter and engine level (thousands of samples): the same, per test


# -- chi-square helpers -------------------------------------------------------------------------


def gof_pvalue(samples: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of integer samples against probs [V].

    Cells with expected count < min_expected are pooled into one tail cell (merged into the
    smallest kept cell if the tail itself is too small). A sample on a zero-probability cell
    is impossible under the null: p-value 0.
    """
    probs = probs.double().flatten()
    probs = probs / probs.sum()
    n = samples.numel()
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * n
    big = expected >= min_expected
    order = torch.argsort(expected[big], descending=True)
    obs = counts[big][order].tolist()
    exp = expected[big][order].tolist()
    tail_obs, tail_exp = counts[~big].sum().item(), expected[~big].sum().item()
    if tail_exp >= min_expected:
        obs.append(tail_obs)
        exp.append(tail_exp)
    elif exp:
        obs[-1] += tail_obs
        exp[-1] += tail_exp
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def two_sample_pvalue(a: torch.Tensor, b: torch.Tensor, min_count: int = 10) -> float:
    """Chi-square contingency test that two integer samples share a law (rare values pooled)."""
    vocab = int(max(a.max(), b.max())) + 1
    ca = torch.bincount(a, minlength=vocab)
    cb = torch.bincount(b, minlength=vocab)
    common = (ca + cb) >= min_count
    rows = [ca[common].tolist(), cb[common].tolist()]
    if (~common).any() and (ca[~common].sum() + cb[~common].sum()) > 0:
        rows[0].append(int(ca[~common].sum()))
        rows[1].append(int(cb[~common].sum()))
    return float(stats.chi2_contingency(rows).pvalue)


# -- rule level: analytic p and q over 6 tokens -------------------------------------------------

# q0..q3 (target rows) and p1..p3 (draft rows; x_i ~ p_i is judged against q_(i-1)).
# Per position there are tokens with p > q, p < q, p = 0 < q and q = 0 < p.
Q = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
        [0.05, 0.10, 0.40, 0.00, 0.25, 0.20],
        [0.00, 0.30, 0.10, 0.25, 0.05, 0.30],
        [0.40, 0.00, 0.15, 0.15, 0.20, 0.10],
    ]
)
P = torch.tensor(
    [
        [0.10, 0.40, 0.00, 0.20, 0.15, 0.15],
        [0.20, 0.10, 0.30, 0.10, 0.30, 0.00],
        [0.25, 0.25, 0.00, 0.20, 0.10, 0.20],
    ]
)
# acceptance probabilities sum_y min(p_i, q_(i-1)): 0.60, 0.70, 0.70
ACCEPT = torch.minimum(P, Q[:3]).sum(dim=-1).double()

# logits for the warp-consistency tests and the unwarped-draft controls
TARGET_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
DRAFT_LOGITS = torch.tensor([0.5, 2.0, -1.0, 1.0, 1.5, 0.0])

ROUNDS = 100_000


def _verdict_fields(verdict: Verdict) -> tuple[torch.Tensor, torch.Tensor]:
    return verdict.accepted, verdict.chosen


def run_rule(
    rule, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `rule` on every row of draft_tokens [n, k] at once -> (accepted [n], token [n])."""
    batched = torch.func.vmap(
        lambda tokens: _verdict_fields(rule(tokens, draft_probs, target_probs, None)), randomness="different"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return batched(draft_tokens)


@torch.inference_mode()
def run_rule_loop(
    rule, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like run_rule, one call per round with one explicit generator (as the engine does)."""
    generator = make_generator(seed)
    verdicts = [rule(tokens, draft_probs, target_probs, generator) for tokens in draft_tokens]
    return (torch.stack([v.accepted for v in verdicts]), torch.stack([v.chosen for v in verdicts]))


def draw_drafts(draft_probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """n independent chains x_1..x_k with x_i ~ draft_probs[i-1] -> [n, k]."""
    generator = make_generator(seed)
    k, vocab = draft_probs.shape
    return sample(draft_probs.expand(n, k, vocab), generator)


def emitted_at(position: int, drafts: torch.Tensor, accepted: torch.Tensor, token: torch.Tensor):
    """The token emitted at `position` in the rounds that reached it (accepted >= position)."""
    reached = accepted >= position
    if position < drafts.shape[1]:
        at = torch.where(accepted > position, drafts[:, position], token)
    else:
        at = token
    return at[reached]


def rule_without_residual(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """BROKEN on purpose: at the first rejection draw from q instead of norm(max(q - p, 0))."""
    k = draft_tokens.shape[0]
    rows = torch.arange(k, device=target_probs.device)
    q_x = target_probs[rows, draft_tokens]
    p_x = draft_probs[rows, draft_tokens] if draft_probs is not None else torch.ones_like(q_x)
    uniforms = torch.rand(k, generator=generator, device=target_probs.device)
    accepted = (uniforms * p_x < q_x).to(torch.int64).cumprod(dim=0).sum()
    q_row = target_probs.index_select(0, accepted.view(1))[0]
    token = torch.multinomial(q_row, 1, generator=generator)[0]
    return Verdict.chain(accepted, token, k)


@pytest.mark.parametrize("k", [1, 3])
def test_rule_emits_q_at_every_position(k):
    """Chain rule, analytic p/q, 100k rounds: emitted token j (given j accepted) ~ q_j.

    Checks the first token against q0, the following ones conditionally on the earlier drafts
    being accepted (q1, q2 and the bonus q3 for k = 3), and the law of the accepted count.
    Each chi-square fails by chance with probability alpha = 1e-4 (at most 1 - (1-1e-4)^5
    ~ 5e-4 for the whole test); q = 0 tokens must never appear.
    """
    drafts = draw_drafts(P[:k], ROUNDS, seed=10 + k)
    accepted, token = run_rule(speculative_sampling, drafts, P[:k], Q[: k + 1], seed=20 + k)
    for position in range(k + 1):
        law = emitted_at(position, drafts, accepted, token)
        assert law.numel() > 15_000
        pvalue = gof_pvalue(law, Q[position])
        assert pvalue > ALPHA, f"k={k}, position {position}: p-value {pvalue:.3g}"
    reach = torch.cat([torch.ones(1, dtype=torch.float64), ACCEPT[:k].cumprod(0)])
    accepted_law = reach - torch.cat([reach[1:], torch.zeros(1, dtype=torch.float64)])
    pvalue = gof_pvalue(accepted, accepted_law)
    assert pvalue > ALPHA, f"k={k}, accepted counts: p-value {pvalue:.3g}"


@pytest.mark.parametrize("k", [1, 3])
def test_control_without_residual_fails(k):
    """Negative control (a): drawing from q after a rejection must fail the first-token test.

    Its first-token law is min(p1, q0) + 0.4 q0; the chi-square noncentrality at 100k rounds
    is ~17,000 against a 1e-4 critical value of 23.5 (df 4): power 1 to machine precision.
    """
    drafts = draw_drafts(P[:k], ROUNDS, seed=30 + k)
    accepted, token = run_rule(rule_without_residual, drafts, P[:k], Q[: k + 1], seed=40 + k)
    pvalue = gof_pvalue(emitted_at(0, drafts, accepted, token), Q[0])
    assert pvalue < ALPHA, f"the broken rule passed: p-value {pvalue:.3g}"


WARPS = {
    "temperature-0.5": SamplingConfig(temperature=0.5),
    "top-k-3": SamplingConfig(temperature=1.0, top_k=3),
    "temperature-0.7-top-p-0.8": SamplingConfig(temperature=0.7, top_p=0.8),
}


@pytest.mark.parametrize("name", list(WARPS))
def test_rule_with_warped_draft_and_target_emits_warped_q(name):
    """Same warp on both sides, draft reports what it sampled: output law = warp(target logits).

    k = 2 with the same logits at both positions; alpha = 1e-4 per position (2e-4 in all).
    """
    sampling = WARPS[name]
    p = warp(DRAFT_LOGITS, sampling).expand(2, -1)
    q = warp(TARGET_LOGITS, sampling).expand(3, -1)
    drafts = draw_drafts(p, ROUNDS, seed=50)
    accepted, token = run_rule(speculative_sampling, drafts, p, q, seed=51)
    for position in range(2):
        pvalue = gof_pvalue(emitted_at(position, drafts, accepted, token), q[0])
        assert pvalue > ALPHA, f"{name}, position {position}: p-value {pvalue:.3g}"


UNWARPED_DRAFT = {
    "temperature": SamplingConfig(temperature=0.5),
    "top-k": SamplingConfig(temperature=1.0, top_k=3),
}


@pytest.mark.parametrize("name", list(UNWARPED_DRAFT))
def test_control_unwarped_draft_probs_fails(name):
    """Negative control (b): tokens drawn from warped p, ratios/residual from unwarped p.

    This is the transformers#47932 bug (sample from processed logits, report raw ones).
    Exact broken first-token laws vs q: temperature 0.5 gives noncentrality ~8,600 (df 5),
    top-k 3 gives ~2,000 (df 2) at 100k rounds, against critical values of 25.7 and 18.4 at
    alpha = 1e-4: power 1 to machine precision.
    """
    sampling = UNWARPED_DRAFT[name]
    sampled_from = warp(DRAFT_LOGITS, sampling).unsqueeze(0)
    reported = torch.softmax(DRAFT_LOGITS, dim=-1).unsqueeze(0)
    q = warp(TARGET_LOGITS, sampling).expand(2, -1)
    drafts = draw_drafts(sampled_from, ROUNDS, seed=60)
    accepted, token = run_rule(speculative_sampling, drafts, reported, q, seed=61)
    pvalue = gof_pvalue(emitted_at(0, drafts, accepted, token), q[0])
    assert pvalue < ALPHA, f"the unwarped draft passed: p-value {pvalue:.3g}"


def test_top_k_on_the_target_only_is_still_exact():
    """Top-k on the target only, the draft sampling and reporting an unwarped p: still exact.

    Speculative sampling is exact for ANY proposal that reports the law it sampled from, so
    this is a positive test (it is not a failure mode); the failing mismatch is the opposite
    one, in the next test. alpha = 1e-4.
    """
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    p = torch.softmax(DRAFT_LOGITS, dim=-1).unsqueeze(0)
    q = warp(TARGET_LOGITS, sampling).expand(2, -1)
    drafts = draw_drafts(p, ROUNDS, seed=70)
    accepted, token = run_rule(speculative_sampling, drafts, p, q, seed=71)
    pvalue = gof_pvalue(emitted_at(0, drafts, accepted, token), q[0])
    assert pvalue > ALPHA, f"p-value {pvalue:.3g}"


def test_control_top_k_on_the_draft_only_fails():
    """Negative control (c): the warp not applied identically (top-k 3 on the draft only).

    The target side then is the un-top-k'd q: 18% of the output falls outside the target's
    top-3 (impossible under plain top-k sampling: p-value 0), and within it the
    noncentrality is ~3,300 at 100k rounds: power 1.
    """
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    p = warp(DRAFT_LOGITS, sampling).unsqueeze(0)
    target_without_top_k = warp(TARGET_LOGITS, SamplingConfig(temperature=1.0)).expand(2, -1)
    drafts = draw_drafts(p, ROUNDS, seed=80)
    accepted, token = run_rule(speculative_sampling, drafts, p, target_without_top_k, seed=81)
    pvalue = gof_pvalue(emitted_at(0, drafts, accepted, token), warp(TARGET_LOGITS, sampling))
    assert pvalue < ALPHA, f"the mismatched warp passed: p-value {pvalue:.3g}"


def point_masses(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """The point-mass rule in the harness's signature (the reported law is the one-hot)."""
    return point_mass_sampling(draft_tokens, target_probs, generator)


def test_point_mass_proposals_emit_q():
    """Point masses (`point_mass_sampling`): for any draft tokens the emitted law is q.

    The draft tokens are drawn from P (the rule is exact conditionally on every x, so also
    marginally) but P is never shown to the rule. The point-mass path cannot run under vmap
    (an in-place scatter into an unbatched tensor), so this loops: 12k rounds, k = 2, one
    explicit generator, as in the engine. alpha = 1e-4 per position (2e-4 for the test).
    """
    drafts = draw_drafts(P[:2], 12_000, seed=90)
    accepted, token = run_rule_loop(point_masses, drafts, None, Q[:3], seed=91)
    for position in range(3):
        law = emitted_at(position, drafts, accepted, token)
        assert law.numel() > 300  # the bonus after two accepted point masses: ~3.8% of rounds
        pvalue = gof_pvalue(law, Q[position])
        assert pvalue > ALPHA, f"position {position}: p-value {pvalue:.3g}"
    # a point mass on a q = 0 token is always rejected
    assert (drafts[:, 0] == 5).sum() > 1000
    assert not (accepted[drafts[:, 0] == 5] > 0).any()


def test_control_point_mass_without_residual_fails():
    """Negative control (a) for point masses: x1 = 1 fixed, re-drawing from q on rejection.

    Broken law 0.25 [y = 1] + 0.75 q0(y); noncentrality ~18,700 at 100k rounds (df 4):
    power 1 to machine precision at alpha = 1e-4.
    """
    drafts = torch.ones(ROUNDS, 1, dtype=torch.int64)
    accepted, token = run_rule(rule_without_residual, drafts, None, Q[:2], seed=95)
    pvalue = gof_pvalue(emitted_at(0, drafts, accepted, token), Q[0])
    assert pvalue < ALPHA, f"the broken rule passed: p-value {pvalue:.3g}"


def test_rule_with_explicit_generator_emits_q():
    """The engine's path: one call per round with an explicit torch.Generator (6k rounds, k=2).

    Also checks that the same generator seed replays the same verdicts. alpha = 1e-4 per
    position (2e-4 for the test).
    """
    drafts = draw_drafts(P[:2], 6_000, seed=100)
    accepted, token = run_rule_loop(speculative_sampling, drafts, P[:2], Q[:3], seed=101)
    for position in range(2):
        pvalue = gof_pvalue(emitted_at(position, drafts, accepted, token), Q[position])
        assert pvalue > ALPHA, f"position {position}: p-value {pvalue:.3g}"
    again = run_rule_loop(speculative_sampling, drafts[:200], P[:2], Q[:3], seed=101)
    assert torch.equal(again[0], accepted[:200]) and torch.equal(again[1], token[:200])


# -- q contract: the chain drafter's samples follow the probs it reports ---------------------------

DRAFT_CONTEXT = [257, 84, 82, 68]
CONTRACT_SAMPLING = SamplingConfig(temperature=0.8, top_k=20)
CONTRACT_DRAWS = 1500


@pytest.fixture(scope="module")
def drafter_draws(tiny_pair):
    """CONTRACT_DRAWS first draft tokens from a fixed context, with the probs reported each time."""
    _, draft = tiny_pair
    drafter = ChainDrafter(draft.model, draft.device)
    drafter.join(0, DRAFT_CONTEXT, make_generator(2024), 64)
    tokens, reported = [], None
    for _ in range(CONTRACT_DRAWS):
        proposal = drafter.propose([DRAFT_CONTEXT], [1], [CONTRACT_SAMPLING])[0]
        drafter.observe(0, [])
        drafter.rewind(0, len(DRAFT_CONTEXT) - 1)  # rewind so the next proposal sees the same context
        tokens.append(proposal.tokens[0])
        if reported is None:
            reported = proposal.probs[0]
        else:  # the reported law is the same every time (same context)
            torch.testing.assert_close(proposal.probs[0], reported, atol=1e-6, rtol=0)
    with torch.no_grad():
        logits = draft.model(torch.tensor([DRAFT_CONTEXT])).logits[0, -1]
    return torch.stack(tokens), reported, logits


def test_drafter_reports_the_warped_draft_logits(drafter_draws):
    """The reported probs are warp(draft logits) from a fresh, cache-free forward (top-k 20)."""
    _, reported, logits = drafter_draws
    assert reported.dtype == torch.float32
    torch.testing.assert_close(reported, warp(logits, CONTRACT_SAMPLING), atol=1e-5, rtol=1e-4)
    assert int((reported > 0).sum()) == 20


def test_drafter_samples_follow_the_reported_probs(drafter_draws):
    """q contract: frequencies of 1500 sampled first draft tokens match the reported probs.

    Fails by chance with probability alpha = 1e-3. Control: the same draws tested against the
    UNWARPED softmax of the draft logits (what a drafter reporting raw logits would claim)
    must fail; samples outside the reported support are impossible (p-value 0).
    """
    tokens, reported, logits = drafter_draws
    pvalue = gof_pvalue(tokens, reported)
    assert pvalue > SMALL_ALPHA, f"p-value {pvalue:.3g}"
    control = gof_pvalue(tokens, torch.softmax(logits.double(), dim=-1))
    assert control < SMALL_ALPHA, f"raw probs passed: p-value {control:.3g}"


def test_drafter_reports_conditionals_for_every_draft_position(tiny_pair):
    """For k = 3 each reported row is warp of the draft logits after the earlier draft tokens."""
    _, draft = tiny_pair
    drafter = ChainDrafter(draft.model, draft.device)
    drafter.join(0, DRAFT_CONTEXT, make_generator(7), 64)
    for _ in range(3):
        proposal = drafter.propose([DRAFT_CONTEXT], [3], [CONTRACT_SAMPLING])[0]
        drafter.observe(0, [])
        drafter.rewind(0, len(DRAFT_CONTEXT) - 1)
        ids = DRAFT_CONTEXT + proposal.tokens.tolist()
        with torch.no_grad():
            logits = draft.model(torch.tensor([ids])).logits[0, len(DRAFT_CONTEXT) - 1 : -1]
        torch.testing.assert_close(proposal.probs, warp(logits, CONTRACT_SAMPLING), atol=1e-5, rtol=1e-4)
        rows = torch.arange(3)
        assert (proposal.probs[rows, proposal.tokens] > 0).all()


# -- engine level: chain speculative sampling vs plain sampling on the tiny models --------------

# A one-token prompt (no prefill, so a generation costs ~3 small forwards). Token 224 was
# chosen among the 259 one-token contexts for power: there the tiny draft and target are
# least far apart at temperature 1 (total variation 0.80 with top-p 0.95, acceptance 20%),
# so the no-residual control is visible with 1200 generations (chi-square noncentrality
# ~119). At temperature 1 most contexts have TV > 0.9, where dropping the residual hardly
# matters (the broken law min(p, q) + TV q tends to q as TV -> 1). Top-p 0.95 makes a
# target left unwarped visible too: its tokens outside the nucleus are impossible here.
ENGINE_PROMPT = [224]
ENGINE_SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95)
SPEC_GENERATIONS = 1200
PLAIN_GENERATIONS = 800
CONTROL_GENERATIONS = 1200


def first_two_tokens(engine: Engine, method: Method, seeds: range) -> torch.Tensor:
    """The first 2 tokens of one generation per seed -> [len(seeds), 2].

    max_new_tokens = 2 caps the first round's draft at 1 token (the engine never drafts past
    the budget), so draft_tokens = 3 is effectively k = 1 here.
    """
    out = []
    for seed in seeds:
        config = GenerationConfig(
            method=method,
            max_new_tokens=2,
            draft_tokens=3,
            sampling=dataclasses.replace(ENGINE_SAMPLING, seed=seed),
        )
        out.append([t for r in decode(engine, ENGINE_PROMPT, config)[0] for t in r.emitted])
    return torch.tensor(out)


def make_engine(pair) -> Engine:
    target, draft = pair
    # no stop ids: every generation yields exactly 2 tokens
    return Engine(
        target.model,
        target.device,
        frozenset(),
        target.context_length,
        ChainDrafter(draft.model, draft.device),
    )


@pytest.fixture(scope="module")
def target_law(tiny_pair):
    """Exact plain-sampling laws: q0 of the first token [V] and of the first two tokens [V, V]."""
    from tiny import two_token_law

    return two_token_law(tiny_pair[0].model, ENGINE_PROMPT, ENGINE_SAMPLING)


@pytest.fixture(scope="module")
def spec_tokens(tiny_pair):
    return first_two_tokens(make_engine(tiny_pair), Method.CHAIN, range(SPEC_GENERATIONS))


@pytest.fixture(scope="module")
def plain_tokens(tiny_pair):
    seeds = range(10**6, 10**6 + PLAIN_GENERATIONS)
    return first_two_tokens(make_engine(tiny_pair), Method.PLAIN, seeds)


def test_engine_chain_first_token_follows_target_law(spec_tokens, target_law):
    """1200 chain generations (temperature 1, top-p 0.95): first token ~ warp(target logits).

    Fails by chance with probability alpha = 1e-3.
    """
    q0, _ = target_law
    pvalue = gof_pvalue(spec_tokens[:, 0], q0)
    assert pvalue > SMALL_ALPHA, f"p-value {pvalue:.3g}"


def test_engine_chain_first_two_tokens_follow_target_law(spec_tokens, target_law):
    """The pair (token 1, token 2) ~ q0(t1) q1(t2 | t1), exact law from one batched forward.

    Pairs with expected count < 5 are pooled. alpha = 1e-3.
    """
    _, joint = target_law
    vocab = joint.shape[0]
    pvalue = gof_pvalue(spec_tokens[:, 0] * vocab + spec_tokens[:, 1], joint.flatten())
    assert pvalue > SMALL_ALPHA, f"p-value {pvalue:.3g}"


def test_engine_second_token_matches_plain_sampling(spec_tokens, plain_tokens, target_law):
    """Two-sample chi-square (contingency, rare tokens pooled): 2nd token, chain vs plain.

    Also the plain runs against the exact laws. alpha = 1e-3 per test (3e-3 in all).
    """
    pvalue = two_sample_pvalue(spec_tokens[:, 1], plain_tokens[:, 1])
    assert pvalue > SMALL_ALPHA, f"two-sample p-value {pvalue:.3g}"
    q0, joint = target_law
    vocab = joint.shape[0]
    pvalue = gof_pvalue(plain_tokens[:, 0], q0)
    assert pvalue > SMALL_ALPHA, f"plain first token: p-value {pvalue:.3g}"
    pvalue = gof_pvalue(plain_tokens[:, 0] * vocab + plain_tokens[:, 1], joint.flatten())
    assert pvalue > SMALL_ALPHA, f"plain pairs: p-value {pvalue:.3g}"


def test_engine_control_without_residual_fails(tiny_pair, target_law, monkeypatch):
    """Negative control: the engine with the no-residual rule fails the first-token test.

    1200 generations: the broken first-token law min(p, q) + TV q is exactly computable; its
    chi-square noncentrality is ~119 (df 46) against the alpha = 1e-3 critical value, so the
    control fails with probability 0.99998 (power computed from the noncentral chi-square).
    """
    monkeypatch.setattr(engine_module, "speculative_sampling", rule_without_residual)
    seeds = range(5000, 5000 + CONTROL_GENERATIONS)
    tokens = first_two_tokens(make_engine(tiny_pair), Method.CHAIN, seeds)
    q0, _ = target_law
    pvalue = gof_pvalue(tokens[:, 0], q0)
    assert pvalue < SMALL_ALPHA, f"the broken engine passed: p-value {pvalue:.3g}"


# -- determinism ---------------------------------------------------------------------------------

DETERMINISM_PROMPT = [257, 84, 82, 68, 81, 198]


@pytest.mark.parametrize("method", [Method.CHAIN, Method.PLAIN])
def test_same_seed_same_tokens_different_seed_different_tokens(tiny_pair, method):
    """Same seed and settings -> identical ids (fresh engines and a reused one); other seeds differ."""

    def tokens(engine: Engine, seed: int) -> list[int]:
        config = GenerationConfig(
            method=method,
            max_new_tokens=24,
            draft_tokens=3,
            sampling=SamplingConfig(temperature=1.0, top_p=0.95, seed=seed),
        )
        return [t for r in decode(engine, DETERMINISM_PROMPT, config)[0] for t in r.emitted]

    reused = make_engine(tiny_pair)
    first = tokens(reused, 11)
    assert len(first) == 24
    assert tokens(reused, 11) == first
    assert tokens(make_engine(tiny_pair), 11) == first
    others = {tuple(tokens(reused, seed)) for seed in (12, 13, 14)}
    assert tuple(first) not in others and len(others) == 3


# -- batched chain sampling: every row of a dynamic batch follows the target law ------------------


def batched_first_two_tokens(pair, generations: int, seed: int) -> torch.Tensor:
    """`generations` rows of the one-token prompt, 300 at a time; row i seeded seed + i."""
    target, draft = pair
    engine = Engine(
        target.model,
        target.device,
        frozenset(),
        target.context_length,
        ChainDrafter(draft.model, draft.device),
    )
    config = GenerationConfig(
        method=Method.CHAIN,
        max_new_tokens=2,
        draft_tokens=3,
        sampling=dataclasses.replace(ENGINE_SAMPLING, seed=seed),
    )
    finished = {
        r.index: r.state.ids[-2:]
        for r in engine.generate([ENGINE_PROMPT] * generations, config, 300)
        if isinstance(r.event, Finished)
    }
    return torch.tensor([finished[i] for i in range(generations)])


def assert_pairs_follow(tokens: torch.Tensor, target_law) -> None:
    """First tokens ~ q0, pairs ~ q0(t1) q1(t2 | t1); each fails by chance with alpha = 1e-3."""
    q0, joint = target_law
    assert gof_pvalue(tokens[:, 0], q0) > SMALL_ALPHA
    vocab = joint.shape[0]
    pvalue = gof_pvalue(tokens[:, 0] * vocab + tokens[:, 1], joint.flatten())
    assert pvalue > SMALL_ALPHA, f"p-value {pvalue:.3g}"


def test_batched_chain_first_two_tokens_follow_target_law(tiny_pair, target_law):
    """1200 rows decoded together (k = 1, one shared draft cache): pairs ~ q0(t1) q1(t2 | t1)."""
    assert_pairs_follow(batched_first_two_tokens(tiny_pair, SPEC_GENERATIONS, seed=77), target_law)


def test_batched_chain_control_without_residual_fails(tiny_pair, target_law, monkeypatch):
    """Negative control for the test above (same power as the single-sequence control)."""
    import specgen.decoding.verify as engine_module

    monkeypatch.setattr(engine_module, "speculative_sampling", rule_without_residual)
    tokens = batched_first_two_tokens(tiny_pair, CONTROL_GENERATIONS, seed=9000)
    q0, _ = target_law
    pvalue = gof_pvalue(tokens[:, 0], q0)
    assert pvalue < SMALL_ALPHA, f"the broken batch passed: p-value {pvalue:.3g}"


# -- a pruned draft head (--draft-quant prune) stays lossless ---------------------------------------


def pruned_engine(pair, keep: int = 120) -> Engine:
    import copy

    from specgen.runtime.quant import apply_draft_quant

    target, draft = pair
    model = apply_draft_quant(copy.deepcopy(draft.model), "prune", keep=keep)
    return Engine(
        target.model, target.device, frozenset(), target.context_length, ChainDrafter(model, draft.device)
    )


def test_pruned_draft_chain_follows_target_law(tiny_pair, target_law):
    """The pruned draft proposes only kept ids and reports exactly that law. alpha = 1e-3."""
    tokens = first_two_tokens(pruned_engine(tiny_pair), Method.CHAIN, range(20000, 20000 + SPEC_GENERATIONS))
    _, joint = target_law
    vocab = joint.shape[0]
    pvalue = gof_pvalue(tokens[:, 0] * vocab + tokens[:, 1], joint.flatten())
    assert pvalue > SMALL_ALPHA, f"p-value {pvalue:.3g}"


def test_pruned_draft_control_reporting_the_unpruned_law_fails(tiny_pair, target_law, monkeypatch):
    """Negative control: sample from the pruned law but report the full draft's law."""
    real_sample = ChainDrafter._sample

    def misreporting_sample(self, logits, samplings):
        token, dist = real_sample(self, logits, samplings)
        finite = torch.isfinite(logits)
        spread = torch.where(finite, dist, torch.full_like(dist, 1.0))
        return token, spread / spread.sum(-1, keepdim=True)  # mass on ids it can never propose

    monkeypatch.setattr(ChainDrafter, "_sample", misreporting_sample)
    from specgen.runtime.pruned import PrunedHead

    monkeypatch.setattr(PrunedHead, "see", lambda self, ids: None)  # a static kept set: the same
    # engine serves every generation, and a growing head would soon keep every id the target drew
    tokens = first_two_tokens(
        pruned_engine(tiny_pair, keep=60), Method.CHAIN, range(30000, 30000 + CONTROL_GENERATIONS)
    )
    q0, _ = target_law
    pvalue = gof_pvalue(tokens[:, 0], q0)
    assert pvalue < SMALL_ALPHA, f"the misreporting draft passed: p-value {pvalue:.3g}"


# -- batched trees: every row of a dynamic batch of RSD-C trees follows the target law --------------


def batched_tree_first_two_tokens(pair, generations: int, seed: int) -> torch.Tensor:
    """`generations` rows of the one-token prompt, 300 at a time, RSD-C with 2 children per round
    (a tree round, then a plain round when the tree's path was rejected); row i seeded seed + i."""
    from specgen.decoding.drafters.base import PerRow
    from specgen.decoding.drafters.tree import RSDConstant

    target, draft = pair
    drafts = PerRow(lambda: RSDConstant(draft.model, draft.device, (2,)))
    engine = Engine(target.model, target.device, frozenset(), target.context_length, drafts)
    config = GenerationConfig(
        method=Method.RSD_C,
        branching=(2,),
        max_new_tokens=2,
        sampling=dataclasses.replace(ENGINE_SAMPLING, seed=seed),
    )
    finished = {
        r.index: r.state.ids[-2:]
        for r in engine.generate([ENGINE_PROMPT] * generations, config, 300)
        if isinstance(r.event, Finished)
    }
    return torch.tensor([finished[i] for i in range(generations)])


def test_batched_tree_first_two_tokens_follow_target_law(tiny_pair, target_law):
    """1200 RSD-C rows decoded together (recursive rejection per row): pairs ~ q0(t1) q1(t2 | t1)."""
    assert_pairs_follow(batched_tree_first_two_tokens(tiny_pair, SPEC_GENERATIONS, seed=177), target_law)


def test_batched_tree_control_with_an_unwarped_target_fails(tiny_pair, target_law, monkeypatch):
    """Negative control: the rows' verdicts drawn against the target without top-p must fail."""
    import specgen.decoding.verify as engine_module

    monkeypatch.setattr(
        engine_module,
        "warp",
        lambda logits, sampling: torch.softmax(logits.float() / sampling.temperature, dim=-1),
    )
    tokens = batched_tree_first_two_tokens(tiny_pair, CONTROL_GENERATIONS, seed=9100)
    q0, _ = target_law
    pvalue = gof_pvalue(tokens[:, 0], q0)
    assert pvalue < SMALL_ALPHA, f"the broken batch passed: p-value {pvalue:.3g}"

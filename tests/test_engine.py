"""Greedy speculative decoding must reproduce plain greedy decoding token for token (fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny import RowDrafterBase, batch_ids, decode, engine_with, per_row

from specgen.config import GenerationConfig, Method
from specgen.decoding.acceptance import ProposalKind
from specgen.decoding.drafters.base import Proposal
from specgen.decoding.drafters.model import ChainDrafter
from specgen.decoding.engine import Engine, StopReason
from specgen.decoding.events import Finished, RoundResult
from specgen.decoding.policy import PROMPT_CATCH_UP, Policy
from specgen.decoding.rows import RESUME_ROUNDS, RESUME_TOKENS
from specgen.runtime import kvcache

PROMPT = [257, 84, 82, 68, 81, 198, 71, 127, 102, 258, 198, 257, 64]


def reference_greedy(model, prompt: list[int], n: int, stop_ids=frozenset()) -> list[int]:
    """Obviously correct and slow: re-run the whole sequence without a cache for each token."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            out.append(token)
            if token in stop_ids:
                break
    return out


class ScriptedDrafter(RowDrafterBase):
    """Proposes the reference continuation for the first `right` tokens, then wrong ones."""

    def __init__(self, reference: list[int], prompt_len: int, right: int, vocab: int = 259):
        self.reference, self.prompt_len, self.right, self.vocab = reference, prompt_len, right, vocab
        self.observed: list[int] = []

    def propose(self, context, k, sampling):
        start = len(context) - self.prompt_len
        tokens = []
        for i in range(k):
            pos = start + i
            true = self.reference[pos] if pos < len(self.reference) else 0
            tokens.append(true if i < self.right else (true + 1) % self.vocab)
        return Proposal.chain(torch.tensor(tokens), ProposalKind.DETERMINISTIC)

    def observe(self, path):
        self.observed.append(len(path))


def engine_for(pair, drafter=None, stop_ids=frozenset(), policy=Policy()):
    target, _ = pair
    if isinstance(drafter, RowDrafterBase):
        drafter = per_row(drafter)
    return Engine(target.model, target.device, stop_ids, target.context_length, drafter, policy=policy)


def run(engine, prompt, **kwargs):
    config = GenerationConfig(**kwargs)
    rounds, _ = decode(engine, prompt, config)
    return [t for r in rounds for t in r.emitted], rounds


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return reference_greedy(tiny_pair[0].model, PROMPT, 40)


def test_plain_matches_reference(tiny_pair, reference):
    out, rounds = run(engine_for(tiny_pair), PROMPT, method=Method.PLAIN, max_new_tokens=40)
    assert out == reference
    assert len(rounds) == 40 and rounds[-1].stop == StopReason.LENGTH


@pytest.mark.parametrize("k", [1, 3, 4, 7])
def test_chain_with_model_draft_matches_plain(tiny_pair, reference, k):
    target, draft = tiny_pair
    drafter = ChainDrafter(draft.model, draft.device)
    out, _ = run(
        engine_for(tiny_pair, drafter), PROMPT, method=Method.CHAIN, max_new_tokens=40, draft_tokens=k
    )
    assert out == reference


def test_chain_with_target_as_draft_accepts_everything(tiny_pair, reference):
    target, _ = tiny_pair
    drafter = ChainDrafter(target.model, target.device)
    out, rounds = run(
        engine_for(tiny_pair, drafter), PROMPT, method=Method.CHAIN, max_new_tokens=40, draft_tokens=4
    )
    assert out == reference
    assert all(r.accepted == len(r.draft_tokens) for r in rounds)
    assert not rounds[0].draft_tokens  # a first token never waits for the draft to read the prompt
    assert len(rounds) == 9  # then 5 tokens per target forward


@pytest.mark.parametrize("k", [1, 4, 5])
def test_scripted_drafter_accepts_exactly_j(tiny_pair, reference, k):
    for j in range(k + 1):
        drafter = ScriptedDrafter(reference, len(PROMPT), right=j)
        out, rounds = run(
            engine_for(tiny_pair, drafter), PROMPT, method=Method.CHAIN, max_new_tokens=40, draft_tokens=k
        )
        assert out == reference, f"k={k} j={j}"
        full = [r for r in rounds if len(r.draft_tokens) == k]
        assert full and all(r.accepted == j for r in full), f"k={k} j={j}"


@pytest.mark.parametrize("j", [0, 2, 4])
def test_eos_inside_a_draft_stops_where_plain_stops(tiny_pair, reference, j):
    stop = frozenset({reference[9]})
    expected = reference_greedy(tiny_pair[0].model, PROMPT, 40, stop)
    plain, _ = run(engine_for(tiny_pair, stop_ids=stop), PROMPT, method=Method.PLAIN, max_new_tokens=40)
    drafter = ScriptedDrafter(reference, len(PROMPT), right=j)
    spec, rounds = run(
        engine_for(tiny_pair, drafter, stop), PROMPT, method=Method.CHAIN, max_new_tokens=40, draft_tokens=4
    )
    assert spec == plain == expected
    assert rounds[-1].stop == StopReason.EOS


@pytest.mark.parametrize("max_new", [1, 2, 5, 7, 9, 10])
def test_max_new_tokens_mid_round(tiny_pair, reference, max_new):
    target, _ = tiny_pair
    drafter = ChainDrafter(target.model, target.device)  # always right: rounds of 5
    out, rounds = run(
        engine_for(tiny_pair, drafter), PROMPT, method=Method.CHAIN, max_new_tokens=max_new, draft_tokens=4
    )
    assert out == reference[:max_new]
    assert rounds[-1].stop == StopReason.LENGTH


def test_context_limit_stops_generation(tiny_pair):
    target, draft = tiny_pair
    engine = engine_for(tiny_pair, ChainDrafter(draft.model, draft.device))
    prompt = PROMPT * 19  # 247 of 256 positions
    out, rounds = run(engine, prompt, method=Method.CHAIN, max_new_tokens=50)
    assert len(out) == 256 - len(prompt)
    assert rounds[-1].stop == StopReason.CONTEXT


def test_commit_then_continue_equals_fresh_prefill(tiny_pair):
    target, draft = tiny_pair
    drafter = ChainDrafter(draft.model, draft.device)
    engine = engine_for(tiny_pair, drafter)
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=23, draft_tokens=3)
    _, state = decode(engine, PROMPT, config)
    ids = state.ids
    assert kvcache.cache_length(state.cache) == len(ids) - 1
    with torch.no_grad():
        cached = kvcache.forward(target.model, state.cache, torch.tensor([ids[-1:]]))[0, -1]
        fresh = target.model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)
        # the draft cache holds a committed prefix; topping it up matches a fresh draft prefill
        held = drafter.cache.lengths[0]
        d_cached = kvcache.forward(draft.model, drafter.cache, torch.tensor([ids[held:]]))[0, -1]
        d_fresh = draft.model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(d_cached, d_fresh, atol=1e-4, rtol=1e-4)


def test_a_row_that_never_drafts_never_runs_the_draft(tiny_pair, reference):
    """The draft is fed a row's prompt lazily: at width cap 0 (a wide server batch) the draft
    model never runs, and when the cap lifts mid-generation the row catches up and stays exact."""
    _, draft = tiny_pair
    drafter, calls = ChainDrafter(draft.model, draft.device), []
    call = drafter.steps.call
    drafter.steps.call = lambda *args, **kwargs: calls.append(1) or call(*args, **kwargs)
    caps = [lambda width: 0]  # the cap of each run below, read at every round
    engine = engine_for(tiny_pair, drafter, policy=Policy(width_cap=lambda width, config: caps[0](width)))
    out, rounds = run(engine, PROMPT, method=Method.CHAIN, max_new_tokens=20, draft_tokens=3)
    assert out == reference[:20] and not calls
    steps = iter(range(100))
    caps[0] = lambda width: 0 if next(steps) < 5 else 3  # drafting allowed from round 6
    out, rounds = run(engine, PROMPT, method=Method.CHAIN, max_new_tokens=40, draft_tokens=3)
    assert out == reference and calls
    # the held row drafts once the cap allowed it RESUME_ROUNDS rounds in a row (rounds[0] is the
    # first token, from the prefill, before any round)
    resumed = 1 + 5 + RESUME_ROUNDS - 1
    assert [len(r.draft_tokens) for r in rounds[:resumed]] == [0] * resumed
    assert len(rounds[resumed].draft_tokens) == 3
    # a cap that lifts for fewer rounds than that (a batch narrowed between two requests) keeps the row plain
    calls.clear()
    steps = iter(range(100))
    caps[0] = lambda width: 3 if next(steps) % 4 == 3 else 0
    out, rounds = run(engine, PROMPT, method=Method.CHAIN, max_new_tokens=40, draft_tokens=3)
    assert out == reference and not calls
    # held back until fewer than RESUME_TOKENS remain: the row finishes plain, the draft unfed
    calls.clear()
    steps = iter(range(100))
    caps[0] = lambda width: 0 if next(steps) < 40 - RESUME_TOKENS + 1 else 3
    out, rounds = run(engine, PROMPT, method=Method.CHAIN, max_new_tokens=40, draft_tokens=3)
    assert out == reference and not calls and len(rounds) == 40


def counting(model) -> tuple[list, object]:
    """Calls of `model`'s forward (every forward runs its embedding), and the hook to remove."""
    calls: list = []
    return calls, model.get_input_embeddings().register_forward_hook(lambda *args: calls.append(1))


@pytest.mark.parametrize("method", [Method.CHAIN, Method.RSD_C, Method.LOOKUP_CHAIN])
def test_a_first_token_comes_from_the_prefill(tiny_pair, reference, method):
    """A prompt of more than PROMPT_CATCH_UP tokens: its first token comes from the prefill
    (one target forward, no draft forward: time to first token as plain decoding's), the draft
    reads the prompt in the first round, and the output stays exact. So does a chat turn that
    adds few tokens to a long conversation (the caches hold the rest: its first token must not
    depend on them). A short prompt has its first token speculated like any other."""
    config = GenerationConfig(method=method, max_new_tokens=20, draft_tokens=3, branching=(2, 1))
    engine = engine_with(tiny_pair, config, stop_ids=frozenset())
    (drafts, d_hook), (targets, t_hook) = counting(tiny_pair[1].model), counting(tiny_pair[0].model)
    first = []
    try:
        for report in engine.generate([PROMPT], config):
            if isinstance(report.event, RoundResult) and not first:
                first.append((report.event, len(drafts), len(targets)))
        assert len(PROMPT) > PROMPT_CATCH_UP
        assert not first[0][0].draft_tokens and first[0][1:] == (0, 1) and drafts
        rounds, state = decode(engine, PROMPT, config)
        assert [t for r in rounds for t in r.emitted] == reference[:20]
        turn, resumed = decode(engine, state.ids + PROMPT[: PROMPT_CATCH_UP - 1], config, resume=state)
        assert resumed.prompt_length - resumed.reused_tokens == PROMPT_CATCH_UP
        short = decode(engine, PROMPT[-PROMPT_CATCH_UP:], config)[0]
    finally:
        d_hook.remove()
        t_hook.remove()
    if method is not Method.LOOKUP_CHAIN:  # lookup-chain drafts from whichever source matches
        assert short[0].draft_tokens and not turn[0].draft_tokens


@pytest.mark.parametrize("deterministic", [False, True])
def test_rows_that_end_at_their_first_token_leave_before_any_round(tiny_pair, deterministic):
    """One new token per prompt, 5 prompts 2 rows at a time: every row ends at its prefill (a
    deterministic row after its window's replay), the next prompts still join, and no round runs."""
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(5)]
    config = GenerationConfig(
        method=Method.CHAIN, max_new_tokens=1, draft_tokens=3, deterministic=deterministic
    )
    expected = [reference_greedy(tiny_pair[0].model, p, 1) for p in prompts]
    engine = engine_with(tiny_pair, config, stop_ids=frozenset())
    (drafts, d_hook), (targets, t_hook) = counting(tiny_pair[1].model), counting(tiny_pair[0].model)
    try:
        assert [ids[len(p) :] for ids, p in zip(batch_ids(engine, prompts, config, 2), prompts)] == expected
    finally:
        d_hook.remove()
        t_hook.remove()
    assert not drafts and len(targets) == 5 * (2 if deterministic else 1)  # prefills (and replays)
    # a first token that is a stop token ends its row the same way
    engine = engine_with(tiny_pair, config, stop_ids=frozenset(t for [t] in expected))
    again = GenerationConfig(
        method=Method.CHAIN, max_new_tokens=8, draft_tokens=3, deterministic=deterministic
    )
    finished = [r.event.stop for r in engine.generate(prompts, again, 2) if isinstance(r.event, Finished)]
    assert finished == [StopReason.EOS] * 5


@pytest.mark.parametrize("method", [Method.PLAIN, Method.CHAIN])
def test_resume_reuses_the_cache_and_matches_a_fresh_prefill(tiny_pair, method):
    """A second turn prefills only its new tokens and generates what a fresh start would."""
    target, draft = tiny_pair
    config = GenerationConfig(method=method, max_new_tokens=12, draft_tokens=3)
    engine = engine_for(tiny_pair, ChainDrafter(draft.model, draft.device))
    _, state = decode(engine, PROMPT, config)
    turn2 = state.ids + [198, 257, 84, 82, 198]
    rounds, state = decode(engine, turn2, config, resume=state)
    assert state.reused_tokens == len(turn2) - 6  # everything before the new tokens' last one
    reused = [t for r in rounds for t in r.emitted]
    fresh_engine = engine_for(tiny_pair, ChainDrafter(draft.model, draft.device))
    fresh = [t for r in decode(fresh_engine, turn2, config)[0] for t in r.emitted]
    assert reused == fresh


def test_resume_continues_a_parked_row_that_was_not_the_first(tiny_pair):
    """A batch parks its last rows; the next generation may continue any of them (a server's
    request continuing another row of the last batch), not only row 0."""
    _, draft = tiny_pair
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=10, draft_tokens=3)
    engine = engine_for(tiny_pair, ChainDrafter(draft.model, draft.device))
    prompts = [PROMPT, PROMPT[:7] + [71, 72], PROMPT[3:] + [64, 65, 66]]
    for _ in engine.generate(prompts, config, batch_size=3):
        pass
    third = max(engine.parked, key=lambda state: state.row)
    assert third.row > 0
    turn2 = third.ids + [198, 257, 84]
    rounds, state = decode(engine, turn2, config, resume=third)
    assert state.reused_tokens == len(turn2) - 4
    fresh = [
        t
        for r in decode(engine_for(tiny_pair, ChainDrafter(draft.model, draft.device)), turn2, config)[0]
        for t in r.emitted
    ]
    assert [t for r in rounds for t in r.emitted] == fresh


def test_resume_after_a_differing_rerender_falls_back_to_the_first_difference(tiny_pair):
    target, draft = tiny_pair
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=8, draft_tokens=3)
    engine = engine_for(tiny_pair, ChainDrafter(draft.model, draft.device))
    _, state = decode(engine, PROMPT, config)
    changed = PROMPT[:5] + [99] + state.ids[6:] + [198]
    rounds, state = decode(engine, changed, config, resume=state)
    assert state.reused_tokens == 5
    reused = [t for r in rounds for t in r.emitted]
    fresh = [
        t
        for r in decode(engine_for(tiny_pair, ChainDrafter(draft.model, draft.device)), changed, config)[0]
        for t in r.emitted
    ]
    assert reused == fresh


class ShortDrafter(ScriptedDrafter):
    """Proposes a varying number of tokens, sometimes none, like a lookup drafter."""

    def propose(self, context, k, sampling):
        full = super().propose(context, k, sampling)
        return Proposal.chain(full.tokens[: len(context) % (k + 1)], full.kind)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_drafters_may_propose_fewer_tokens_or_none(tiny_pair, reference, temperature):
    from specgen.config import SamplingConfig

    sampling = SamplingConfig(temperature=temperature, seed=5)
    drafter = ShortDrafter(reference, len(PROMPT), right=3)
    out, rounds = run(
        engine_for(tiny_pair, drafter),
        PROMPT,
        method=Method.CHAIN,
        max_new_tokens=30,
        draft_tokens=4,
        sampling=sampling,
    )
    assert any(not r.draft_tokens for r in rounds) and any(r.draft_tokens for r in rounds)
    if temperature == 0.0:
        assert out == reference[:30]
    else:
        assert len(out) == 30


@pytest.mark.parametrize(
    "method", [Method.CHAIN, Method.LOOKUP_CHAIN, Method.RSD_C, Method.RSD_S, Method.MULTI_DRAFT]
)
def test_a_prompt_id_past_the_drafts_vocabulary_is_decoded_as_plain_decodes_it(tmp_path, method):
    """A target whose head is padded past its draft's (Qwen2.5-7B's 152064 rows beside 0.5B's
    151936): a prompt of token ids may hold an id the draft cannot embed. The draft reads a
    stand-in for it (its drafts are only guesses); the answer is plain decoding's, not an
    IndexError that failed every row of the batch."""
    from tiny import engine_with, save_tiny

    from specgen.models.load import load_pair
    from specgen.runtime.pair import Pair

    target, draft = load_pair(
        str(save_tiny(tmp_path / "t", seed=1, vocab=300)),
        str(save_tiny(tmp_path / "d", seed=1, vocab=259)),
        device="cpu",
        dtype="float32",
        quiet=True,
    )
    assert Pair(target, draft).vocab == 259
    prompt = [40, 41, 42, 280, 43, 44, 299, 45, 46, 47]
    plain = GenerationConfig(method=Method.PLAIN, max_new_tokens=12)
    want = decode(engine_with((target, draft), plain), prompt, plain)[1].ids
    config = GenerationConfig(method=method, max_new_tokens=12, draft_tokens=3)
    assert decode(engine_with((target, draft), config), prompt, config)[1].ids == want

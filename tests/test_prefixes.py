"""The prefix store: a finished row's K/V serves later prompts that start the same way, with
outputs exactly those of a full prefill, and only where a prefill would have run."""

from __future__ import annotations

import pytest
import torch
from test_engine import reference_greedy
from tiny import fed_tokens

from specgen.config import GenerationConfig, Method
from specgen.decoding.build import build_engine
from specgen.decoding.events import Finished, Joined, RoundResult
from specgen.runtime import kvcache
from specgen.runtime.pair import Pair
from specgen.runtime.prefixes import LEAST, PrefixStore

SHARED = [257, *range(70, 100), 198]  # a 32-token "system prompt"
ASKS = [
    [257, 84, 82, 68, 81, 198, 71, 127, 102, 258],
    [257, 101, 102, 103, 198, 66, 67, 258],
    [257, 120, 121, 198, 258, 198, 257, 64, 65],
]


def prefilled(model, ids: list[int]) -> kvcache.SlotCache:
    cache = kvcache.new_cache(model)
    kvcache.forward(model, cache, torch.tensor([ids]), keep=1)
    return cache


def test_a_stored_prefix_is_the_prefill_it_replaces(tiny_pair):
    model = tiny_pair[0].model
    store = PrefixStore(budget=1 << 20)
    first = SHARED + ASKS[0]
    store.save(prefilled(model, first), 0, first)
    second = SHARED + ASKS[1]
    fresh, loaded = prefilled(model, second), kvcache.new_cache(model)
    kvcache.forward(model, loaded, torch.tensor([[1]]), keep=1)  # buffers exist
    kvcache.crop(loaded, 0)
    common = len(SHARED) + 1  # the two asks also share their first token
    assert store.load(loaded, 0, second) == common == loaded.lengths[0] == store.loaded_tokens
    for a, b in zip(fresh.layers, loaded.layers):
        assert torch.equal(a.keys[0, :, :common], b.keys[0, :, :common])
        assert torch.equal(a.values[0, :, :common], b.values[0, :, :common])
    # the rest prefilled after the copy gives the fresh prefill's logits
    rest = kvcache.forward(model, loaded, torch.tensor([second[common:]]), keep=1)
    fresh = kvcache.forward(model, prefilled(model, second[:-1]), torch.tensor([second[-1:]]), keep=1)
    torch.testing.assert_close(rest[0, -1], fresh[0, -1])
    # never the whole prompt (its last token is fed for the logits), never less than LEAST tokens
    assert store.load(loaded, 0, first[:20]) == 19
    assert store.load(loaded, 0, SHARED[: LEAST - 1] + [5, 6, 7]) == 0
    assert store.load(loaded, 0, [5] * 40, have=3) == 3


def test_the_store_keeps_to_its_budget_and_to_the_longest_sequences(tiny_pair):
    model = tiny_pair[0].model
    long = SHARED + ASKS[0] + ASKS[1]
    cache = prefilled(model, long)
    store = PrefixStore(budget=1 << 20)
    store.save(cache, 0, long[:40])
    store.save(cache, 0, long)  # extends the first: replaces it
    store.save(cache, 0, long[:30])  # held already
    assert [len(e.ids) for e in store.entries.values()] == [len(long)]
    per_token = store.held // len(long)
    others = [prefilled(model, [250 - i] * 20 + ASKS[0]) for i in range(3)]
    small = PrefixStore(budget=2 * 30 * per_token)  # two of the three 30-token sequences
    for i, other in enumerate(others):
        small.save(other, 0, [250 - i] * 20 + ASKS[0])
    assert small.held <= small.budget and [e.ids[0] for e in small.entries.values()] == [
        249,
        248,
    ]  # oldest out
    nothing = PrefixStore(budget=0)
    nothing.save(cache, 0, long)
    assert not nothing.entries


@pytest.mark.parametrize("method", [Method.PLAIN, Method.CHAIN, Method.LOOKUP_CHAIN])
def test_a_later_prompt_prefills_only_what_it_does_not_share(tiny_pair, method):
    """Requests one after another through one pair's engines: each finished row goes to the
    stores, the next prompt copies the shared prefix into target and draft and prefills the
    rest; the greedy output is the target's own."""
    target, draft = tiny_pair
    pair = Pair(target, draft)
    pair.keep_prefixes()
    config = GenerationConfig(method=method, max_new_tokens=12, draft_tokens=3)
    prompts = [SHARED + ask for ask in (ASKS[1], ASKS[2], ASKS[0])]  # the last ends at its first token
    (t_fed, t_hook), (d_fed, d_hook) = fed_tokens(target.model), fed_tokens(draft.model)
    try:
        for i, prompt in enumerate(prompts):
            engine = build_engine(pair, config)  # a fresh engine each time: only the stores carry over
            t_fed.clear()
            d_fed.clear()
            events = [r.event for r in engine.generate([prompt], config)]
            joined = next(e for e in events if isinstance(e, Joined))
            assert joined.reused_tokens == (0 if i == 0 else len(SHARED) + 1)
            assert t_fed[0] == len(prompt) - joined.reused_tokens  # the prefill
            if method is not Method.PLAIN and d_fed:
                assert d_fed[0] <= len(prompt) - (0 if i == 0 else len(SHARED))  # the draft's catch-up
            out = [t for e in events if isinstance(e, RoundResult) for t in e.emitted]
            assert out == reference_greedy(target.model, prompt, 12, engine.stop_ids)[: len(out)]
            assert isinstance(events[-1], Finished)
    finally:
        t_hook.remove()
        d_hook.remove()
    assert pair.target_prefixes.loaded_tokens == 2 * (len(SHARED) + 1)
    if method is not Method.PLAIN:
        assert pair.draft_prefixes.entries


def test_prompts_joining_together_share_the_first_ones_prefill(tiny_pair):
    """A prompt's K/V is stored once it is prefilled: the next row joining the same batch copies
    the shared prefix without waiting for the first row to finish."""
    pair = Pair(*tiny_pair)
    pair.keep_prefixes()
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=10, draft_tokens=3)
    prompts = [SHARED + ask for ask in ASKS]
    reused, outputs = {}, {}
    for report in build_engine(pair, config).generate(prompts, config, batch_size=3):
        if isinstance(report.event, Joined):
            reused[report.index] = report.event.reused_tokens
        if isinstance(report.event, Finished):
            outputs[report.index] = report.state.ids[len(prompts[report.index]) :]
    assert reused == {0: 0, 1: len(SHARED) + 1, 2: len(SHARED) + 1}
    stop_ids = tiny_pair[0].stop_ids
    for i, prompt in enumerate(prompts):
        assert outputs[i] == reference_greedy(tiny_pair[0].model, prompt, 10, stop_ids)[: len(outputs[i])]


@pytest.mark.parametrize("method", [Method.CHAIN, Method.RSD_S, Method.MULTI_DRAFT, Method.LOOKUP_CHAIN])
def test_a_seeded_sampled_prompt_draws_the_same_tokens_cached_or_not(tiny_pair, method):
    """Its first token comes from its prefill whether the caches held its prompt or not (the
    prefix store, a parked row it resumes), so its random numbers are used the same way: the
    same seed gives the same tokens. (A first token speculated only when cached drew them
    differently: a server's second call of a request answered otherwise than its first.)"""
    from tiny import decode

    from specgen.config import SamplingConfig

    pair = Pair(*tiny_pair)
    pair.keep_prefixes()
    config = GenerationConfig(
        method=method,
        max_new_tokens=16,
        draft_tokens=3,
        beam_width=2,
        depth=2,
        branching=(2, 1),
        sampling=SamplingConfig(temperature=0.9, seed=5),
    )
    prompt = SHARED + ASKS[0]
    fresh, state = decode(build_engine(pair, config), prompt, config)
    stored_engine = build_engine(pair, config)
    stored, parked = decode(
        stored_engine, prompt, config
    )  # the prefix store holds all of it but its last token
    assert parked.reused_tokens == len(prompt) - 1
    resumed, again = decode(stored_engine, prompt, config, resume=parked)  # the parked row continues
    assert again.reused_tokens == len(prompt) - 1
    ids = [state.ids, parked.ids, again.ids]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) > len(prompt)


def test_deterministic_mode_prefills_its_whole_prompt(tiny_pair):
    """Its output depends on the request alone: it never takes another request's K/V."""
    pair = Pair(*tiny_pair)
    pair.keep_prefixes()
    config = GenerationConfig(
        method=Method.CHAIN, max_new_tokens=8, draft_tokens=3, deterministic=True, verify_window=4
    )
    for ask in ASKS[:2]:
        events = [r.event for r in build_engine(pair, config).generate([SHARED + ask], config)]
        assert next(e for e in events if isinstance(e, Joined)).reused_tokens == 0
    assert pair.target_prefixes.entries  # it still gives its own to others

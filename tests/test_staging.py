"""Chunked prefill: a long prompt joining rows that decode is prefilled a chunk per round of
theirs, then joins with the tokens a whole prefill gives it."""

from __future__ import annotations

from collections import deque

import pytest
from test_engine import reference_greedy
from tiny import engine_with, fed_tokens

from specgen.config import GenerationConfig, Method
from specgen.decoding.events import Finished, Joined, RoundResult, StopReason
from specgen.decoding.feed import Request

SHORT = [257, 84, 82, 68, 81, 198, 71]
LONG = [257, *range(60, 100), 198, 71, 127, 102, 258, 198, 257, 64]  # 49 tokens
CHUNK = 8


class Feed:
    """SHORT, then LONG from the `later`-th take on (it arrives while SHORT decodes); LONG is
    dropped (its client left) once `dropped()` was asked `drop_after` times."""

    def __init__(self, config, later: int = 3, drop_after: int = 1 << 30):
        self.waiting = deque(Request(list(p), i, config) for i, p in enumerate([SHORT, LONG]))
        self.takes = self.asked = 0
        self.later, self.drop_after = later, drop_after

    def take(self, room):
        self.takes += 1
        room = room if self.takes >= self.later else int(self.takes == 1)  # SHORT first, LONG later
        return [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]

    def dropped(self):
        self.asked += 1
        return {1} if self.asked > self.drop_after else set()


def events_of(engine, config, **feed):
    return [(r.index, r.event) for r in engine.drive(Feed(config, **feed), 2)]


@pytest.mark.parametrize("method", [Method.PLAIN, Method.CHAIN, Method.LOOKUP_CHAIN])
def test_a_long_prompt_joining_decoding_rows_is_prefilled_a_chunk_per_round(tiny_pair, method):
    target = tiny_pair[0]
    config = GenerationConfig(method=method, max_new_tokens=16, draft_tokens=3)
    engine = engine_with(tiny_pair, config, stop_ids=frozenset(), prefill_chunk=CHUNK)
    fed, hook = fed_tokens(target.model)
    try:
        events = events_of(engine, config)
    finally:
        hook.remove()
    joined = [i for i, (index, event) in enumerate(events) if isinstance(event, Joined)]
    short_rounds_before = sum(
        1 for index, event in events[: joined[1]] if index == 0 and isinstance(event, RoundResult)
    )
    chunks = -(-len(LONG) // CHUNK)
    assert short_rounds_before >= chunks  # the short row kept decoding while the long one was fed
    assert max(fed[1:]) <= max(CHUNK, 2 * (config.round_tokens + 1))  # no forward fed the long prompt whole
    assert events[joined[1]][1].prefill_seconds > 0
    for index, prompt in enumerate([SHORT, LONG]):
        out = [t for i, e in events if i == index and isinstance(e, RoundResult) for t in e.emitted]
        assert out == reference_greedy(target.model, prompt, 16)
        assert isinstance([e for i, e in events if i == index][-1], Finished)


def test_deterministic_mode_and_a_batch_with_nothing_decoding_prefill_whole(tiny_pair):
    """A long prompt is staged only when it joins rows that already decode: not in deterministic
    mode, not alone, not among the prompts a batch starts with."""
    config = GenerationConfig(
        method=Method.CHAIN, max_new_tokens=8, draft_tokens=3, deterministic=True, verify_window=4
    )
    engine = engine_with(tiny_pair, config, stop_ids=frozenset(), prefill_chunk=CHUNK)
    fed, hook = fed_tokens(tiny_pair[0].model)
    try:
        events = events_of(engine, config)
        assert len(LONG) in fed  # deterministic: one whole prefill
        fed.clear()
        plain = GenerationConfig(method=Method.PLAIN, max_new_tokens=8)
        list(engine.generate([LONG], plain))  # nothing decoding: whole
        assert fed[0] == len(LONG)
        fed.clear()
        list(engine.generate([SHORT, LONG], plain, batch_size=2))  # both start the batch: whole
        assert fed[:2] == [len(SHORT), len(LONG)]
    finally:
        hook.remove()
    assert [i for i, e in events if isinstance(e, Joined)] == [0, 1]


def test_a_staged_request_whose_client_left_ends_without_joining(tiny_pair):
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=16, draft_tokens=3)
    engine = engine_with(tiny_pair, config, stop_ids=frozenset(), prefill_chunk=CHUNK)
    events = events_of(engine, config, drop_after=3)
    mine = [e for i, e in events if i == 1]
    assert [type(e) for e in mine] == [Joined, Finished] and mine[1].stop == StopReason.CANCELLED
    out = [t for i, e in events if i == 0 and isinstance(e, RoundResult) for t in e.emitted]
    assert out == reference_greedy(tiny_pair[0].model, SHORT, 16)


@pytest.mark.parametrize("method", [Method.CHAIN, Method.LOOKUP_CHAIN])
def test_the_drafts_catch_up_of_a_long_prompt_is_chunked_too(tiny_pair, method):
    """In a batch, a row's draft catch-up feeds at most `catch_up_chunk` tokens a round, and
    the row drafts nothing until it is caught up; alone, it catches up at once. Exact either way."""
    target, draft = tiny_pair
    config = GenerationConfig(method=method, max_new_tokens=16, draft_tokens=3)
    engine = engine_with(tiny_pair, config, stop_ids=frozenset(), prefill_chunk=CHUNK)
    chain = engine.drafter if method is Method.CHAIN else engine.drafter.model
    chain.catch_up_chunk = CHUNK
    fed, hook = fed_tokens(draft.model)
    try:
        events = events_of(engine, config)
        assert max(fed) <= max(CHUNK, 2 * (config.round_tokens + 1))
        fed.clear()
        if method is Method.LOOKUP_CHAIN:  # else the memory holds LONG's reply: no model round
            engine.drafter.memories.clear()
        alone = [r.event for r in engine.generate([LONG], config)]
        assert max(fed) >= len(LONG) - 4 - 1  # alone: the whole prompt in one catch-up
    finally:
        hook.remove()
    for index, prompt in enumerate([SHORT, LONG]):
        out = [t for i, e in events if i == index and isinstance(e, RoundResult) for t in e.emitted]
        assert out == reference_greedy(target.model, prompt, 16)
    assert [t for e in alone if isinstance(e, RoundResult) for t in e.emitted] == reference_greedy(
        target.model, LONG, 16
    )


@pytest.mark.parametrize("method", [Method.PLAIN, Method.CHAIN])
def test_a_staged_prompt_whose_company_finished_joins_a_clean_batch(tiny_pair, method):
    """Every decoding row ends while a long prompt is still staged: the finished rows stay in the
    cache (parked for a resume), and the staged prompt joined beside them, so the next round's
    mask had one row more than the batch and the engine crashed. It now settles the cache first,
    as a request that joins an empty batch does."""
    target = tiny_pair[0]
    config = GenerationConfig(method=method, max_new_tokens=3, draft_tokens=2)
    engine = engine_with(tiny_pair, config, stop_ids=frozenset(), prefill_chunk=CHUNK)  # LONG: 7 chunks;
    # SHORT's 3 tokens end long before
    events = events_of(engine, config, later=3)
    for index, prompt in enumerate([SHORT, LONG]):
        out = [t for i, e in events if i == index and isinstance(e, RoundResult) for t in e.emitted]
        assert out == reference_greedy(target.model, prompt, 3)
        assert isinstance([e for i, e in events if i == index][-1], Finished)
